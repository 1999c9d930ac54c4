"""The stages of compressing into the shared-key form (decompose/shared_key.py): rotary decoders, and models with
absolute or relative positions asked for it (--form shared-key; no rotated dimension, all pass-through).

    statistics per layer (from the weights, or from the model run on calibration text)
    ->  one key-cache budget spread over layers and frequencies (allocate)
    ->  each layer fitted where its tensors stream past (stages.stream_weights)  ->  config.json records
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch

from .architectures.layouts import AttentionLayer
from .architectures.source import SourceModel
from .decompose.costs import SharedKeyShape, original_grouped_cost, shared_key_cost
from .decompose.shared_key import (
    KeyRanks,
    KeySpectrum,
    KeyStatistics,
    HeadGeometry,
    allocate,
    fit_shared_key,
    key_spectrum,
    projection_tokens,
    statistics_of,
)
from .cpu import reused_heap
from .errors import BadInputError
from .format import (
    FUSED_QUERY,
    FUSED_VALUE,
    KEY_MIXING,
    PASS_CORE,
    QUERY_CORE,
    SHARED_KEY,
    SHARED_KEY_BIAS,
    FormatConfig,
    HeadCounts,
    write_config,
)
from .io.spill import SpillFolder
from .io.writer import parse_size
from .options import CompressOptions
from .progress import DETAIL, Progress
from .results import LayerReport, rounded
from .stages import fit_workers, layer_labels, stream_weights


def geometry_of(layer: AttentionLayer) -> HeadGeometry:
    return HeadGeometry(layer.shape.num_heads, layer.kv_heads, layer.shape.head_dim, layer.rotary_dim)


def key_norm(source: SourceModel) -> bool:
    return source.layout.keeps_key_projection(source.config)


def layer_width(source: SourceModel, options: CompressOptions) -> int:
    """The shared key's numbers per token and layer, on average: --rank, or --key-cache of the original."""
    full = max(layer.full_rank for layer in source.layers)
    if options.key_cache is not None:
        if options.rank is not None:
            raise BadInputError("give --rank or --key-cache, not both")
        width = round(options.key_cache * full)
    elif isinstance(options.rank, int):
        width = options.rank
    else:
        raise BadInputError(
            f"{source.family.name} takes the shared-key form: give --key-cache (a share of the key cache, e.g. 0.5) or "
            f"--rank (the shared key's numbers per token and layer, at most {full})"
        )
    for layer in source.layers:
        layer.check_rank(width)
    if (not source.layout.rotates) and width < 1:
        raise BadInputError(f"a shared key needs at least 1 number per token, got {width}")
    if not (not source.layout.rotates) and width < 2:
        raise BadInputError(f"a shared rotary key needs at least 2 numbers per token (one complex dimension), "
                            f"got {width}")
    return width


def plan_layers(source: SourceModel, width: int) -> list[dict]:
    """What check_plan shows: each layer's query/key parameters before and after, at the average width."""
    layers = []
    for layer in source.layers:
        shape = _shape(source, layer)
        before = original_grouped_cost(shape, has_bias=layer.has_query_bias).parameters
        # with no rotated dimension every head maps its whole query onto the shared key (pass_core: N_h x d x R)
        cores = {"complex_core": 0, "pass_core": layer.shape.num_heads * layer.shape.head_dim * width} \
            if not layer.rotary_dim else {}
        after = shared_key_cost(shape, width, **cores, has_bias=layer.has_query_bias).parameters
        layers.append({"name": layer.prefix, "rank": width, "parameters_before": before, "parameters_after": after})
    return layers


def _shape(source: SourceModel, layer: AttentionLayer) -> SharedKeyShape:
    return SharedKeyShape(layer.shape.input_dim, layer.shape.num_heads, layer.kv_heads, layer.shape.head_dim,
                       key_norm(source))


# --- statistics -------------------------------------------------------------------------------------------------

def weight_statistics(source: SourceModel, layer: AttentionLayer) -> KeyStatistics:
    """From the weights alone, inputs taken as isotropic. Where a QK-norm sits before RoPE, its scale is applied
    to the projected tokens and each head's vectors are brought to unit mean square, as the norm does."""
    weights = source.layout.read(source.reader, layer)
    geometry = geometry_of(layer)
    scale, shift = _input_norm(source, layer)
    d = geometry.head_dim
    queries = projection_tokens(*_through_norm(weights.query_weight, weights.query_bias, scale, shift),
                                geometry.num_heads, d)
    keys = projection_tokens(*_through_norm(weights.key_weight, weights.key_bias, scale, shift), geometry.kv_heads, d)
    layout = source.layout
    if layout.query_norm and key_norm(source):
        queries = _normalised(queries, _norm_scale(source, layer, layout.query_norm), layout.norm_over_heads)
        keys = _normalised(keys, _norm_scale(source, layer, layout.key_norm), layout.norm_over_heads)
    return statistics_of(queries, keys, geometry)


def model_weight_statistics(source: SourceModel, scratch: Path | None = None) -> MutableMapping[str, KeyStatistics]:
    """Weight-only statistics of every layer, one input shard mapped at a time, as when streaming. With a
    `scratch` folder they wait on disk: a layer without rotation holds a (G d)^2 key covariance, 8 MB at
    GPT-2-medium's width, which over all layers would grow the peak with depth."""
    statistics = SpillFolder(scratch / "key-statistics") if scratch is not None else {}
    for layer in source.layers:
        source.reader.release_all_but(layer.anchor)
        statistics[layer.prefix] = weight_statistics(source, layer)
    return statistics


class _StatisticsOf(Mapping):
    """Each layer's statistics, read from its calibration record when asked (the records may wait on disk:
    holding every layer's statistics at once would grow the peak with depth)."""

    def __init__(self, calibrations: Mapping):
        self.calibrations = calibrations

    def __getitem__(self, prefix: str) -> KeyStatistics:
        return self.calibrations[prefix].statistics

    def __iter__(self):
        return iter(self.calibrations)

    def __len__(self) -> int:
        return len(self.calibrations)


def _input_norm(source: SourceModel, layer: AttentionLayer):
    """Scale and shift of the norm in front of the attention: a normalised hidden state has unit-scale channels,
    so the attention's inputs are about scale * unit + shift (decoders' channel scales differ by orders of
    magnitude, which an isotropic guess would miss)."""
    names = source.layout.input_norm_names(layer.prefix)
    if names is None or names[0] not in source.reader:
        return None, None
    scale = _effective_scale(source, source.reader.get(names[0]))
    shift = source.reader.get(names[1]).double() if names[1] in source.reader else None
    return scale, shift


def _effective_scale(source: SourceModel, weight: torch.Tensor) -> torch.Tensor:
    """What an RMSNorm's weight multiplies by: Gemma's multiplies by (1 + weight), as its model_type says."""
    scale = weight.double()
    return scale + 1 if str(source.config.get("model_type", "")).startswith("gemma") else scale


def _through_norm(weight: torch.Tensor, bias: torch.Tensor | None, scale, shift):
    if scale is None:
        return weight, bias
    bias = bias.double() if bias is not None else None
    if shift is not None:
        moved = weight.double() @ shift
        bias = moved if bias is None else bias + moved
    return weight.double() * scale[None, :], bias


def _norm_scale(source: SourceModel, layer: AttentionLayer, norm: str) -> torch.Tensor | None:
    name = f"{layer.prefix}.{norm}.weight"
    if name not in source.reader:
        return None
    return _effective_scale(source, source.reader.get(name))


def _normalised(tokens: torch.Tensor, scale: torch.Tensor | None, over_heads: bool) -> torch.Tensor:
    span = tokens.flatten(1) if over_heads else tokens
    mean_square = (span**2).sum(0, keepdim=True).mean(-1, keepdim=True)  # per head (or all), over the tokens
    unit = (span / mean_square.clamp_min(1e-30).sqrt()).reshape(tokens.shape)
    if scale is None:
        return unit
    return unit * scale.reshape(-1, tokens.shape[-1]) if over_heads else unit * scale


SHARED_KEY_REFINE_SAMPLES = 64  # raw sequences kept per layer for refinement (float16 queries and keys)


def calibrated_statistics(source: SourceModel, options: CompressOptions, texts: list[str], progress: Progress,
                          scratch: Path | None = None):
    """(statistics per layer, calibrations per layer with refinement samples, what the report says). With a
    `scratch` folder the model runs a block at a time and the calibrations wait there (capture.py)."""
    from .integration.shared_key_capture import collect_shared_key_statistics

    layers = {layer.prefix: (geometry_of(layer), HeadCounts(layer.shape.num_heads, layer.kv_heads), layer.causal)
              for layer in source.layers}
    keep = min(options.refine_samples, SHARED_KEY_REFINE_SAMPLES) if options.refine_steps else 0
    calibrations, batches = collect_shared_key_statistics(source.folder, source.layout, source.family.position_bias, layers, texts,
                                                      options.calibration_max_length, progress, keep_samples=keep,
                                                      token_budget=options.calibration_tokens, scratch=scratch,
                                                      width=source.width, device=options.device)
    refinement = (f"up to {options.refine_steps} Adam steps per layer on the error of the attention output (through "
                  f"the output projection; attention KL reported), each on 8 of "
                  f"{min(keep, len(texts))} sequences and 32 query positions in each, stopped and chosen on a "
                  "held-out tenth of them") if keep else "off"
    calibration = {
        "source": str(options.calibration),
        "examples": batches.texts,
        "tokens": batches.tokens,
        "max_length": options.calibration_max_length,
        "objective": "score energy on the calibration tokens: key second moments"
                     + ("" if (not source.layout.rotates) else " per frequency") + ", weighted by "
                     "the energy of the queries that read them",
        "refinement": refinement,
    }
    return _StatisticsOf(calibrations), calibrations, calibration


# --- budget and fit ----------------------------------------------------------------------------------------------

def allocate_ranks(source: SourceModel, statistics: Mapping[str, KeyStatistics], width: int) -> dict[str, KeyRanks]:
    """One budget of width x layers numbers per token, spread where the most score energy stays.

    The budget is the key cache, so it is spread over the layers whose keys are cached. An encoder-decoder's
    encoder layers, which cache nothing, get the same width on average, spread among themselves: they then
    neither take from the cache's budget nor give to it."""
    ranks = {}
    for cached in (True, False):
        layers = [layer for layer in source.layers if layer.caches_keys == cached]
        spectra = [_shares(key_spectrum(statistics[layer.prefix], geometry_of(layer))) for layer in layers]
        ranks.update(zip((layer.prefix for layer in layers), allocate(spectra, width * len(layers)), strict=True))
    return {layer.prefix: ranks[layer.prefix] for layer in source.layers}


def _shares(spectrum: KeySpectrum) -> KeySpectrum:
    """Losses as shares of the layer's own score energy. Raw energies differ between layers by more than their
    importance does (measured on SmolLM2 at half the key cache: perplexity 104 with raw energies across layers,
    68 with one width per layer, 68 with shares), so a direction is judged within its layer."""
    total = float(spectrum.frequency_losses.sum() + spectrum.pass_losses.sum()) or 1.0
    return KeySpectrum(spectrum.frequency_losses / total, spectrum.pass_losses / total)


def convert_rotary_weights(source: SourceModel, options: CompressOptions, folder: Path, progress: Progress,
                           ranks: dict[str, KeyRanks], statistics: Mapping[str, KeyStatistics], calibrations=None,
                           finished=None):
    layout, normed = source.layout, key_norm(source)

    def specs(layer: AttentionLayer):
        r = ranks[layer.prefix]
        return layout.output_specs(source.reader, layer, r.width, sum(r.frequency_ranks), r.pass_rank,
                                   layer.shape.head_dim - layer.rotary_dim, normed)

    labels = layer_labels(source)

    def fit(layer: AttentionLayer, progress: Progress):
        calibration = calibrations[layer.prefix] if calibrations else None
        stage = "refining" if calibration is not None and calibration.samples and options.refine_steps else "fitting"
        progress(f"{stage}{DETAIL}{labels[layer.prefix]}", source.layers.index(layer), len(source.layers))
        # a calibration record carries the statistics: one read of it, not two (it may wait on disk)
        layer_statistics = calibration.statistics if calibration is not None else statistics[layer.prefix]
        return _fit_layer(source, layer, ranks[layer.prefix], layer_statistics, normed, calibration, options)

    refined = bool(calibrations and options.refine_steps)  # refinement holds calibration samples: one layer at a time
    return stream_weights(source, folder, parse_size(options.max_shard_size), progress, specs, fit, finished,
                          workers=0 if refined else fit_workers())


def _fit_layer(source: SourceModel, layer: AttentionLayer, ranks: KeyRanks, statistics: KeyStatistics,
               normed: bool, calibration, options: CompressOptions):
    started = time.perf_counter()
    weights = source.layout.read(source.reader, layer)
    factors = fit_shared_key(statistics, geometry_of(layer), ranks)
    refinement = None
    if calibration is not None and calibration.samples and ranks != KeyRanks.full(geometry_of(layer)):
        from .decompose.shared_key_refinement import refine_shared_key

        with reused_heap():  # one layer's working set, allocated afresh at every step (cpu.reused_heap)
            refined = refine_shared_key(calibration.samples, factors, geometry_of(layer), calibration.setting,
                                        steps=options.refine_steps, seed=options.seed, device=options.device)
        factors = refined.factors
        refinement = {"kl_before": refined.kl_before, "kl_after": refined.kl_after, "steps": refined.steps,
                      "objective": refined.objective, "loss_before": refined.loss_before,
                      "loss_after": refined.loss_after}
    dtype, p = weights.query_weight.dtype, layer.prefix
    tensors: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        if f"{p}.{FUSED_QUERY}.{suffix}" in weights.kept:
            tensors[f"{p}.{FUSED_QUERY}.{suffix}"] = weights.kept[f"{p}.{FUSED_QUERY}.{suffix}"]
    if normed:
        tensors[f"{p}.{KEY_MIXING}"] = factors.key_mixing
    else:
        tensors[f"{p}.{SHARED_KEY}"] = factors.key_mixing @ weights.key_weight.double()
        if weights.key_bias is not None:
            tensors[f"{p}.{SHARED_KEY_BIAS}"] = factors.key_mixing @ weights.key_bias.double()
    for suffix in ("weight", "bias"):
        if f"{p}.{FUSED_VALUE}.{suffix}" in weights.kept:
            tensors[f"{p}.{FUSED_VALUE}.{suffix}"] = weights.kept[f"{p}.{FUSED_VALUE}.{suffix}"]
    tensors[f"{p}.{QUERY_CORE}"] = factors.query_core
    if layer.rotary_dim < layer.shape.head_dim:
        tensors[f"{p}.{PASS_CORE}"] = factors.pass_core
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}
    report = _report(source, layer, factors, time.perf_counter() - started)
    if calibration is not None:
        report.logit_error, report.refinement = factors.lost_energy, refinement
    return report, tensors


def _report(source: SourceModel, layer: AttentionLayer, factors, seconds: float) -> LayerReport:
    shape = _shape(source, layer)
    before = original_grouped_cost(shape, has_bias=layer.has_query_bias).cached(layer.caches_keys)
    after = shared_key_cost(shape, factors.ranks.width, factors.query_core.numel(), factors.pass_core.numel(),
                               has_bias=layer.has_query_bias).cached(layer.caches_keys)
    losses = key_spectrum_values(factors)
    return LayerReport(
        name=layer.prefix, rank=factors.ranks.width, num_heads=layer.shape.num_heads, head_dim=layer.shape.head_dim,
        input_dim=layer.shape.input_dim, relative_error=factors.lost_energy, logit_error=None, refinement=None,
        per_head_truncation_error=float("nan"), initialisation="weighted PCA of the keys per rotary frequency",
        iterations=0, parameters_before=before.parameters, parameters_after=after.parameters, seconds=seconds,
        cost_before=before.as_dict(), cost_after=after.as_dict(), query_spectrum=[], key_spectrum=losses,
        frequency_ranks=list(factors.ranks.frequency_ranks), pass_rank=factors.ranks.pass_rank,
    )


def key_spectrum_values(factors) -> list[float]:
    """The kept shared key's per-slot scale, largest first: what the spectra plot shows for rotary layers."""
    return rounded(sorted(factors.key_mixing.norm(dim=1).tolist(), reverse=True))


def write_rotary_config(source: SourceModel, reports: list[LayerReport], folder: Path, method: str) -> None:
    normed = key_norm(source)
    by_prefix = {layer.prefix: layer for layer in source.layers}
    layers = {}
    for report in reports:
        layer = by_prefix[report.name]
        entry = FormatConfig.shared_key_entry(HeadCounts(layer.shape.num_heads, layer.kv_heads), layer.shape.head_dim,
                                          layer.rotary_dim, report.frequency_ranks, report.pass_rank)
        layers[report.name] = {**entry, **({"key_norm": True} if normed else {})}
    write_config(source.config, source.family.name, None, layers, folder, format_version=2)
