"""The paper's re-parametrization, kept so anyone can reproduce the comparison (TensorLy, imported lazily)."""

from __future__ import annotations

from .als import FitResult
from .products import CollaborativeFactors, HeadProducts, relative_error


def fit_reference_parafac(products: HeadProducts, rank: int, seed: int = 0, tolerance: float = 1e-6) -> FitResult:
    """The paper's re-parametrization, for comparison: TensorLy CP-ALS on the dense tensor, random start.

    Cordonnier et al. run `parafac(T, rank, init="random", tol=1e-6)` (100 iterations) in float32, the
    precision of their code, and so does this. It builds the dense N_h x D_in x D_in tensor and a D_in^2 x R
    Khatri-Rao matrix, so it is slow and memory-hungry by design.
    """
    import tensorly as tl
    from tensorly.decomposition import parafac

    tl.set_backend("pytorch")
    dense = products.dense().float()
    cp, errors = parafac(dense, rank, init="random", tol=tolerance, random_state=seed, return_errors=True)
    weights, (mixing, shared_query, shared_key) = cp
    factors = CollaborativeFactors(*(f.to(products.query_heads.dtype) for f in (
        shared_query, shared_key, mixing * weights[None, :]))).balanced()
    error = relative_error(products, factors)
    return FitResult(factors, error, float("nan"), "random (reference)", len(errors), [error])


