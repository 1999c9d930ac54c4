"""Calibrated fits: the error that matters is the error of the attention logits on real inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .als import FitResult, fit_collaborative
from .products import COMPUTE_DTYPE, CollaborativeFactors, HeadProducts


@dataclass
class InputMetric:
    """How one side's inputs are distributed: E[(x . v)^2] = v^T covariance v, and their mean."""

    covariance: torch.Tensor  # (D, D), symmetric PSD
    mean: torch.Tensor  # (D,)


# The fit whitens each side with its inputs' covariance to the power WHITENING_POWER / 2, not with the square root
# that makes its error the logit error on the calibration text: the tempered metric weighs the directions that text
# rarely takes a little more than it does, and the fit carries over to other text better. Measured on
# all-MiniLM-L6-v2 calibrated on Brown news and scored on other text (benchmarks/cross_domain.py, docs/benchmarks.md,
# "A tempered metric"): at 0.75 every domain's mean cosine rose against 1 (the square root) at ranks 192 and 96;
# 0.6 gained more on short lines and lost on the documents, 0.9 sat between.
WHITENING_POWER = 0.75


def _ridge(covariance: torch.Tensor, ridge: float) -> float:
    """The shift added to one side's covariance, ridge * mean(diag C): it keeps directions the inputs never took
    alive. One definition for the metric's roots (_SideMetric) and for the logit error's products (_metric_times)."""
    return ridge * float(covariance.diagonal().mean().clamp_min(1e-12))


class _SideMetric:
    """One side's ridged input covariance C + _ridge(C) * I, decomposed once: `root()` is C^(1/2), the logits' own
    metric; `whitening()` is the fit's C^(power/2), scaled to the root's trace so that sides and layers keep their
    balance (at power 1 it is the root)."""

    def __init__(self, covariance: torch.Tensor, ridge: float, power: float = WHITENING_POWER):
        c = covariance.to(COMPUTE_DTYPE)
        c = 0.5 * (c + c.T)
        size = c.shape[0]
        shift = _ridge(c, ridge)
        values, self.vectors = torch.linalg.eigh(c + shift * torch.eye(size, dtype=c.dtype))
        values = values.clamp_min(shift)
        self.root_values = values.sqrt()
        tempered = values ** (power / 2)
        self.whitening_values = tempered * (self.root_values.sum() / tempered.sum())

    def _matrix(self, values: torch.Tensor) -> torch.Tensor:
        return (self.vectors * values) @ self.vectors.T

    def root(self) -> torch.Tensor:
        return self._matrix(self.root_values)

    def whitening(self, inverse: bool = False) -> torch.Tensor:
        return self._matrix(self.whitening_values.reciprocal() if inverse else self.whitening_values)


def whiten(products: HeadProducts, query_metric: InputMetric, key_metric: InputMetric,
           ridge: float = 1e-3, tempered: bool = False) -> HeadProducts:
    """The head products as the logits see them: (W_Q^(i) C_x^(1/2), W_K^(i) C_y^(1/2)) (the rank spread's
    energies); `tempered`: as the fit sees them, each side's C^(WHITENING_POWER/2) in place of its root
    (fit_calibrated). Each side's decomposition is dropped once applied."""
    def side(metric: InputMetric) -> torch.Tensor:
        found = _SideMetric(metric.covariance, ridge)
        return found.whitening() if tempered else found.root()

    return HeadProducts(products.query_heads @ side(query_metric), products.key_heads @ side(key_metric))


def _unwhitened(fit: FitResult, products: HeadProducts, scale: torch.Tensor | None, query_metric: InputMetric,
                key_metric: InputMetric, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fit's shared query and key in the raw inputs' basis. The ALS's factors are combinations of the whitened
    heads' rows (W_Q^(i) times the query side's whitening, scaled by sqrt(w_i)), so the same combinations of the raw
    rows, scaled alike, are the whitening's inverse times them: no inverses held through the fit (two D_in x D_in
    float64 matrices).
    Where the fit kept its start (no ALS ran: full rank), the inverses are computed then."""
    if fit.row_weights is not None:
        query_heads = products.query_heads if scale is None else products.query_heads * scale[:, None, None]
        query_weights, key_weights = fit.row_weights
        return (query_heads.reshape(-1, query_heads.shape[2]).T @ query_weights,
                products.key_heads.reshape(-1, products.key_heads.shape[2]).T @ key_weights)
    return (_SideMetric(query_metric.covariance, ridge).whitening(inverse=True) @ fit.factors.shared_query,
            _SideMetric(key_metric.covariance, ridge).whitening(inverse=True) @ fit.factors.shared_key)


def _metric_times(metric: InputMetric, ridge: float, factor: torch.Tensor) -> torch.Tensor:
    """C @ factor for one side's ridged covariance C (the square of _SideMetric's root), in COMPUTE_DTYPE, with no
    D_in x D_in temporary beside the covariance itself."""
    c = metric.covariance.to(COMPUTE_DTYPE)
    shift = _ridge(c, ridge)
    return (c @ factor).addmm_(c.T, factor).mul_(0.5).add_(factor, alpha=shift)  # 0.5 (C + C^T) + shift I


def _logit_error(products: HeadProducts, factors: CollaborativeFactors, scale: torch.Tensor | None,
                 query_metric: InputMetric, key_metric: InputMetric, ridge: float) -> float:
    """The share of the logit energy on the calibration inputs that the factors lose, the heads weighed as fitted:
    the error in the metric C^(1/2) on both sides, whatever metric the fit whitened with. Each head's
    ||C_x^(1/2) M C_y^(1/2)||^2 is tr(C_x M C_y M^T), so only products with the covariances themselves are needed:
    no root (an eigendecomposition per side) and no D_in x D_in matrix made (the roots and their temporaries put the
    CP form's fitting stage at 219 MB, 54% of a 12-layer GPT-2-medium-shaped checkpoint at rank 768, on a Xeon)."""
    query_heads, key_heads = products.query_heads.to(COMPUTE_DTYPE), products.key_heads.to(COMPUTE_DTYPE)
    shared_query, shared_key = factors.shared_query.to(COMPUTE_DTYPE), factors.shared_key.to(COMPUTE_DTYPE)
    mixing = factors.mixing.to(COMPUTE_DTYPE)
    if scale is not None:
        query_heads, mixing = query_heads * scale[:, None, None], mixing * scale[:, None]
    heads, width, size = query_heads.shape

    def head_grams(rows: torch.Tensor, metric: InputMetric) -> torch.Tensor:  # each head's R_i C R_i^T, (H, d, d)
        applied = _metric_times(metric, ridge, rows.reshape(-1, size).T)  # (D_in, H d)
        return rows @ applied.T.reshape(heads, width, size).transpose(1, 2)

    energy = float((head_grams(query_heads, query_metric) * head_grams(key_heads, key_metric)).sum())
    query_applied = _metric_times(query_metric, ridge, shared_query)  # C_x q~, (D_in, R)
    key_applied = _metric_times(key_metric, ridge, shared_key)
    inner = float((((query_heads @ query_applied) * (key_heads @ key_applied)).sum(1) * mixing).sum())
    fitted = float(((shared_query.T @ query_applied) * (shared_key.T @ key_applied) * (mixing.T @ mixing)).sum())
    lost = max(energy - 2.0 * inner + fitted, 0.0)
    return math.sqrt(lost / energy) if energy > 0 else 0.0


# How strongly the heads' output energies weigh: their square roots. Measured on all-MiniLM-L6-v2 calibrated on
# Brown news, scored on held-out news, fiction, reviews and short lines (benchmarks/cross_domain.py): the full
# energies (power 1) and their square roots gained alike on the mean cosines (+0.001-0.0025 at rank 96); the
# square roots lost less on the genre probe. The floor keeps a head whose output is (nearly) zero fitted at all.
HEAD_WEIGHT_POWER, HEAD_WEIGHT_FLOOR = 0.5, 0.05


def head_weights(value_heads: torch.Tensor, output_heads: torch.Tensor, key_covariance: torch.Tensor,
                 power: float = HEAD_WEIGHT_POWER, floor: float = HEAD_WEIGHT_FLOOR) -> torch.Tensor:
    """How much an error in each head's attention moves the layer's output, as (N_h,) weights of mean 1.

    A change dP_i of head i's attention moves the output by dP_i Y W_V^(i)T W_O^(i)T; since each row of dP_i sums
    to 0, what counts is the spread of the keys' inputs Y around their sequence's mean: the key covariance
    (centred per sequence). So head i weighs E||W_O^(i) W_V^(i) (y - mean)||^2 = tr(G_i S_i), with the output
    Gram G_i = W_O^(i)T W_O^(i) and S_i = W_V^(i) C_y W_V^(i)T, both d_k x d_k. `value_heads` (N_h, d_k, D_in) and
    `output_heads` (N_h, D_out, d_k): per query head (grouped values repeated)."""
    values = value_heads.to(COMPUTE_DTYPE)
    outputs = output_heads.to(COMPUTE_DTYPE)
    spread = values @ key_covariance.to(COMPUTE_DTYPE) @ values.transpose(1, 2)
    gram = outputs.transpose(1, 2) @ outputs
    energy = (gram * spread).sum((1, 2)).clamp_min(0)
    if not torch.isfinite(energy).all() or float(energy.sum()) <= 0:
        return torch.ones(value_heads.shape[0], dtype=COMPUTE_DTYPE)
    weights = (energy / energy.mean()) ** power
    weights = weights.clamp_min(floor)
    return weights / weights.mean()


def fit_calibrated(
    products: HeadProducts,
    rank: int,
    query_metric: InputMetric,
    key_metric: InputMetric,
    max_iterations: int = 500,
    tolerance: float = 1e-3,
    ridge: float = 1e-3,
    device: str | torch.device = "cpu",
    weights: torch.Tensor | None = None,
) -> tuple[FitResult, torch.Tensor]:
    """Fit the collaborative factors to the logits on real inputs rather than to the raw products.

    The logit error of head i on a query x and key y is x^T (T_i - T~_i) y. Over calibration inputs its mean
    square is ||C_x^(1/2) (T_i - T~_i) C_y^(1/2)||_F^2, so fitting the whitened products
    (W_Q^(i) C_x^(1/2), W_K^(i) C_y^(1/2)) minimises it, with the same algorithm. The fit tempers that metric to
    the power WHITENING_POWER / 2 (see there), and reports the logit error itself. The key covariance is taken
    around each sequence's own mean: an error that is the same for every key of a sequence only shifts the
    softmax and costs nothing, so no rank is spent on it. The query covariance is centred too, because the
    query mean's share of the error, mu_x^T (T_i - T~_i) y, is a per-key linear term that the content bias
    absorbs exactly: that correction is returned (N_h x D_in) for the caller to add to the content bias.

    `weights` (N_h,), from head_weights: head i's logit error counts weights[i] times, so the shared dimensions
    go where the layer's output would move most (its reported error is then the weighted share).
    """
    # each side's decomposition is dropped once applied (whiten), not held through the ALS (memory)
    whitened = whiten(products, query_metric, key_metric, ridge, tempered=True)
    scale = None if weights is None else weights.to(COMPUTE_DTYPE).sqrt()
    if scale is not None:  # sqrt(w_i) T_i fitted; its mixing row divided back below
        whitened = HeadProducts(whitened.query_heads * scale[:, None, None], whitened.key_heads)
    fit = fit_collaborative(whitened, rank, max_iterations, tolerance, device, own_products=True)
    del whitened  # the fit's own: its products, not ours to hold while the factors are carried back
    mixing = fit.factors.mixing if scale is None else fit.factors.mixing / scale[:, None].to(fit.factors.mixing.dtype)
    factors = CollaborativeFactors(*_unwhitened(fit, products, scale, query_metric, key_metric, ridge),
                                   mixing).balanced()
    # mu_x^T (T_i - T~_i) for every head, without forming T: (mu Q_i^T) K_i - ((mu Q~) * m_i) K~^T
    mean = query_metric.mean.to(COMPUTE_DTYPE)
    exact = torch.einsum("hdq,q,hdk->hk", products.query_heads, mean, products.key_heads)
    approximate = ((mean @ factors.shared_query) * factors.mixing) @ factors.shared_key.T
    correction = exact - approximate
    # The reported error is the logit error: the share of logit energy on real inputs that is lost (not the
    # tempered metric's). The truncation of the whitened products is no baseline for the raw ones: not reported.
    # Its row weights combine the whitened rows into the fit before it was carried back and balanced again: no
    # longer these factors'.
    logit_error = _logit_error(products, factors, scale, query_metric, key_metric, ridge)
    return replace(fit, factors=factors, relative_error=logit_error, per_head_truncation_error=None,
                   row_weights=None), correction
