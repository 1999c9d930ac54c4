"""Tucker (HOSVD) compression of the stacked products to their query- and key-side subspaces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .products import HeadProducts
from .spectra import key_side_matrix, query_side_matrix


@dataclass
class TuckerSubspaces:
    """Orthonormal bases of the query- and key-side subspaces of T (HOSVD factors)."""

    query_basis: torch.Tensor  # (D_in, r_q)
    key_basis: torch.Tensor  # (D_in, r_k)
    query_singular_values: torch.Tensor
    key_singular_values: torch.Tensor


def tucker_subspaces(products: HeadProducts, rtol: float = 1e-3) -> TuckerSubspaces:
    """HOSVD of T restricted to its numerical support.

    Every CP-ALS update of the query factor lies in the column space of the query unfolding (likewise for
    keys). The fit reads the spectra and the leading directions (its shared-subspace start) from here.
    Directions below `rtol` of the largest singular value (under 1e-6 of the energy) are left out.
    """
    uq, sq = _left_singular(query_side_matrix(products), rtol)
    uk, sk = _left_singular(key_side_matrix(products), rtol)
    return TuckerSubspaces(uq, uk, sq, sk)


def _left_singular(matrix: torch.Tensor, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Leading left singular vectors (those above rtol * s_max) and all singular values of a tall or wide matrix.

    By a symmetric eigendecomposition of the smaller Gram matrix, in float32:
    a quarter of the time of a float64 SVD that returns vectors. Nothing downstream needs more: the vectors
    only seed the shared-subspace start (its error is then measured exactly), and float32 eigenvalues resolve
    singular values to ~3e-4 of s_max, so values below `rtol` (>= 1e-3, under 1e-6 of the energy) read as zero.
    """
    rows, cols = matrix.shape
    single = matrix.to(torch.float32)  # the Gram's rounding matches what the float32 eigh resolves anyway
    gram = single @ single.T if rows <= cols else single.T @ single
    energy, vectors = (t.to(matrix.dtype) for t in torch.linalg.eigh(gram))  # ascending
    energy, vectors = energy.flip(0), vectors.flip(1)
    singular = energy.clamp_min(0).sqrt()
    if not singular.numel() or singular[0] <= 0:
        return torch.eye(rows, 1, dtype=matrix.dtype), matrix.new_zeros(min(rows, cols))
    resolved = singular > rtol * singular[0]
    keep = max(int(resolved.sum()), 1)
    singular = torch.where(resolved, singular, torch.zeros_like(singular))
    if rows <= cols:
        left = vectors[:, :keep]
    else:  # U = M V / s for the kept directions
        left = (matrix @ vectors[:, :keep]) / singular[:keep]
    return left, singular[: min(rows, cols)]
