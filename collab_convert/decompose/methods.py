"""Decomposition methods by name: the one place a method is registered.

A method turns a FitRequest (one layer's products, the rank, and optionally how real inputs are distributed)
into a LayerFit. Adding a method is one module with its fit function plus one entry in METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the fits import torch when they run: the method table itself is read by --help
    import torch

    from .als import FitResult
    from .calibrated import InputMetric
    from .products import CollaborativeFactors, HeadProducts
    from .tucker import TuckerSubspaces


@dataclass(frozen=True)
class FitRequest:
    products: HeadProducts
    rank: int
    max_iterations: int = 500
    tolerance: float = 1e-3
    device: str = "cpu"
    seed: int = 0
    # With calibration: how the query- and key-side inputs of this layer are distributed on real text.
    query_metric: InputMetric | None = None
    key_metric: InputMetric | None = None
    # The products' HOSVD (tucker_subspaces with bases), where the caller fits one layer at several ranks: computed
    # once instead of at every rank (weight-only fits read it).
    subspaces: TuckerSubspaces | None = None
    # With calibration: how much each head's attention moves the layer's output (calibrated.head_weights).
    head_weights: torch.Tensor | None = None

    @property
    def calibrated(self) -> bool:
        return self.query_metric is not None


@dataclass
class LayerFit:
    factors: CollaborativeFactors
    relative_error: float  # of the raw head products
    logit_error: float | None  # calibrated fits: share of logit energy on the calibration inputs lost
    content_bias_correction: torch.Tensor | None  # calibrated fits: added to the exact content bias
    per_head_truncation_error: float | None
    initialisation: str
    iterations: int
    query_spectrum: torch.Tensor  # singular values of the query-/key-side unfoldings, for reports
    key_spectrum: torch.Tensor
    head_weights: torch.Tensor | None = None  # the request's: refinement weighs the heads' KL alike


@dataclass(frozen=True)
class Method:
    name: str
    fit: Callable[[FitRequest], LayerFit]
    calibrates: bool  # whether it can use calibration statistics
    description: str


def _layer_fit(request: FitRequest, fit: FitResult, logit_error=None, correction=None) -> LayerFit:
    from .products import relative_error
    from .spectra import key_side_matrix, query_side_matrix

    products = request.products
    return LayerFit(
        factors=fit.factors,
        relative_error=relative_error(products, fit.factors) if logit_error is not None else fit.relative_error,
        logit_error=logit_error,
        content_bias_correction=correction,
        per_head_truncation_error=fit.per_head_truncation_error,
        initialisation=fit.initialisation,
        iterations=fit.iterations,
        query_spectrum=_known_or(fit.query_spectrum, products, query_side_matrix),
        key_spectrum=_known_or(fit.key_spectrum, products, key_side_matrix),
        head_weights=request.head_weights if logit_error is not None else None,
    )


def _known_or(known: torch.Tensor | None, products: HeadProducts, side) -> torch.Tensor:
    import torch

    return known if known is not None else torch.linalg.svdvals(side(products))


def fit_tucker_cp_als(request: FitRequest) -> LayerFit:
    from .als import fit_collaborative
    from .calibrated import fit_calibrated

    if request.calibrated:
        # Calibrated fits run the ALS to a tighter tolerance (refinement starts from it). Measured at rank 192 on
        # MiniLM with refinement: 1e-3 loses 0.0006 of mean cosine against 1e-4; 1e-5 gains nothing for 40% more.
        fit, correction = fit_calibrated(
            request.products, request.rank, request.query_metric, request.key_metric, request.max_iterations,
            min(request.tolerance, 1e-4), device=request.device, weights=request.head_weights,
        )
        return _layer_fit(request, fit, logit_error=fit.relative_error, correction=correction)
    fit = fit_collaborative(request.products, request.rank, request.max_iterations, request.tolerance, request.device,
                            request.subspaces)
    return _layer_fit(request, fit)


def fit_reference(request: FitRequest) -> LayerFit:
    from .reference import fit_reference_parafac

    return _layer_fit(request, fit_reference_parafac(request.products, request.rank, seed=request.seed))


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method("tucker-cp-als", fit_tucker_cp_als, calibrates=True,
               description="ours: Tucker compression, then CP-ALS on the factored core"),
        Method("reference-parafac", fit_reference, calibrates=False,
               description="the paper's: TensorLy parafac on the dense tensor, random start"),
    )
}


def method_named(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {name!r}")
    return METHODS[name]
