"""analyze(): the PCA redundancy analysis of every attention layer, and what each candidate rank would give.
Returns a result object; prints nothing."""

from __future__ import annotations

from pathlib import Path

from .architectures.lookup import forms_offered
from .architectures.source import SourceModel, open_model
from .decompose.costs import candidate_ranks, collaborative_cost, original_cost
from .decompose.methods import FitRequest, method_named
from .decompose.spectra import energy_rank, spectra
from .options import DEFAULT_METHOD, AnalyzeOptions, CompressOptions
from .progress import Progress, no_progress
from .results import AnalysisResult, LayerAnalysis, RankPrediction, rounded

ENERGY_SHARES = (0.90, 0.95, 0.99)


def analyze(model: str, ranks: list[int] | None = None, progress: Progress = no_progress,
            options: AnalyzeOptions | None = None) -> AnalysisResult:
    """Spectra and energy ranks of every attention layer's query/key block, costs at candidate ranks, and the
    error a fit at each candidate rank gives. With calibration text, the logit error and the embedding cosine
    measured on held-out lines; with a target cosine, the smallest rank that reaches it."""
    options = options or AnalyzeOptions(ranks=ranks)
    from .stages import check_device

    check_device(options.device)
    progress("opening the model", 0, 1)
    source = open_model(model, options.form)
    progress("opening the model", 1, 1)
    try:
        if (source.form == "shared-key"):
            return _analyze_rotary(source, model, options, progress)
        wanted = options.ranks or candidate_ranks(max((layer.shape for layer in source.layers), key=lambda s: s.key_dim))
        for layer in source.layers:
            for rank in options.ranks or []:
                layer.check_rank(rank)  # the same refusal as compress
        from .stages import within_positions

        settings = within_positions(source, _fit_settings(options))
        metrics, held_out = _statistics(source, settings, progress)
        layers = []
        for index, layer in enumerate(source.layers):
            progress("analyzing", index, len(source.layers))
            layers.append(_analyze_layer(source, layer, wanted, metrics, settings.device))
        progress("analyzing", len(source.layers), len(source.layers))
        result = AnalysisResult(model=model, family=source.family.name, form=source.form, layers=layers,
                                predictions=_predictions(layers, wanted), forms=forms_offered(source.config))
        if options.calibration is not None or options.target_cosine is not None:
            _measure_fidelity(source, settings, metrics, held_out, result, progress)
    finally:
        source.close()
    return result


def _fit_settings(options: AnalyzeOptions) -> CompressOptions:
    """The settings compress would fit with (its defaults), for predictions; nothing is written anywhere."""
    return CompressOptions(rank="auto", output=Path("unused"), method=DEFAULT_METHOD, refine_steps=0,
                           **options.model_dump(exclude={"ranks", "plot"}))


def _statistics(source: SourceModel, settings: CompressOptions, progress: Progress):
    if settings.calibration is None:
        return None, None
    from .stages import calibrate, calibration_texts

    fitted, held_out = calibration_texts(settings)
    metrics, _ = calibrate(source, settings, fitted, progress, refine=False)
    return metrics, held_out


def _analyze_layer(source: SourceModel, layer, ranks: list[int], metrics, device: str = "cpu") -> LayerAnalysis:
    products = source.read_projections(layer).products(layer.shape.num_heads)
    spec = spectra(products)
    views = {
        "query_projection": spec.query_projection,
        "key_projection": spec.key_projection,
        "query_unfolding": spec.query_unfolding,
        "key_unfolding": spec.key_unfolding,
        "head_unfolding": spec.head_unfolding,
    }
    metric = metrics[layer.prefix] if metrics else None
    candidates = []
    for rank in ranks:
        at = min(rank, layer.shape.key_dim)
        fit = method_named(DEFAULT_METHOD).fit(FitRequest(
            products, at, device=device, query_metric=metric.query if metric else None,
            key_metric=metric.key if metric else None,
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


def _predictions(layers: list[LayerAnalysis], ranks: list[int]) -> list[RankPrediction]:
    predictions = []
    for index, rank in enumerate(ranks):
        at = [layer.candidates[index] for layer in layers]
        logit = [c["logit_error"] for c in at]
        predictions.append(RankPrediction(
            rank=rank,
            parameters=sum(c["parameters"] for c in at),
            parameters_before=sum(layer.original["parameters"] for layer in layers),
            key_cache_per_token=sum(c["key_cache_per_token"] for c in at),
            key_cache_before=sum(layer.original["key_cache_per_token"] for layer in layers),
            mean_relative_error=sum(c["relative_error"] for c in at) / len(at),
            mean_logit_error=None if None in logit else sum(logit) / len(logit),
        ))
    return predictions


def _measure_fidelity(source: SourceModel, settings: CompressOptions, metrics, held_out, result: AnalysisResult,
                      progress: Progress) -> None:
    """Embedding cosines at every candidate rank (with calibration) and the smallest rank reaching a target."""
    from .predict import FidelityEstimator, can_measure, default_probe

    if not can_measure(source):
        return
    probe = held_out or default_probe()
    estimator = FidelityEstimator(source, settings, probe, metrics)
    result.probe = probe.description
    if settings.calibration is not None:
        for prediction in result.predictions:
            estimate = estimator.at(prediction.rank, progress)
            prediction.cosine_mean, prediction.cosine_p01 = estimate.cosine_mean, estimate.cosine_p01
    if settings.target_cosine is not None:
        found = estimator.smallest_rank(settings.target_cosine, progress)
        result.target = {"target_cosine": settings.target_cosine, "rank": found.rank,
                         "cosine_mean": found.cosine_mean, "cosine_p01": found.cosine_p01}


KEY_CACHE_SHARES = (1.0, 0.75, 0.5, 0.25)


def _analyze_rotary(source: SourceModel, model: str, options: AnalyzeOptions, progress: Progress) -> AnalysisResult:
    """Rotary decoders: the shared rotary key's spectra per frequency (weighted by the queries that read it),
    and at candidate key budgets (--ranks: numbers per token and layer; else shares of the key cache) what
    compress would keep per layer, what it costs, and the score energy lost."""
    from .rotary_stages import allocate_ranks, calibrated_statistics, geometry_of, model_weight_statistics
    from .decompose.shared_key import fit_shared_key, key_spectrum

    full = max(layer.full_rank for layer in source.layers)
    for rank in options.ranks or []:
        for layer in source.layers:
            layer.check_rank(rank)  # the same refusal as compress
    widths = options.ranks or sorted({max(2, round(share * full)) for share in KEY_CACHE_SHARES}, reverse=True)
    if options.calibration is not None:
        from .stages import calibration_texts, within_positions

        settings = within_positions(source, _fit_settings(options).model_copy(update={"refine_steps": 0}))
        fitted, _ = calibration_texts(settings)
        statistics, _, _ = calibrated_statistics(source, settings, fitted, progress)
    else:
        statistics = model_weight_statistics(source)
    budgets = {width: allocate_ranks(source, statistics, width) for width in widths}
    layers = []
    for index, layer in enumerate(source.layers):
        progress("analyzing", index, len(source.layers))
        layers.append(_rotary_layer(source, layer, statistics[layer.prefix], budgets, geometry_of, fit_shared_key,
                                    key_spectrum))
    progress("analyzing", len(source.layers), len(source.layers))
    return AnalysisResult(model=model, family=source.family.name, form=source.form, layers=layers,
                          predictions=_predictions(layers, widths), forms=forms_offered(source.config))


def _rotary_layer(source, layer, statistics, budgets, geometry_of, fit_shared_key, key_spectrum) -> LayerAnalysis:
    from .decompose.costs import original_grouped_cost, shared_key_cost
    from .rotary_stages import _shape

    geometry = geometry_of(layer)
    spectrum = key_spectrum(statistics, geometry)
    total = float(spectrum.frequency_losses.sum() + spectrum.pass_losses.sum()) or 1.0
    shares = (spectrum.frequency_losses / total).tolist()
    ordered = sorted([v / 2 for row in shares for v in row for _ in (0, 1)]
                     + (spectrum.pass_losses / total).tolist(), reverse=True)  # per cached number
    cumulative, running = [], 0.0
    for value in ordered:
        running += value
        cumulative.append(running)
    candidates = []
    for width, ranks in budgets.items():
        factors = fit_shared_key(statistics, geometry, ranks[layer.prefix])
        cost = shared_key_cost(_shape(source, layer), ranks[layer.prefix].width,
                                  factors.query_core.numel(), factors.pass_core.numel(),
                                  has_bias=layer.has_query_bias).cached(layer.caches_keys).as_dict()
        candidates.append({**cost, "relative_error": round(factors.lost_energy, 6), "logit_error": None,
                           "frequency_ranks": list(ranks[layer.prefix].frequency_ranks)})
    return LayerAnalysis(
        name=layer.prefix, input_dim=layer.shape.input_dim, num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim,
        spectra={"query_unfolding": [], "key_unfolding": rounded(sorted((v ** 0.5 for v in ordered), reverse=True))},
        energy_ranks={"shared_key": {f"{share:.2f}": next((i + 1 for i, c in enumerate(cumulative)
                                                           if c >= share - 1e-9), len(cumulative))
                                     for share in ENERGY_SHARES}},
        original=original_grouped_cost(_shape(source, layer), has_bias=layer.has_query_bias)
        .cached(layer.caches_keys).as_dict(),
        candidates=candidates, frequency_spectra=[rounded(row) for row in shares], kv_heads=layer.kv_heads,
    )
