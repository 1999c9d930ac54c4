"""The stages of a compression, each a function over an opened source model. compression.py sequences them;
predict.py reuses them to measure what a rank would give before anything is written for the user."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from .architectures.layouts import AttentionLayer, Projections
from .architectures.source import SourceModel
from .decompose.costs import collaborative_cost, original_cost
from .decompose.methods import FitRequest, LayerFit, method_named
from .decompose.products import content_bias, relative_error
from .errors import BadInputError
from .format import FormatConfig, HeadCounts, collaborative_tensors, write_config
from .io.folders import check_output
from .io.tensors import ShardWriter, TensorSpec, parse_size
from .options import CompressOptions
from .progress import Progress
from .results import CompressPlan, LayerReport, rounded


def check_plan(source: SourceModel, options: CompressOptions, ranks: dict[str, int] | None = None,
               layers: list[dict] | None = None) -> CompressPlan:
    """Refuse what cannot work before anything costly runs. `layers`: the per-layer plan where a form other than
    the CP form (the rotary shared key) made it; else made here from the ranks."""
    parse_size(options.max_shard_size)
    output = options.output.expanduser().resolve()
    check_output(output, source.folder, options.overwrite)
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInputError(f"--device {options.device} was asked for, but torch sees no CUDA device here")
    if options.calibration is not None and not method_named(options.method).calibrates:
        raise BadInputError(f"--calibration does not work with the {options.method} method")
    if layers is None:
        layers = _plan_layers(source, options, ranks)
    return CompressPlan(
        model=source.source,
        output=str(output),
        family=source.family.name,
        method=options.method,
        layers=layers,
        parameters_before=sum(layer["parameters_before"] for layer in layers),
        parameters_after=sum(layer["parameters_after"] or 0 for layer in layers),
    )


def _plan_layers(source: SourceModel, options: CompressOptions, ranks: dict[str, int] | None) -> list[dict]:
    if options.key_cache is not None:
        raise BadInputError("--key-cache is for rotary decoders, whose cache holds the shared key; give --rank")
    if options.rank is None:
        raise BadInputError("give --rank R (the shared query/key dimension), or --rank auto")
    layers = []
    for layer in source.layers:
        rank = (ranks or {}).get(layer.prefix, options.rank)
        if rank != "auto":
            layer.check_rank(rank)
        before = original_cost(layer.shape, has_bias=layer.has_query_bias).parameters
        after = collaborative_cost(layer.shape, rank).parameters if rank != "auto" else None
        layers.append({"name": layer.prefix, "rank": rank, "parameters_before": before, "parameters_after": after})
    return layers


PROBE_TEXTS = 32  # texts a fidelity estimate measures on


@dataclass
class ProbeTexts:
    """Texts a fidelity figure is measured on, and what they are, for reports."""

    texts: list[str]
    description: str


def calibration_texts(options: CompressOptions) -> tuple[list[str], ProbeTexts]:
    """(texts the fit sees, texts a fidelity figure measures on) from --calibration.

    The probe texts are the lines after the first `calibration_samples`; a file with no lines to spare lends
    its last few, and the description says the figure is then not on held-out text."""
    from .io.texts import read_texts

    texts = read_texts(options.calibration, options.calibration_samples + PROBE_TEXTS)
    fitted = texts[: options.calibration_samples]
    if texts[options.calibration_samples:]:
        held_out = texts[options.calibration_samples:]
        return fitted, ProbeTexts(held_out, f"{len(held_out)} held-out lines of {options.calibration}")
    reused = fitted[-PROBE_TEXTS:]
    return fitted, ProbeTexts(reused, f"{len(reused)} lines of {options.calibration} (also used for the fit: "
                                      "none were left to hold out)")


def calibrate(source: SourceModel, options: CompressOptions, texts: list[str], progress: Progress,
              refine: bool = True):
    """Input statistics of every layer on the calibration texts, and what the report says about them."""
    from .integration.capture import collect_statistics

    refines = refine and bool(options.refine_steps) and source.family.refinable
    metrics = collect_statistics(
        source.folder, source.family, [layer.prefix for layer in source.layers], texts,
        options.calibration_max_length, progress, keep_samples=options.refine_samples if refines else 0,
    )
    if refines:
        refinement = (f"up to {options.refine_steps} Adam steps per layer on the attention KL, each on 8 of "
                      f"{min(options.refine_samples, len(texts))} sequences and 32 query positions in each, "
                      "stopped and chosen on a held-out tenth of them")
    elif not options.refine_steps or not refine:
        refinement = "off"
    else:
        refinement = f"not available for {source.family.name} (position bias or scaling)"
    calibration = {
        "source": str(options.calibration),
        "examples": len(texts),
        "max_length": options.calibration_max_length,
        "objective": "logit error on the calibration inputs (keys centred per sequence)",
        "refinement": refinement,
    }
    return metrics, calibration


def energy_ranks(source: SourceModel, options: CompressOptions, metrics) -> dict[str, int]:
    """One rank per layer: the fewest shared dimensions holding `options.energy` of the energy of its (whitened,
    with calibration) products."""
    from .decompose.calibrated import whiten
    from .decompose.spectra import energy_rank, key_side_matrix, query_side_matrix

    ranks = {}
    for layer in source.layers:
        products = source.read_projections(layer).products(layer.shape.num_heads)
        if metrics is not None:
            products = whiten(products, metrics[layer.prefix].query, metrics[layer.prefix].key)
        share = options.energy
        rank = max(
            energy_rank(torch.linalg.svdvals(query_side_matrix(products)), share),
            energy_rank(torch.linalg.svdvals(key_side_matrix(products)), share),
        )
        ranks[layer.prefix] = min(max(rank, 1), layer.shape.key_dim)
    return ranks


def convert_weights(source: SourceModel, options: CompressOptions, folder: Path, progress: Progress,
                     ranks: dict[str, int], metrics, finished: "FinishedLayers | None" = None):
    """Every tensor to the output in input order; at each attention layer, its collaborative tensors (fitted
    there) in place of the ones they replace."""
    def specs(layer: AttentionLayer) -> list[TensorSpec]:
        return source.family.layout.output_specs(source.reader, layer, ranks[layer.prefix])

    def fit(layer: AttentionLayer):
        return _fit_layer(source, layer, options, ranks[layer.prefix], metrics[layer.prefix] if metrics else None)

    return stream_weights(source, folder, parse_size(options.max_shard_size), progress, specs, fit)


class FinishedLayers:
    """Each fitted layer's tensors and report, saved as it finishes (safetensors + JSON) in the staging folder,
    so that --resume after a killed run reuses them instead of fitting again: the costly part of a long
    calibrated run. Saved tensors are exactly what is written, so a resumed output is byte-identical."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def _paths(self, layer: AttentionLayer) -> tuple[Path, Path]:
        stem = layer.prefix.replace("/", "_")
        return self.folder / f"{stem}.safetensors", self.folder / f"{stem}.json"

    def get(self, layer: AttentionLayer):
        if self.folder is None:
            return None
        tensors_path, report_path = self._paths(layer)
        if not (tensors_path.is_file() and report_path.is_file()):
            return None
        from safetensors.torch import load_file

        try:
            report = LayerReport(**json.loads(report_path.read_text(encoding="utf-8")))
            tensors = load_file(str(tensors_path))
            order = json.loads(report_path.with_suffix(".order").read_text(encoding="utf-8"))
            return report, {name: tensors[name] for name in order}
        except Exception:  # noqa: BLE001 - a half-saved layer (killed while saving) is fitted again
            return None

    def put(self, layer: AttentionLayer, report: LayerReport, tensors: dict[str, torch.Tensor]) -> None:
        if self.folder is None:
            return
        from safetensors.torch import save_file

        tensors_path, report_path = self._paths(layer)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tensors_path))
        report_path.with_suffix(".order").write_text(json.dumps(list(tensors)), encoding="utf-8")
        report_path.write_text(json.dumps(report.to_dict()), encoding="utf-8")  # last: marks the layer done


def stream_weights(source: SourceModel, folder: Path, max_shard_size: int, progress: Progress,
                   layer_specs: Callable[[AttentionLayer], list[TensorSpec]],
                   fit: Callable[[AttentionLayer], tuple[LayerReport, dict[str, torch.Tensor]]],
                   finished: FinishedLayers | None = None):
    """Stream every tensor to the output in input order; at each attention layer, fit it and write its new
    tensors in place of the ones they replace. One layer and one tensor in memory at a time; every output
    tensor's name, dtype and shape is known (layer_specs) before anything is computed."""
    by_anchor = {layer.anchor: layer for layer in source.layers}
    replaced = {name for layer in source.layers for name in layer.replaced}
    specs = []
    for name in source.reader.names():
        if name in by_anchor:
            specs += layer_specs(by_anchor[name])
        if name not in replaced:
            specs.append(source.reader.spec(name))
    writer = ShardWriter(folder, specs, max_shard_size)
    reader, reports = source.reader, []
    for name in reader.names():
        reader.release_all_but(name)  # keep one input shard mapped at a time
        if name in by_anchor:
            progress("decomposing", len(reports), len(source.layers))
            layer = by_anchor[name]
            done = finished.get(layer) if finished else None
            report, tensors = done if done else fit(layer)
            if finished and not done:
                finished.put(layer, report, tensors)
            reports.append(report)
            for new_name, tensor in tensors.items():
                writer.add(new_name, tensor)
        if name not in replaced:
            location = reader.byte_range(name)
            if location is None:
                writer.add(name, reader.get(name))
            else:
                writer.copy_bytes(reader.spec(name), location)
    progress("decomposing", len(reports), len(source.layers))
    return reports, writer.finish()


def _fit_layer(source: SourceModel, layer: AttentionLayer, options: CompressOptions, rank: int, metric):
    started = time.perf_counter()
    projections = source.read_projections(layer)
    products = projections.products(layer.shape.num_heads)
    fit = method_named(options.method).fit(FitRequest(
        products, rank, options.max_iterations, options.tolerance, options.device, options.seed,
        query_metric=metric.query if metric else None, key_metric=metric.key if metric else None,
    ))
    bias = content_bias(projections.key_weight, projections.query_bias, layer.shape.num_heads)
    if fit.content_bias_correction is not None:
        bias = bias + fit.content_bias_correction
    factors, refinement = fit.factors, None
    if metric is not None and metric.query_samples and options.refine_steps and rank < layer.shape.key_dim:
        factors, bias, refinement = _refine(projections, layer, fit, bias, metric, options.refine_steps, options.seed)
        fit.relative_error = relative_error(products, factors)
    tensors = collaborative_tensors(layer.prefix, factors.shared_query, factors.shared_key, factors.mixing, bias,
                                    projections.query_weight.dtype)
    tensors.update(projections.kept)
    return _layer_report(layer, rank, fit, refinement, time.perf_counter() - started), tensors


def _refine(projections: Projections, layer: AttentionLayer, fit: LayerFit, bias, metric, steps: int, seed: int):
    """Refine the fitted factors against the original layer's attention on the calibration sequences."""
    from .decompose.refinement import refine_attention

    refined = refine_attention(
        metric.query_samples, metric.key_samples, projections.query_weight, projections.query_bias,
        projections.key_weight, fit.factors, bias, layer.shape.num_heads, layer.shape.head_dim**-0.5,
        causal=layer.causal, steps=steps, seed=seed,
    )
    report = {"kl_before": refined.kl_before, "kl_after": refined.kl_after, "steps": refined.steps}
    return refined.factors, refined.content_bias.to(bias.dtype), report


def _layer_report(layer: AttentionLayer, rank: int, fit: LayerFit, refinement: dict[str, Any] | None,
                  seconds: float) -> LayerReport:
    before = original_cost(layer.shape, has_bias=layer.has_query_bias)
    after = collaborative_cost(layer.shape, rank)
    truncation = fit.per_head_truncation_error
    return LayerReport(
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


def write_format_config(source: SourceModel, reports: list[LayerReport], folder: Path, method: str) -> None:
    kv_heads = {layer.prefix: layer.kv_heads for layer in source.layers}
    layers = {r.name: FormatConfig.layer_entry(r.rank, HeadCounts(r.num_heads, kv_heads[r.name])) for r in reports}
    write_config(source.config, source.family.name, method, layers, folder)
