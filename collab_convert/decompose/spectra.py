"""Spectra for the PCA redundancy analysis: singular values of the views of one layer's query/key block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .products import COMPUTE_DTYPE, HeadProducts


@dataclass
class Spectra:
    """Singular values of the views of one attention layer that the analysis reports."""

    query_projection: torch.Tensor  # of W_Q (N_h*d_k x D_in): the concatenated heads
    key_projection: torch.Tensor
    query_unfolding: torch.Tensor  # of [T[1] ... T[N_h]] (D_in x N_h*D_in): the query-side shared subspace
    key_unfolding: torch.Tensor  # of [T[1]^T ... T[N_h]^T]
    head_unfolding: torch.Tensor  # of the head mode (N_h x D_in^2)


def query_side_matrix(products: HeadProducts) -> torch.Tensor:
    """A D_in x (N_h d_k) matrix with the same left singular vectors and values as the query unfolding.

    [T_1 ... T_N] [T_1 ... T_N]^T = sum_i Q_i^T (K_i K_i^T) Q_i = sum_i (Q_i^T R_i^T)(Q_i^T R_i^T)^T, with
    K_i K_i^T = R_i^T R_i from the thin QR of K_i^T (stable, no squaring).
    """
    return _side_matrix(products.query_heads, products.head_bases("key")[1])


def key_side_matrix(products: HeadProducts) -> torch.Tensor:
    return _side_matrix(products.key_heads, products.head_bases("query")[1])


def _side_matrix(heads: torch.Tensor, other_triangle: torch.Tensor) -> torch.Tensor:
    blocks = heads.transpose(1, 2) @ other_triangle.transpose(1, 2)  # (H, D_in, d_k)
    return blocks.permute(1, 0, 2).reshape(heads.shape[2], -1)


def head_gram(products: HeadProducts, dtype: torch.dtype = COMPUTE_DTYPE) -> torch.Tensor:
    """<T_i, T_j> = tr((Q_i Q_j^T)(K_j K_i^T)), an N_h x N_h matrix from the d_k-sized blocks of the stacked
    rows' Gram matrices (those the fits use, in float32)."""
    heads, d_k = products.num_heads, products.head_dim
    qq, kk = (products.row_gram(side, dtype, "cpu")[1].reshape(heads, d_k, heads, d_k)
              for side in ("query", "key"))
    return torch.einsum("iajb,iajb->ij", qq, kk).to(COMPUTE_DTYPE)


# Singular values under this share of the largest read as zero: float32 Gram eigenvalues resolve singular values to
# ~3e-4 of the largest, and what lies below 1e-3 holds under 1e-6 of the energy.
RESOLUTION = 1e-3


def singular_values(matrix: torch.Tensor, row_gram: torch.Tensor | None = None) -> torch.Tensor:
    """All singular values of a matrix, largest first, to float32 resolution (those under RESOLUTION of the
    largest are zero). `row_gram`: matrix @ matrix.T in float32, where the caller has it already."""
    return left_singular(matrix, RESOLUTION, vectors=False, row_gram=row_gram)[1]


def _zero_unresolved(singular: torch.Tensor, rtol: float) -> torch.Tensor:
    """Singular values (largest first) with those under rtol of the largest set to zero."""
    if not singular.numel() or singular[0] <= 0:
        return torch.zeros_like(singular)
    return torch.where(singular > rtol * singular[0], singular, torch.zeros_like(singular))


def left_singular(matrix: torch.Tensor, rtol: float, vectors: bool = True,
                  row_gram: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Leading left singular vectors (those above rtol * s_max, or None) and all singular values of a tall or
    wide matrix. `row_gram` (matrix @ matrix.T in float32, where the caller has it) is used where it is the
    smaller Gram matrix.

    By a symmetric eigendecomposition of the smaller Gram matrix, in float32: a quarter of the time of a
    float64 SVD that returns vectors. Nothing downstream needs more: the vectors only seed the shared-subspace
    start (its error is then measured exactly), and float32 eigenvalues resolve singular values to ~3e-4 of
    s_max, so values below `rtol` (>= 1e-3, under 1e-6 of the energy) read as zero.
    """
    rows, cols = matrix.shape
    if row_gram is not None and rows <= cols:
        gram = row_gram
    else:
        single = matrix.to(torch.float32)  # the Gram's rounding matches what the float32 eigh resolves anyway
        gram = single @ single.T if rows <= cols else single.T @ single
    # the values in float64 (whatever the matrix's dtype), the vectors in the matrix's own
    if vectors:
        energy, found = torch.linalg.eigh(gram)  # ascending
        energy, found = energy.to(COMPUTE_DTYPE).flip(0), found.to(matrix.dtype).flip(1)
    else:
        energy, found = torch.linalg.eigvalsh(gram).to(COMPUTE_DTYPE).flip(0), None
    singular = energy.clamp_min(0).sqrt()
    if not singular.numel() or singular[0] <= 0:
        return (torch.eye(rows, 1, dtype=matrix.dtype) if vectors else None), energy.new_zeros(min(rows, cols))
    singular = _zero_unresolved(singular, rtol)
    keep = max(int((singular > 0).sum()), 1)
    if found is None:
        left = None
    elif rows <= cols:
        left = found[:, :keep]
    else:  # U = M V / s for the kept directions
        left = (matrix @ found[:, :keep]) / singular[:keep].to(matrix.dtype)
    return left, singular[: min(rows, cols)]


def spectra(products: HeadProducts, unfoldings: tuple[torch.Tensor, torch.Tensor] | None = None) -> Spectra:
    """Every view's singular values, to float32 resolution: values under RESOLUTION of the largest read as zero.

    `unfoldings`: the query- and key-side values where the caller has them already (the HOSVD that the fits
    read computes them the same way, so the report's spectra are those compress reports). Through the Gram
    matrix's eigenvalues in float32 they cost a third of a float64 SVD, and the weights were float32 anyway.
    """
    if unfoldings is None:
        unfoldings = singular_values(query_side_matrix(products)), singular_values(key_side_matrix(products))
    head_eigs = torch.linalg.eigvalsh(head_gram(products, torch.float32)).flip(0).clamp_min(0).sqrt()
    # the projections' spectra from their rows' Gram matrices, which the fits compute anyway
    query_rows, query_gram = products.row_gram("query", torch.float32, "cpu")
    key_rows, key_gram = products.row_gram("key", torch.float32, "cpu")
    return Spectra(
        query_projection=singular_values(query_rows, query_gram),
        key_projection=singular_values(key_rows, key_gram),
        query_unfolding=unfoldings[0],
        key_unfolding=unfoldings[1],
        head_unfolding=head_eigs,
    )


def energy_rank(singular_values: torch.Tensor, share: float) -> int:
    """Smallest number of leading dimensions whose squared singular values hold `share` of the total."""
    energy = singular_values.to(COMPUTE_DTYPE) ** 2
    total = float(energy.sum())
    if total == 0:
        return 0
    cumulative = torch.cumsum(energy, 0) / total
    # A tiny slack keeps share=1.0 from tripping over rounding in the last place.
    return int(torch.searchsorted(cumulative, torch.tensor(share - 1e-12, dtype=COMPUTE_DTYPE)).item()) + 1




def spread_budget(energies: list[torch.Tensor], budget: int, floors: list[int], ceilings: list[int]) -> list[int]:
    """Ranks per layer summing to `budget` (at most), each within its floor and ceiling, that keep the most energy
    in all: each layer's `energies` are the energies of its shared directions, strongest first, so taking the
    strongest directions of all layers together gives each layer a prefix. Ties go to the earlier layer."""
    ranks = list(floors)
    items = [(-float(energy), layer, index) for layer, values in enumerate(energies)
             for index, energy in enumerate(values.tolist()) if floors[layer] <= index < ceilings[layer]]
    spent = sum(ranks)
    for _, layer, _ in sorted(items):
        if spent >= budget:
            break
        ranks[layer] += 1
        spent += 1
    return ranks
