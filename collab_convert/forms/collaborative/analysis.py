"""analyze in the CP form: the spectra of the concatenated query/key projections and of the stacked per-head
products, how many shared dimensions hold 90/95/99% of their energy, and what a fit at each candidate rank
costs and gives (with calibration, the logit error and the embedding cosine measured on held-out lines)."""

from __future__ import annotations

from ...architectures.lookup import forms_offered
from ...architectures.source import SourceModel
from ...decompose.als import starts_shared
from ...decompose.costs import candidate_ranks, collaborative_cost, original_cost
from ...decompose.methods import FitRequest, method_named
from ...decompose.spectra import energy_rank, spectra
from ...decompose.tucker import tucker_subspaces
from ...options import DEFAULT_METHOD, AnalyzeOptions, CompressOptions
from ...progress import Progress
from ...results import AnalysisResult, LayerAnalysis, rounded
from ...streaming import each_layer
from ..base import ENERGY_SHARES, predictions
from .ranks import estimator
from .statistics import calibrate, head_weights_of


def analyze(source: SourceModel, options: AnalyzeOptions, settings: CompressOptions, progress: Progress,
            form: str) -> AnalysisResult:
    wanted = options.ranks or candidate_ranks(max((layer.shape for layer in source.layers), key=lambda s: s.key_dim))
    for layer in source.layers:
        for rank in options.ranks or []:
            layer.check_rank(rank)  # the same refusal as compress
    metrics, held_out = _statistics(source, settings, progress)
    layers = each_layer(lambda layer: _analyze_layer(source, layer, wanted, metrics, settings.device),
                        source.layers, progress, "analyzing")
    result = AnalysisResult(model=source.source, family=source.family.name, form=form, layers=layers,
                            predictions=predictions(layers, wanted), forms=forms_offered(source.config))
    if options.calibration is not None or options.target_cosine is not None:
        _measure_fidelity(source, settings, metrics, held_out, result, progress)
    return result


def _statistics(source: SourceModel, settings: CompressOptions, progress: Progress):
    if settings.calibration is None:
        return None, None
    from ...stages import calibration_texts

    fitted, held_out = calibration_texts(settings)
    metrics, _ = calibrate(source, settings, fitted, progress, refine=False)
    return metrics, held_out


def _analyze_layer(source: SourceModel, layer, ranks: list[int], metrics, device: str = "cpu") -> LayerAnalysis:
    products = source.read_projections(layer).products(layer.shape.num_heads)
    metric = metrics[layer.prefix] if metrics else None
    fitted = [min(rank, layer.shape.key_dim) for rank in ranks]
    # one HOSVD for the spectra and every candidate rank's weight-only fit; its vectors only where a fit reads them
    subspaces = tucker_subspaces(products, bases=metric is None and any(starts_shared(products, at) for at in fitted))
    spec = spectra(products, (subspaces.query_singular_values, subspaces.key_singular_values))
    views = {
        "query_projection": spec.query_projection,
        "key_projection": spec.key_projection,
        "query_unfolding": spec.query_unfolding,
        "key_unfolding": spec.key_unfolding,
        "head_unfolding": spec.head_unfolding,
    }
    candidates = []
    weights = head_weights_of(source, layer, metric)  # as compress weighs them: the same logit error
    for at in fitted:
        fit = method_named(DEFAULT_METHOD).fit(FitRequest(
            products, at, device=device, query_metric=metric.query if metric else None,
            key_metric=metric.key if metric else None, subspaces=None if metric else subspaces,
            head_weights=weights,
        ))
        cost = collaborative_cost(layer.shape, at, layer.stores_content_bias(metric is not None))
        cost = cost.cached(layer.caches_keys).as_dict()
        candidates.append({**cost, "relative_error": round(fit.relative_error, 6),
                           "logit_error": None if fit.logit_error is None else round(fit.logit_error, 6)})
    return LayerAnalysis(
        name=layer.prefix,
        input_dim=layer.shape.input_dim,
        num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim,
        spectra={k: rounded(v) for k, v in views.items()},
        energy_ranks={
            k: {f"{share:.2f}": energy_rank(v, share) for share in ENERGY_SHARES}
            for k, v in views.items()
            if k != "head_unfolding"
        },
        original=original_cost(layer.shape, layer.has_query_bias).cached(layer.caches_keys).as_dict(),
        candidates=candidates,
    )


def _measure_fidelity(source: SourceModel, settings: CompressOptions, metrics, held_out, result: AnalysisResult,
                      progress: Progress) -> None:
    """Embedding cosines at every candidate rank (with calibration) and the smallest rank reaching a target."""
    measuring = estimator(source, settings.model_copy(update={"rank": "auto", "energy": None}), metrics, held_out)
    if measuring is None:
        return
    result.probe = measuring.probe.description
    if settings.calibration is not None:
        for prediction in result.predictions:
            estimate = measuring.at(prediction.rank, progress)
            prediction.cosine_mean, prediction.cosine_p01 = estimate.cosine_mean, estimate.cosine_p01
    if settings.target_cosine is not None:
        found = measuring.smallest_rank(settings.target_cosine, progress)
        result.target = {"target_cosine": settings.target_cosine, "rank": found.rank,
                         "cosine_mean": found.cosine_mean, "cosine_p01": found.cosine_p01}
