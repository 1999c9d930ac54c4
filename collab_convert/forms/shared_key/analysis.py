"""analyze in the shared-key form: per layer, the score energy each shared key direction carries (per RoPE
frequency, weighted by the queries that read it), how many cached numbers hold 90/95/99% of it, and at candidate
key budgets (--ranks: numbers per token and layer; else shares of the key cache) what compress would keep per
layer, what it costs, and the score energy lost."""

from __future__ import annotations

from ...architectures.lookup import forms_offered
from ...architectures.source import SourceModel
from ...decompose.costs import original_grouped_cost, shared_key_cost
from ...decompose.shared_key import fit_shared_key, key_spectrum
from ...options import AnalyzeOptions, CompressOptions
from ...progress import Progress
from ...results import AnalysisResult, SharedKeyLayerAnalysis, rounded
from ..base import ENERGY_SHARES, predictions
from .fitting import allocate_ranks, score_shares, shape_of
from .statistics import calibrated_statistics, geometry_of, model_weight_statistics

KEY_CACHE_SHARES = (1.0, 0.75, 0.5, 0.25)


def analyze(source: SourceModel, options: AnalyzeOptions, settings: CompressOptions, progress: Progress,
            form: str) -> AnalysisResult:
    full = max(layer.full_rank for layer in source.layers)
    for rank in options.ranks or []:
        for layer in source.layers:
            layer.check_rank(rank)  # the same refusal as compress
    widths = options.ranks or sorted({max(2, round(share * full)) for share in KEY_CACHE_SHARES}, reverse=True)
    if options.calibration is not None:
        from ...stages import calibration_texts

        fitted, _ = calibration_texts(settings)
        statistics, _, _ = calibrated_statistics(source, settings.model_copy(update={"refine_steps": 0}), fitted,
                                                 progress)
    else:
        statistics = model_weight_statistics(source)
    budgets = {width: allocate_ranks(source, statistics, width) for width in widths}
    layers = []
    for index, layer in enumerate(source.layers):
        progress("analyzing", index, len(source.layers))
        layers.append(_analyze_layer(source, layer, statistics[layer.prefix], budgets))
    progress("analyzing", len(source.layers), len(source.layers))
    return AnalysisResult(model=source.source, family=source.family.name, form=form, layers=layers,
                          predictions=predictions(layers, widths), forms=forms_offered(source.config))


def _analyze_layer(source: SourceModel, layer, statistics, budgets) -> SharedKeyLayerAnalysis:
    geometry = geometry_of(layer)
    shares = score_shares(key_spectrum(statistics, geometry))
    # per cached number: a complex direction's share split over its two numbers
    ordered = sorted([v / 2 for row in shares.frequency_losses.tolist() for v in row for _ in (0, 1)]
                     + shares.pass_losses.tolist(), reverse=True)
    cumulative, running = [], 0.0
    for value in ordered:
        running += value
        cumulative.append(running)
    candidates = []
    for ranks in budgets.values():
        factors = fit_shared_key(statistics, geometry, ranks[layer.prefix])
        cost = shared_key_cost(shape_of(source, layer), ranks[layer.prefix].width, factors.query_core.numel(),
                               factors.pass_core.numel(), has_bias=layer.has_query_bias).cached(layer.caches_keys)
        candidates.append({**cost.as_dict(), "relative_error": round(factors.lost_energy, 6), "logit_error": None,
                           "frequency_ranks": list(ranks[layer.prefix].frequency_ranks)})
    return SharedKeyLayerAnalysis(
        name=layer.prefix, input_dim=layer.shape.input_dim, num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim,
        spectra={"shared_key": rounded(sorted((v ** 0.5 for v in ordered), reverse=True))},
        energy_ranks={"shared_key": {f"{share:.2f}": next((i + 1 for i, c in enumerate(cumulative)
                                                           if c >= share - 1e-9), len(cumulative))
                                     for share in ENERGY_SHARES}},
        original=original_grouped_cost(shape_of(source, layer), has_bias=layer.has_query_bias)
        .cached(layer.caches_keys).as_dict(),
        candidates=candidates, kv_heads=layer.kv_heads,
        frequency_spectra=[rounded(row) for row in shares.frequency_losses.tolist()],
    )
