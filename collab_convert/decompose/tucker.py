"""Tucker (HOSVD) compression of the stacked products to their query- and key-side subspaces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .products import COMPUTE_DTYPE, HeadProducts
from .spectra import key_side_matrix, query_side_matrix


@dataclass
class TuckerSubspaces:
    """Orthonormal bases of the query- and key-side subspaces of T (HOSVD factors), and their spectra."""

    query_basis: torch.Tensor | None  # (D_in, r_q); None when only the spectra were asked for
    key_basis: torch.Tensor | None  # (D_in, r_k)
    query_singular_values: torch.Tensor
    key_singular_values: torch.Tensor


# Singular values under this share of the largest read as zero: float32 Gram eigenvalues resolve singular values to
# ~3e-4 of the largest, and what lies below 1e-3 holds under 1e-6 of the energy.
RESOLUTION = 1e-3


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """All singular values of a matrix, largest first, to float32 resolution (those under RESOLUTION of the
    largest are zero)."""
    return _left_singular(matrix, RESOLUTION, vectors=False)[1].to(COMPUTE_DTYPE)


def row_singular_values(rows: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """singular_values(rows), given rows @ rows.T (float32) already: from that Gram where it is the smaller one."""
    if rows.shape[0] > rows.shape[1]:
        return singular_values(rows)
    energy = torch.linalg.eigvalsh(gram.to(torch.float32)).to(COMPUTE_DTYPE).flip(0)
    return _zero_unresolved(energy.clamp_min(0).sqrt(), RESOLUTION)


def _zero_unresolved(singular: torch.Tensor, rtol: float) -> torch.Tensor:
    """Singular values (largest first) with those under rtol of the largest set to zero."""
    if not singular.numel() or singular[0] <= 0:
        return torch.zeros_like(singular)
    return torch.where(singular > rtol * singular[0], singular, torch.zeros_like(singular))


def tucker_subspaces(products: HeadProducts, rtol: float = RESOLUTION, bases: bool = True) -> TuckerSubspaces:
    """HOSVD of T restricted to its numerical support; with bases=False, only its spectra (eigenvalues alone
    take under half the time of an eigendecomposition with vectors).

    Every CP-ALS update of the query factor lies in the column space of the query unfolding (likewise for
    keys). The fit reads the spectra and the leading directions (its shared-subspace start) from here.
    Directions below `rtol` of the largest singular value (under 1e-6 of the energy) are left out.
    """
    uq, sq = _left_singular(query_side_matrix(products), rtol, bases)
    uk, sk = _left_singular(key_side_matrix(products), rtol, bases)
    return TuckerSubspaces(uq, uk, sq, sk)


def _left_singular(matrix: torch.Tensor, rtol: float, vectors: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Leading left singular vectors (those above rtol * s_max, or None) and all singular values of a tall or
    wide matrix.

    By a symmetric eigendecomposition of the smaller Gram matrix, in float32: a quarter of the time of a
    float64 SVD that returns vectors. Nothing downstream needs more: the vectors only seed the shared-subspace
    start (its error is then measured exactly), and float32 eigenvalues resolve singular values to ~3e-4 of
    s_max, so values below `rtol` (>= 1e-3, under 1e-6 of the energy) read as zero.
    """
    rows, cols = matrix.shape
    single = matrix.to(torch.float32)  # the Gram's rounding matches what the float32 eigh resolves anyway
    gram = single @ single.T if rows <= cols else single.T @ single
    if vectors:
        energy, found = (t.to(matrix.dtype) for t in torch.linalg.eigh(gram))  # ascending
        energy, found = energy.flip(0), found.flip(1)
    else:
        energy, found = torch.linalg.eigvalsh(gram).to(matrix.dtype).flip(0), None
    singular = energy.clamp_min(0).sqrt()
    if not singular.numel() or singular[0] <= 0:
        return (torch.eye(rows, 1, dtype=matrix.dtype) if vectors else None), matrix.new_zeros(min(rows, cols))
    singular = _zero_unresolved(singular, rtol)
    keep = max(int((singular > 0).sum()), 1)
    if found is None:
        left = None
    elif rows <= cols:
        left = found[:, :keep]
    else:  # U = M V / s for the kept directions
        left = (matrix @ found[:, :keep]) / singular[:keep]
    return left, singular[: min(rows, cols)]
