"""A value latent shared by every head, for multi-query attention with one wide head (pure math, torch only).

Attention outputs are averages of values, y = sum_i W_o^(i) sum_t p_i(t) v_g(i)(t), so a linear map of the values
commutes with attention: one latent z = down v (all value heads stacked, W numbers per token) is what every head
averages, and head i's output projection absorbs its group's up-projection, W_o^(i) up[g(i)]. Exact when W is
every value head's numbers (G d).

Which latent: the one that loses the least output energy. With the second moment of the stacked values C (not
centred: the mean value passes through attention, whose weights sum to one), the error e of a token's values
reaches the residual stream as e^T M e, so the best rank-W map is a weighted PCA (shared_key.weighted_subspace)
under M. What M is depends on how alike the heads of a group attend: where they attend to different tokens their
errors add up apart, M = blockdiag_g(sum over the heads of g of W_o^(i)^T W_o^(i)) ("per head"); where they attend
alike, a group's heads add their errors before the residual stream does, M = O^T O with O_g = sum over the heads
of g of W_o^(i) ("summed"). The form measures both starts on calibration text and keeps the better one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .shared_key import HeadGeometry, weighted_subspace


@dataclass
class ValueLatent:
    """One layer's value latent: latent = down @ v (v: all value heads, (G d,)); head i reads up[i] @ latent, or, as
    the PCA makes it, every head of group g reads up[g] @ latent."""

    down: torch.Tensor  # (W, G d), unit rows: the latent stays at the values' own scale
    up: torch.Tensor  # (G, d, W) as fitted, one per group; (N_h, d, W) once refined, one per head
    lost_energy: float  # share of the output energy of the values that the dropped directions carried

    @property
    def width(self) -> int:
        return self.down.shape[0]


def value_moment(values: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of v v^T for values (n, G, d): (G d, G d), float64."""
    stacked = values.reshape(values.shape[0], -1).double()
    return stacked.T @ stacked


def output_metric(output_weight: torch.Tensor, geometry: HeadGeometry, summed: bool = False) -> torch.Tensor:
    """(G d, G d): how a token's value error reaches the residual stream through the output projection
    (`output_weight`, nn.Linear layout (D, N_h d)): per head (block diagonal), or with a group's heads summed first
    (see the module docstring)."""
    blocks = output_weight.double().reshape(output_weight.shape[0], geometry.num_heads, geometry.head_dim)
    if summed:
        grouped = torch.zeros(blocks.shape[0], geometry.kv_heads, geometry.head_dim, dtype=torch.float64)
        grouped.index_add_(1, geometry.group_of_head, blocks)
        flat = grouped.flatten(1)  # (D, G d)
        return flat.T @ flat
    per_head = torch.einsum("ohd,ohe->hde", blocks, blocks)
    metric = torch.zeros(geometry.kv_heads, geometry.head_dim, geometry.head_dim, dtype=torch.float64)
    return torch.block_diag(*metric.index_add_(0, geometry.group_of_head, per_head))


def fit_value_latent(moment: torch.Tensor, metric: torch.Tensor, width: int, groups: int) -> ValueLatent:
    """The rank-`width` latent minimising E ||M^1/2 (v - up down v)||^2 (moment and metric: (G d, G d))."""
    d = moment.shape[0] // groups
    subspace = _subspace(moment, metric, width)
    down, up = subspace.to_shared.real, subspace.from_shared.real
    norms = down.norm(dim=1).clamp_min(1e-30)
    total = float(subspace.losses.sum())
    lost = float(subspace.losses[width:].sum()) / total if total > 0 else 0.0
    return ValueLatent(down / norms[:, None], (up * norms[None, :]).reshape(groups, d, width), lost)


def value_spectrum(moment: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """Output energy each latent direction carries, largest first: what analyze shows of the values."""
    return _subspace(moment, metric, 0).losses


def _subspace(moment: torch.Tensor, metric: torch.Tensor, width: int):
    weight = metric.double()
    # a floor, so that an output projection that ignores a direction does not make the map singular
    weight = weight + 1e-9 * weight.diagonal().mean().clamp_min(1e-30) * torch.eye(weight.shape[0], dtype=weight.dtype)
    values, vectors = torch.linalg.eigh((weight + weight.T) / 2)
    root = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
    return weighted_subspace(moment.double(), root, width)


def head_up_projections(latent: ValueLatent, group_of_head: torch.Tensor) -> torch.Tensor:
    """(N_h, d, W): each query head's up-projection (a fitted latent's are its group's)."""
    return latent.up if latent.up.shape[0] == group_of_head.shape[0] else latent.up[group_of_head]
