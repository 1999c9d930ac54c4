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


def tucker_subspaces(products: HeadProducts, rtol: float = 1e-10) -> TuckerSubspaces:
    """HOSVD of T restricted to its numerical support.

    Every CP-ALS update of the query factor lies in the column space of the query unfolding (likewise for
    keys), so ALS on the core projected onto these bases is the same iteration as ALS on T itself, at the
    cost of r instead of D_in.
    """

    def basis(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u, s, _ = torch.linalg.svd(matrix, full_matrices=False)
        keep = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
        return u[:, : max(keep, 1)], s

    uq, sq = basis(query_side_matrix(products))
    uk, sk = basis(key_side_matrix(products))
    return TuckerSubspaces(uq, uk, sq, sk)


def project(products: HeadProducts, subspaces: TuckerSubspaces) -> HeadProducts:
    """The Tucker core in factored form: core[i] = (Q_i U_q)^T (K_i U_k)."""
    return HeadProducts(products.query_heads @ subspaces.query_basis, products.key_heads @ subspaces.key_basis)


def identity_subspaces(core: HeadProducts) -> TuckerSubspaces:
    """The core's own coordinates are already its HOSVD basis, ordered by singular value."""
    eye_q = torch.eye(core.input_dim, dtype=core.query_heads.dtype)
    eye_k = torch.eye(core.key_heads.shape[2], dtype=core.key_heads.dtype)
    empty = torch.empty(0, dtype=core.query_heads.dtype)
    return TuckerSubspaces(eye_q, eye_k, empty, empty)


