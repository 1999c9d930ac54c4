"""The CP form's layers: each fitted by the decomposition method asked for (decompose/methods.py), refined
against the original's attention where calibration kept samples, and written in place of the query and key
projections (format.py) as the checkpoint streams past (streaming.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ...architectures.layouts import AttentionLayer, Projections
from ...architectures.source import SourceModel
from ...cpu import return_freed_heap
from ...decompose.costs import collaborative_cost, original_cost
from ...decompose.methods import FitRequest, LayerFit, method_named
from ...decompose.products import content_bias, relative_error
from ...format import COLLABORATIVE_FORM, CONTENT_BIAS, FormatConfig, HeadCounts, collaborative_tensors, write_config
from ...integration.remote_code import write_checkpoint_code
from ...io.headers import TensorSpec
from ...io.spill import SpillFolder
from ...options import CompressOptions
from ...progress import DETAIL, Progress
from ...resume import FinishedLayers
from ...results import CollaborativeLayerReport, rounded
from ...streaming import fit_workers, layer_labels, stream_weights
from .statistics import head_weights_of


def convert_weights(source: SourceModel, options: CompressOptions, folder: Path, progress: Progress,
                    ranks: dict[str, int], metrics, finished: FinishedLayers | None = None,
                    key_metrics: dict | None = None):
    """Every tensor to the output in input order; at each attention layer, its collaborative tensors (fitted
    there) in place of the ones they replace. With refinement, every layer is fitted first and the refinement
    steps are shared out by each layer's attention error (`refinement_steps`). `key_metrics`: where a caller
    writes several checkpoints from the same calibration (`--rank auto`), each layer's attention-weighted key
    metric kept there by prefix, computed once."""
    fits, steps = {}, {}
    if metrics and options.refine_steps and any(m.query_samples for m in metrics.values()):
        fits, steps = refinement_steps(source, options, ranks, metrics, progress, finished)
    labels = layer_labels(source)

    calibrated = metrics is not None

    def specs(layer: AttentionLayer) -> list[TensorSpec]:
        found = source.layout.output_specs(source.reader, layer, ranks[layer.prefix])
        if layer.stores_content_bias(calibrated):
            return found
        return [spec for spec in found if spec.name != f"{layer.prefix}.{CONTENT_BIAS}"]

    def fit(layer: AttentionLayer, progress: Progress):
        started = time.perf_counter()
        rank, metric = ranks[layer.prefix], metrics[layer.prefix] if metrics else None
        fitted = fits.pop(layer.prefix, None)
        if fitted is not None:  # fitted ahead, when the refinement steps were shared out: count that time too
            layer_fit, bias, seconds = fitted
            started -= seconds
            projections = source.read_projections(layer)
            # the refinement reads the samples alone: the covariances (2 D_in^2 float64) are let go before it
            metric = replace(metric, query=None, key=None)
        else:
            projections, layer_fit, bias = _fit(source, layer, options, rank, metric, progress, labels,
                                                key_metrics)
        refinement = None
        if steps.get(layer.prefix) and rank < layer.shape.key_dim:
            # (the steps reuse the heap for their working set: decompose/held_out_adam.py)
            refinement = _refine(projections, layer, layer_fit, bias, metric, steps, labels, options, progress)
            layer_fit.factors, bias = refinement.pop("factors"), refinement.pop("content_bias")
            layer_fit.relative_error = relative_error(projections.products(layer.shape.num_heads), layer_fit.factors)
        tensors = collaborative_tensors(layer.prefix, layer_fit.factors.shared_query, layer_fit.factors.shared_key,
                                        layer_fit.factors.mixing, bias, projections.query_weight.dtype)
        keeps_bias = layer.stores_content_bias(calibrated)
        if not keeps_bias:
            zeros = tensors.pop(f"{layer.prefix}.{CONTENT_BIAS}")
            assert not zeros.any(), "a layer without query bias or calibration has no content bias"
        tensors.update(projections.kept)
        return layer_report(layer, rank, layer_fit, refinement, time.perf_counter() - started, keeps_bias), tensors

    return stream_weights(source, folder, options, progress, specs, fit, finished,
                          workers=0 if steps else fit_workers(), guarded=True)


def refinement_steps(source: SourceModel, options: CompressOptions, ranks: dict[str, int], metrics, progress: Progress,
                     finished: FinishedLayers | None = None):
    """(fits by layer as (fit, content bias, seconds), refinement steps by layer): each layer
    fitted, its held-out attention KL measured, and `refine_steps` x layers steps shared out in proportion to
    those KLs (decompose/held_out_adam.share_steps). A resumed run reuses the split it saved, so its output stays
    byte-identical; its layers are fitted again as they come."""
    from ...decompose.held_out_adam import share_steps

    saved = finished.load_plan() if finished else None
    if saved is not None:
        return {}, saved
    labels = layer_labels(source)
    # fits wait on disk beside statistics that do (a block-at-a-time calibration): memory holds one layer
    fits = SpillFolder(metrics.folder.parent / "fits") if isinstance(metrics, SpillFolder) else {}
    losses = []
    for layer in source.shard_by_shard():  # else each fit's pages stay resident until writing begins
        return_freed_heap()  # the last layer's freed small blocks, before this one's fit piles its own on them
        # straight into `fits` (on disk where they spill): no variable here holds a layer's fit past its turn
        fits[layer.prefix], loss = _fit_scored(source, layer, options, ranks[layer.prefix], metrics[layer.prefix],
                                               progress, labels)
        losses.append(loss)
    steps = dict(zip(fits, share_steps(losses, options.refine_steps * len(source.layers)), strict=True))
    if finished:
        finished.save_plan(steps)
    return fits, steps


def _fit_scored(source: SourceModel, layer: AttentionLayer, options: CompressOptions, rank: int, metric,
                progress: Progress, labels: dict[str, str]):
    """((fit, content bias, seconds), held-out attention KL) of one layer. A function of its own so that nothing of
    a layer (its statistics, samples, projections, fit) is still held while the next one is fitted: the loop's
    variables held 30-40 MB of the last layer's at a 12-layer GPT-2-medium-shaped checkpoint's fitting peak."""
    from ...decompose.refinement import AttentionTarget

    started = time.perf_counter()
    projections, fit, bias = _fit(source, layer, options, rank, metric, progress, labels)
    seconds = time.perf_counter() - started
    if rank >= layer.shape.key_dim or not metric.query_samples:
        return (fit, bias, seconds), 0.0
    target = AttentionTarget(metric.query_samples, metric.key_samples, projections.query_weight,
                             projections.query_bias, projections.key_weight, layer.shape.num_heads,
                             score_scale(layer, metric), layer.causal, getattr(metric, "position_bias", None),
                             device=options.device, head_weights=fit.head_weights)
    return (fit, bias, seconds), target.held_out_kl((fit.factors.shared_query, fit.factors.shared_key,
                                                      fit.factors.mixing, bias))


def score_scale(layer: AttentionLayer, metric) -> float:
    """What the layer multiplies its scores by: the module's own `scaling` where calibration read one (GPT-2's
    per-layer and optional scalings included), else 1/sqrt(d_k)."""
    scaling = getattr(metric, "scaling", None)
    return scaling if scaling is not None else layer.shape.head_dim**-0.5


def _fit(source: SourceModel, layer: AttentionLayer, options: CompressOptions, rank: int, metric, progress: Progress,
         labels: dict[str, str], key_metrics: dict | None = None):
    """(projections, fit, content bias) of one layer, before any refinement."""
    progress(f"fitting{DETAIL}{labels[layer.prefix]}", list(labels).index(layer.prefix), len(labels))
    projections = source.read_projections(layer)
    products = projections.products(layer.shape.num_heads)
    fit = method_named(options.method).fit(FitRequest(
        products, rank, options.max_iterations, options.tolerance, options.device, options.seed,
        query_metric=metric.query if metric else None,
        key_metric=_key_metric(layer, rank, projections, metric, options, key_metrics),
        head_weights=head_weights_of(source, layer, metric),
    ))
    bias = content_bias(projections.key_weight, projections.query_bias, layer.shape.num_heads)
    if fit.content_bias_correction is not None:
        bias = bias + fit.content_bias_correction
    return projections, fit, bias


def _key_metric(layer: AttentionLayer, rank: int, projections: Projections, metric, options: CompressOptions,
                kept: dict | None = None):
    """The key side's metric for the calibrated fit: where calibration kept sequences, the keys' spread under the
    original attention on the ones refinement trains on (refinement.attention_key_covariance); else their plain
    spread, as at full rank, where the fit is exact whatever the metric."""
    if metric is None or not metric.query_samples or rank >= layer.shape.key_dim:
        return metric.key if metric else None
    if kept is not None and layer.prefix in kept:
        return kept[layer.prefix]
    from ...decompose.calibrated import InputMetric
    from ...decompose.held_out_adam import held_out_count
    from ...decompose.refinement import attention_key_covariance

    train = len(metric.query_samples) - held_out_count(len(metric.query_samples))
    covariance = attention_key_covariance(
        metric.query_samples[:train], metric.key_samples[:train], projections.query_weight, projections.query_bias,
        projections.key_weight, layer.shape.num_heads, score_scale(layer, metric), layer.causal,
        getattr(metric, "position_bias", None), device=options.device, seed=options.seed)
    found = InputMetric(covariance, metric.key.mean)
    if kept is not None:
        kept[layer.prefix] = found
    return found


def _refine(projections: Projections, layer: AttentionLayer, fit: LayerFit, bias, metric, steps: dict[str, int],
            labels: dict[str, str], options: CompressOptions, progress: Progress) -> dict[str, Any]:
    """Refine one layer's fitted factors against the original layer's attention on the calibration sequences,
    with the steps its error earned; progress shows the held-out KL as it falls."""
    from ...decompose.refinement import refine_attention

    total, before = sum(steps.values()), sum(steps[p] for p in list(steps)[: list(steps).index(layer.prefix)])
    label = labels[layer.prefix]

    def on_check(step: int, loss: float) -> None:
        progress(f"refining{DETAIL}{label}, held-out KL {loss:.4f}", before + step, total)

    progress(f"refining{DETAIL}{label}", before, total)
    # The refinement works in float32 on these tensors themselves (consume): the float64 fit is let go, not held
    # beside its parameters through the steps (12.6 MB at GPT-2-medium's width and rank 768). Its float32 result is
    # widened back, exactly, so what follows (the reported error, the written tensors) reads it as before
    dtype = fit.factors.shared_query.dtype
    fit.factors = fit.factors.to(options.device, torch.float32)
    refined = refine_attention(
        metric.query_samples, metric.key_samples, projections.query_weight, projections.query_bias,
        projections.key_weight, fit.factors, bias, layer.shape.num_heads, score_scale(layer, metric),
        causal=layer.causal, steps=steps[layer.prefix], seed=options.seed, on_check=on_check,
        position_bias=getattr(metric, "position_bias", None), device=options.device, head_weights=fit.head_weights,
        consume=True,
    )
    return {"kl_before": refined.kl_before, "kl_after": refined.kl_after, "steps": refined.steps,
            "factors": refined.factors.to(dtype), "content_bias": refined.content_bias.to(bias.dtype)}


def layer_report(layer: AttentionLayer, rank: int, fit: LayerFit, refinement: dict[str, Any] | None,
                 seconds: float, content_bias: bool = True) -> CollaborativeLayerReport:
    before = original_cost(layer.shape, has_bias=layer.has_query_bias).cached(layer.caches_keys)
    after = collaborative_cost(layer.shape, rank, content_bias).cached(layer.caches_keys)
    truncation = fit.per_head_truncation_error
    return CollaborativeLayerReport(
        name=layer.prefix,
        rank=rank,
        num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim,
        input_dim=layer.shape.input_dim,
        relative_error=fit.relative_error,
        logit_error=fit.logit_error,
        refinement=refinement,
        per_head_truncation_error=float("nan") if truncation is None else truncation,
        initialisation=fit.initialisation,
        iterations=fit.iterations,
        parameters_before=before.parameters,
        parameters_after=after.parameters,
        seconds=seconds,
        cost_before=before.as_dict(),
        cost_after=after.as_dict(),
        query_spectrum=rounded(fit.query_spectrum),
        key_spectrum=rounded(fit.key_spectrum),
    )


def write_format_config(source: SourceModel, reports: list[CollaborativeLayerReport], folder: Path, method: str,
                        calibrated: bool = False) -> None:
    """config.json with the CP form's record: each layer's rank, heads and whether it stores a content bias."""
    by_prefix = {layer.prefix: layer for layer in source.layers}
    layers = {r.name: FormatConfig.layer_entry(r.rank, HeadCounts(r.num_heads, by_prefix[r.name].kv_heads),
                                               by_prefix[r.name].stores_content_bias(calibrated))
              for r in reports}
    offer = source.family.offer(COLLABORATIVE_FORM)
    auto_map = write_checkpoint_code(folder, source.config)
    # where the carried code runs the form (with trust_remote_code=True, without collab-convert), it reads the names
    # of the separate projections it replaces from the record
    projections = {"query": offer.layout.query, "key": offer.layout.key} if offer.carries_code and auto_map else None
    write_config(source.config, source.family.name, method, layers, folder, guarded=True, auto_map=auto_map,
                 projections=projections)
