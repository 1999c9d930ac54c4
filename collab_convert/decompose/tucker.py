"""Tucker (HOSVD) compression of the stacked products to their query- and key-side subspaces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .products import HeadProducts
from .spectra import RESOLUTION, left_singular, key_side_matrix, query_side_matrix


@dataclass
class TuckerSubspaces:
    """Orthonormal bases of the query- and key-side subspaces of T (HOSVD factors), and their spectra."""

    query_basis: torch.Tensor | None  # (D_in, r_q); None when only the spectra were asked for
    key_basis: torch.Tensor | None  # (D_in, r_k)
    query_singular_values: torch.Tensor
    key_singular_values: torch.Tensor


def tucker_subspaces(products: HeadProducts, rtol: float = RESOLUTION, bases: bool = True) -> TuckerSubspaces:
    """HOSVD of T restricted to its numerical support; with bases=False, only its spectra (eigenvalues alone
    take under half the time of an eigendecomposition with vectors).

    Every CP-ALS update of the query factor lies in the column space of the query unfolding (likewise for
    keys). The fit reads the spectra and the leading directions (its shared-subspace start) from here.
    Directions below `rtol` of the largest singular value (under 1e-6 of the energy) are left out.
    """
    uq, sq = left_singular(query_side_matrix(products), rtol, bases)
    uk, sk = left_singular(key_side_matrix(products), rtol, bases)
    return TuckerSubspaces(uq, uk, sq, sk)
