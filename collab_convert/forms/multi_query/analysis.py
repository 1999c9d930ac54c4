"""analyze in the multi-query form: per layer, the score energy of the shared key per RoPE frequency and the
output energy of the values; at candidate KV-cache shares (or --ranks as head widths), the head width W, the key's
frequency profile (one for the whole model), the key's and the values' energy lost, and what each costs: the KV
cache per token, the attention block's parameters (queries and outputs grow when W > d) and its compute."""

from __future__ import annotations

from ...architectures.lookup import forms_offered
from ...architectures.source import SourceModel
from ...decompose.costs import attention_cost
from ...decompose.shared_key import fit_shared_key, key_spectrum
from ...decompose.value_latent import output_metric, value_spectrum
from ...options import AnalyzeOptions, CompressOptions
from ...progress import Progress
from ...results import AnalysisResult, MultiQueryLayerAnalysis, RankPrediction, rounded
from ..base import ENERGY_SHARES
from ..shared_key.fitting import score_shares, shape_of
from ..shared_key.statistics import geometry_of
from .fitting import key_profile
from .serving import engines_taking, serving_width
from .statistics import statistics as gather

KV_CACHE_SHARES = (1.0, 0.75, 0.5, 0.25)


def analyze(source: SourceModel, options: AnalyzeOptions, settings: CompressOptions, progress: Progress,
            form: str) -> AnalysisResult:
    full = max(layer.full_rank for layer in source.layers)
    for rank in options.ranks or []:
        for layer in source.layers:
            layer.check_rank(rank)  # the same refusal as compress
    widths = options.ranks or sorted({serving_width(share * full, full) for share in KV_CACHE_SHARES}, reverse=True)
    texts = None
    if options.calibration is not None:
        from ...stages import calibration_texts

        texts, _ = calibration_texts(settings)
    keys, records, _ = gather(source, settings, texts, progress)
    profiles = {width: key_profile(source, keys, width) for width in widths}
    layers = []
    for index, layer in enumerate(source.layers):
        progress("analyzing", index, len(source.layers))
        layers.append(_analyze_layer(source, layer, records[layer.prefix], profiles))
    progress("analyzing", len(source.layers), len(source.layers))
    return AnalysisResult(model=source.source, family=source.family.name, form=form, layers=layers,
                          predictions=_predictions(layers, widths), forms=forms_offered(source.config))


def _analyze_layer(source: SourceModel, layer, record, profiles) -> MultiQueryLayerAnalysis:
    geometry, shape = geometry_of(layer), shape_of(source, layer)
    shares = score_shares(key_spectrum(record.statistics, geometry))
    weights = source.layout.read_all(source.reader, layer)
    values = value_spectrum(record.value_moment, output_metric(weights.output_weight, geometry))  # per head
    value_shares = values / values.sum().clamp_min(1e-30)
    key_numbers = sorted([v / 2 for row in shares.frequency_losses.tolist() for v in row for _ in (0, 1)],
                         reverse=True)
    candidates = []
    for width, profile in profiles.items():
        factors = fit_shared_key(record.statistics, geometry, profile)
        cost = attention_cost(shape, width, has_bias=layer.has_query_bias).as_dict()
        candidates.append({**cost, "relative_error": round(factors.lost_energy, 6), "logit_error": None,
                           "value_error": round(float(value_shares[width:].sum()), 6),
                           "frequency_ranks": list(profile.frequency_ranks), "engines": engines_taking(width)})
    return MultiQueryLayerAnalysis(
        name=layer.prefix, input_dim=layer.shape.input_dim, num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim, kv_heads=layer.kv_heads,
        spectra={"shared_key": rounded([v ** 0.5 for v in key_numbers]), "values": rounded(values.sqrt())},
        energy_ranks={"shared_key": _energy_ranks(key_numbers), "values": _energy_ranks(value_shares.tolist())},
        original=attention_cost(shape, has_bias=layer.has_query_bias).as_dict(), candidates=candidates,
        frequency_spectra=[rounded(row) for row in shares.frequency_losses.tolist()],
        value_spectrum=rounded(value_shares),
    )


def _energy_ranks(shares: list[float]) -> dict[str, int]:
    """Numbers per token holding 90/95/99% of the energy (shares largest first)."""
    found, running = {}, 0.0
    for share in ENERGY_SHARES:
        running, count = 0.0, 0
        for count, value in enumerate(shares, start=1):
            running += value
            if running >= share - 1e-9:
                break
        found[f"{share:.2f}"] = count
    return found


def _predictions(layers: list[MultiQueryLayerAnalysis], widths: list[int]) -> list[RankPrediction]:
    found = []
    for index, width in enumerate(widths):
        at = [layer.candidates[index] for layer in layers]
        found.append(RankPrediction(
            rank=width, parameters=sum(c["parameters"] for c in at),
            parameters_before=sum(layer.original["parameters"] for layer in layers),
            key_cache_per_token=sum(c["key_cache_per_token"] for c in at),
            key_cache_before=sum(layer.original["key_cache_per_token"] for layer in layers),
            value_cache_per_token=sum(c["value_cache_per_token"] for c in at),
            value_cache_before=sum(layer.original["value_cache_per_token"] for layer in layers),
            mean_relative_error=sum(c["relative_error"] for c in at) / len(at),
            mean_value_error=sum(c["value_error"] for c in at) / len(at),
        ))
    return found
