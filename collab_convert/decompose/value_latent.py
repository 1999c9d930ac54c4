"""A value latent shared by every head, for multi-query attention with one wide head (pure math, torch only).

Attention outputs are averages of values, y = sum_i W_o^(i) sum_t p_i(t) v_g(i)(t), so a linear map of the values
commutes with attention: one latent z = down v (all value heads stacked, W numbers per token) is what every head
averages, and head i's output projection absorbs its group's up-projection, W_o^(i) up[g(i)]. Exact when W is
every value head's numbers (G d).

Which latent: the one that loses the least output energy. With the second moment of the stacked values C (not
centred: the mean value passes through attention, whose weights sum to one) and each group's output metric
M_g = sum over its heads of W_o^(i)^T W_o^(i), the error of a value reaches the residual stream as
e^T M e, so the best rank-W map is a weighted PCA (shared_key.weighted_subspace) under M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .shared_key import HeadGeometry, weighted_subspace


@dataclass
class ValueLatent:
    """One layer's value latent: latent = down @ v (v: all value heads, (G d,)); head group g reads up[g] @ latent."""

    down: torch.Tensor  # (W, G d), unit rows: the latent stays at the values' own scale
    up: torch.Tensor  # (G, d, W)
    lost_energy: float  # share of the output energy of the values that the dropped directions carried

    @property
    def width(self) -> int:
        return self.down.shape[0]


def value_moment(values: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of v v^T for values (n, G, d): (G d, G d), float64."""
    stacked = values.reshape(values.shape[0], -1).double()
    return stacked.T @ stacked


def output_metric(output_weight: torch.Tensor, geometry: HeadGeometry) -> torch.Tensor:
    """(G, d, d): for each value group, sum over its query heads of W_o^(i)^T W_o^(i); `output_weight` is the
    output projection in nn.Linear layout (D, N_h d)."""
    blocks = output_weight.double().reshape(output_weight.shape[0], geometry.num_heads, geometry.head_dim)
    per_head = torch.einsum("ohd,ohe->hde", blocks, blocks)
    metric = torch.zeros(geometry.kv_heads, geometry.head_dim, geometry.head_dim, dtype=torch.float64)
    return metric.index_add_(0, geometry.group_of_head, per_head)


def fit_value_latent(moment: torch.Tensor, metric: torch.Tensor, width: int) -> ValueLatent:
    """The rank-`width` latent minimising E ||M^1/2 (v - up down v)||^2 (moment: (G d, G d); metric: (G, d, d))."""
    groups, d, _ = metric.shape
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
    weight = torch.block_diag(*metric.double())
    # a floor, so that an output projection that ignores a direction does not make the map singular
    weight = weight + 1e-9 * weight.diagonal().mean().clamp_min(1e-30) * torch.eye(weight.shape[0], dtype=weight.dtype)
    values, vectors = torch.linalg.eigh((weight + weight.T) / 2)
    root = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
    return weighted_subspace(moment.double(), root, width)
