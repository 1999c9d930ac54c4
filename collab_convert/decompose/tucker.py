"""Tucker (HOSVD) compression of the stacked products to their query- and key-side subspaces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .products import HeadProducts
from .spectra import key_side_matrix, query_side_matrix


@dataclass
class TuckerSubspaces:
    """Orthonormal bases of the query- and key-side subspaces of T (HOSVD factors), and their spectra."""

    query_basis: torch.Tensor | None  # (D_in, r_q); None when only the spectra were asked for
    key_basis: torch.Tensor | None  # (D_in, r_k)
    query_singular_values: torch.Tensor
    key_singular_values: torch.Tensor


def tucker_subspaces(products: HeadProducts, rtol: float = 1e-3, bases: bool = True) -> TuckerSubspaces:
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
    resolved = singular > rtol * singular[0]
    keep = max(int(resolved.sum()), 1)
    singular = torch.where(resolved, singular, torch.zeros_like(singular))
    if found is None:
        left = None
    elif rows <= cols:
        left = found[:, :keep]
    else:  # U = M V / s for the kept directions
        left = (matrix @ found[:, :keep]) / singular[:keep]
    return left, singular[: min(rows, cols)]
