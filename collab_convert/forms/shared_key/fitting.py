"""The shared-key form's layers: one key-cache budget spread over layers and RoPE frequencies, each layer's
shared key fitted (weighted PCA per frequency), refined against the original's attention output where
calibration kept samples, and written in place of the key projection as the checkpoint streams past."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ...architectures.layouts import AttentionLayer
from ...architectures.source import SourceModel
from ...decompose.costs import SharedKeyShape, original_grouped_cost, shared_key_cost
from ...decompose.shared_key import (
    HeadGeometry,
    KeyRanks,
    KeySpectrum,
    KeyStatistics,
    SharedKeyFactors,
    allocate,
    fit_shared_key,
    key_spectrum,
)
from ...errors import BadInputError
from ...format import (
    FUSED_QUERY,
    FUSED_VALUE,
    KEY_MIXING,
    PASS_CORE,
    QUERY_CORE,
    SHARED_KEY,
    SHARED_KEY_BIAS,
    FormatConfig,
    HeadCounts,
    load_guard,
    write_config,
)
from ...integration.remote_code import write_checkpoint_code
from ...options import CompressOptions
from ...progress import DETAIL, Progress
from ...results import SharedKeyLayerReport, rounded
from ...streaming import FoldedFits, fit_workers, layer_labels, stream_weights
from .statistics import STEP_SEQUENCES, geometry_of, key_norm


def layer_width(source: SourceModel, options: CompressOptions) -> int:
    """The shared key's numbers per token and layer, on average: --rank, or --key-cache of the original."""
    full = max(layer.full_rank for layer in source.layers)
    if options.kv_cache is not None:
        raise BadInputError("--kv-cache sizes keys and values together in the multi-query form; the shared-key form "
                            "takes --key-cache (or drop --form shared-key)")
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
    if not source.layout.rotates and width < 1:
        raise BadInputError(f"a shared key needs at least 1 number per token, got {width}")
    if source.layout.rotates and width < 2:
        raise BadInputError(f"a shared rotary key needs at least 2 numbers per token (one complex dimension), "
                            f"got {width}")
    return width


def plan_layers(source: SourceModel, width: int) -> list[dict]:
    """What the plan shows: each layer's query/key parameters before and after, at the average width."""
    layers = []
    for layer in source.layers:
        shape = shape_of(source, layer)
        before = original_grouped_cost(shape, has_bias=layer.has_query_bias).parameters
        # with no rotated dimension every head maps its whole query onto the shared key (pass_core: N_h x d x R)
        cores = {"complex_core": 0, "pass_core": layer.shape.num_heads * layer.shape.head_dim * width} \
            if not layer.rotary_dim else {}
        after = shared_key_cost(shape, width, **cores, has_bias=layer.has_query_bias).parameters
        layers.append({"name": layer.prefix, "rank": width, "parameters_before": before, "parameters_after": after})
    return layers


def shape_of(source: SourceModel, layer: AttentionLayer) -> SharedKeyShape:
    return SharedKeyShape(layer.shape.input_dim, layer.shape.num_heads, layer.kv_heads, layer.shape.head_dim,
                          key_norm(source))


def allocate_ranks(source: SourceModel, statistics: Mapping[str, KeyStatistics], width: int) -> dict[str, KeyRanks]:
    """One budget of width x layers numbers per token, spread where the most score energy stays.

    The budget is the key cache, so it is spread over the layers whose keys are cached. An encoder-decoder's
    encoder layers, which cache nothing, get the same width on average, spread among themselves: they then
    neither take from the cache's budget nor give to it."""
    ranks = {}
    for cached in (True, False):
        layers = [layer for layer in source.layers if layer.caches_keys == cached]
        spectra = [score_shares(key_spectrum(statistics[layer.prefix], geometry_of(layer))) for layer in layers]
        ranks.update(zip((layer.prefix for layer in layers), allocate(spectra, width * len(layers)), strict=True))
    return {layer.prefix: ranks[layer.prefix] for layer in source.layers}


def score_shares(spectrum: KeySpectrum) -> KeySpectrum:
    """Losses as shares of the layer's own score energy. Raw energies differ between layers by more than their
    importance does (measured on SmolLM2 at half the key cache: perplexity 104 with raw energies across layers,
    68 with one width per layer, 68 with shares), so a direction is judged within its layer."""
    total = float(spectrum.frequency_losses.sum() + spectrum.pass_losses.sum()) or 1.0
    return KeySpectrum(spectrum.frequency_losses / total, spectrum.pass_losses / total)


def convert_weights(source: SourceModel, options: CompressOptions, folder: Path, progress: Progress,
                    ranks: dict[str, KeyRanks], statistics: Mapping[str, KeyStatistics], calibrations=None,
                    finished=None):
    """Every tensor to the output in input order; at each attention layer, its shared key and query cores
    (fitted, and refined where calibration kept samples, there) in place of the key projection."""
    layout, normed = source.layout, key_norm(source)

    def specs(layer: AttentionLayer):
        r = ranks[layer.prefix]
        return layout.output_specs(source.reader, layer, r.width, sum(r.frequency_ranks), r.pass_rank,
                                   layer.shape.head_dim - layer.rotary_dim, normed)

    def start(layer: AttentionLayer, announce) -> _Fitted:
        return _start(layer, ranks[layer.prefix], statistics, calibrations, options, announce)

    def finish(layer: AttentionLayer, fitted: _Fitted):
        return _finish(source, layer, fitted, normed)

    labels = layer_labels(source)
    if not (calibrations and options.refine_steps):
        def fit(layer: AttentionLayer, progress: Progress):
            def announce(stage: str):
                progress(f"{stage}{DETAIL}{labels[layer.prefix]}", source.layers.index(layer), len(source.layers))

            return finish(layer, start(layer, announce))

        return stream_weights(source, folder, options, progress, specs, fit, finished, workers=fit_workers(),
                              guarded=True)
    # Refined layers one at a time (or --refine-together of them in the same steps), on every thread, not side by
    # side in threads: two refinements side by side (one torch thread each) took 0.57-0.97 of the time, and held
    # both working sets at once
    order = [layer for layer in source.layers if not (finished and finished.has(layer))]
    fits = FoldedFits(order, start, lambda group, announce: _refine(group, options, announce), finish,
                      joins=lambda fitted: fitted.samples is not None, size=options.refine_together,
                      labels=labels)
    return stream_weights(source, folder, options, progress, specs, fits, finished, workers=0, guarded=True)


@dataclass
class _Fitted:
    """A layer between its fit and its tensors: the fit, and what its refinement needs and says."""

    geometry: HeadGeometry
    factors: SharedKeyFactors
    samples: list | None  # the calibration samples, where the layer is to be refined
    setting: object
    calibrated: bool
    seconds: float
    refinement: dict | None = None

    def to_refine(self):
        from ...decompose.shared_key_refinement import LayerToRefine

        return LayerToRefine(self.samples, self.factors, self.geometry, self.setting)


def _start(layer: AttentionLayer, ranks: KeyRanks, statistics: Mapping[str, KeyStatistics], calibrations,
           options: CompressOptions, announce) -> _Fitted:
    started = time.perf_counter()
    # The calibration record (fresh from disk, where it waits) is read here and let go, not held by a caller: its
    # statistics, a (G d)^2 float64 key covariance at a layer without rotation (8 MB at GPT-2-medium's width), are
    # then not held through the refinement's steps
    calibration = calibrations[layer.prefix] if calibrations else None
    samples, setting = (calibration.samples, calibration.setting) if calibration is not None else (None, None)
    announce("refining" if samples and options.refine_steps else "fitting")  # a refined layer's fit is its start
    geometry = geometry_of(layer)
    factors = fit_shared_key(calibration.statistics if calibration is not None else statistics[layer.prefix],
                             geometry, ranks)
    calibrated, calibration = calibration is not None, None
    if samples and options.refine_steps and ranks != KeyRanks.full(geometry):
        # the refinement works in float32, on these tensors themselves (consume): neither the float64 fit nor a
        # copy of it is held beside its parameters (6 MB a tensor at GPT-2-medium's width and rank 768). The
        # result is the same: the refined float32 numbers are what is kept
        factors = replace(factors, key_mixing=factors.key_mixing.float(), query_core=factors.query_core.float(),
                          pass_core=factors.pass_core.float())
    else:
        samples = setting = None
    return _Fitted(geometry, factors, samples, setting, calibrated, time.perf_counter() - started)


def _refine(group: list[_Fitted], options: CompressOptions, announce) -> list[_Fitted]:
    """The group's layers refined in the same steps; each one's time is its share."""
    layers = [fitted.to_refine() for fitted in group]
    for fitted in group:  # the samples are the refinement's now: it lets them go as it stacks them (consume)
        fitted.samples = fitted.setting = None
    for fitted, (refined, record, share) in zip(group, refine_layers(layers, options, announce, STEP_SEQUENCES),
                                                strict=True):
        fitted.factors, fitted.seconds, fitted.refinement = refined.factors, fitted.seconds + share, record
    return group


def refine_layers(layers: list, options: CompressOptions, announce, step_sequences: int) -> list[tuple]:
    """Layers (decompose.shared_key_refinement.LayerToRefine) refined in the same steps, their samples let go as
    they are stacked: for each, (its refinement, what report.json says of it, its share of the time)."""
    from ...decompose.shared_key_refinement import refine_shared_keys

    announce("refining")
    started = time.perf_counter()
    # (the steps reuse the heap for their working set: decompose/held_out_adam.py)
    results = refine_shared_keys(layers, steps=options.refine_steps, seed=options.seed, device=options.device,
                                 consume=True, batch_sequences=step_sequences)
    share = (time.perf_counter() - started) / len(results)
    return [(refined, {"kl_before": refined.kl_before, "kl_after": refined.kl_after, "steps": refined.steps,
                       "objective": refined.objective, "loss_before": refined.loss_before,
                       "loss_after": refined.loss_after, "layers_together": len(results)}, share)
            for refined in results]


def _finish(source: SourceModel, layer: AttentionLayer, fitted: _Fitted, normed: bool):
    """The layer's tensors and report. Its projections are read only now: not held beside what the refinement
    needs."""
    started, factors = time.perf_counter(), fitted.factors
    weights = source.layout.read(source.reader, layer)
    dtype, p = weights.query_weight.dtype, layer.prefix
    tensors: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        if f"{p}.{FUSED_QUERY}.{suffix}" in weights.kept:
            tensors[f"{p}.{FUSED_QUERY}.{suffix}"] = weights.kept[f"{p}.{FUSED_QUERY}.{suffix}"]
    if normed:
        tensors[f"{p}.{KEY_MIXING}"] = factors.key_mixing
    else:
        tensors[f"{p}.{SHARED_KEY}"] = factors.key_mixing.double() @ weights.key_weight.double()
        if weights.key_bias is not None:
            tensors[f"{p}.{SHARED_KEY_BIAS}"] = factors.key_mixing.double() @ weights.key_bias.double()
    for suffix in ("weight", "bias"):
        if f"{p}.{FUSED_VALUE}.{suffix}" in weights.kept:
            tensors[f"{p}.{FUSED_VALUE}.{suffix}"] = weights.kept[f"{p}.{FUSED_VALUE}.{suffix}"]
    tensors[f"{p}.{QUERY_CORE}"] = factors.query_core
    if layer.rotary_dim < layer.shape.head_dim:
        tensors[f"{p}.{PASS_CORE}"] = factors.pass_core
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}
    report = _report(source, layer, factors, fitted.seconds + time.perf_counter() - started)
    if fitted.calibrated:
        report.logit_error, report.refinement = factors.lost_energy, fitted.refinement
    return report, tensors


def _report(source: SourceModel, layer: AttentionLayer, factors, seconds: float) -> SharedKeyLayerReport:
    shape = shape_of(source, layer)
    before = original_grouped_cost(shape, has_bias=layer.has_query_bias).cached(layer.caches_keys)
    after = shared_key_cost(shape, factors.ranks.width, factors.query_core.numel(), factors.pass_core.numel(),
                            has_bias=layer.has_query_bias).cached(layer.caches_keys)
    return SharedKeyLayerReport(
        name=layer.prefix, rank=factors.ranks.width, num_heads=layer.shape.num_heads, head_dim=layer.shape.head_dim,
        input_dim=layer.shape.input_dim, relative_error=factors.lost_energy, logit_error=None, refinement=None,
        parameters_before=before.parameters, parameters_after=after.parameters, seconds=seconds,
        cost_before=before.as_dict(), cost_after=after.as_dict(), kv_heads=layer.kv_heads,
        initialisation="weighted PCA of the keys" + (" per rotary frequency" if layer.rotary_dim else ""),
        frequency_ranks=list(factors.ranks.frequency_ranks), pass_rank=factors.ranks.pass_rank,
        key_spectrum=key_spectrum_values(factors),
    )


def key_spectrum_values(factors) -> list[float]:
    """The kept shared key's per-slot scale, largest first: what the spectra plot shows of shared-key layers."""
    return rounded(sorted(factors.key_mixing.double().norm(dim=1).tolist(), reverse=True))


def write_shared_key_config(source: SourceModel, reports: list[SharedKeyLayerReport], folder: Path,
                            format_version: int) -> None:
    """config.json with the shared-key form's record: each layer's heads and how its key splits over RoPE
    frequencies (and whether it mixes normalised keys); no decomposition method."""
    normed = key_norm(source)
    by_prefix = {layer.prefix: layer for layer in source.layers}
    layers = {}
    for report in reports:
        layer = by_prefix[report.name]
        entry = FormatConfig.shared_key_entry(HeadCounts(layer.shape.num_heads, layer.kv_heads), layer.shape.head_dim,
                                              layer.rotary_dim, report.frequency_ranks, report.pass_rank)
        layers[report.name] = {**entry, **({"key_norm": True} if normed else {})}
    # a form that replaces no projection (a key norm keeps the key projection) loads as the original model
    guarded = any(load_guard(layer.replaced, torch.float32) for layer in source.layers)
    auto_map = write_checkpoint_code(folder, source.config) if guarded else {}
    write_config(source.config, source.family.name, None, layers, folder, format_version=format_version,
                 guarded=guarded, auto_map=auto_map)
