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
from .cpu import reused_heap
from .devices import unavailable
from .errors import BadInputError
from .format import CONTENT_BIAS, FormatConfig, HeadCounts, collaborative_tensors, write_config
from .io.folders import check_output
from .io.spill import SpillFolder
from .io.headers import TensorSpec
from .io.writer import ShardWriter, parse_size
from .options import CompressOptions
from .progress import DETAIL, Progress, no_progress
from .results import CompressPlan, LayerReport, rounded


def check_plan(source: SourceModel, options: CompressOptions, ranks: dict[str, int] | None = None,
               layers: list[dict] | None = None) -> CompressPlan:
    """Refuse what cannot work before anything costly runs. `layers`: the per-layer plan where a form other than
    the CP form (the rotary shared key) made it; else made here from the ranks."""
    parse_size(options.max_shard_size)
    output = options.output.expanduser().resolve()
    check_output(output, source.folder, options.overwrite)
    check_device(options.device)
    if options.calibration is not None and not method_named(options.method).calibrates:
        raise BadInputError(f"--calibration does not work with the {options.method} method")
    if options.distill_steps:
        _check_distillation(source, options)
    if layers is None:
        layers = _plan_layers(source, options, ranks)
    return CompressPlan(
        model=source.source,
        output=str(output),
        family=source.family.name,
        form=source.form,
        method=None if source.form == "shared-key" else options.method,
        layers=layers,
        parameters_before=sum(layer["parameters_before"] for layer in layers),
        parameters_after=sum(layer["parameters_after"] or 0 for layer in layers),
    )


def check_device(device: str) -> None:
    """Refuse a CUDA device torch cannot see, before anything runs."""
    why = unavailable(device)
    if why:
        raise BadInputError(why)


def within_positions(source: SourceModel, options: CompressOptions) -> CompressOptions:
    """Calibration texts cut where the model's position embeddings end: a longer cut would index past them."""
    from .architectures.lookup import within_positions as cut

    length = cut(source.config, options.calibration_max_length)
    if length != options.calibration_max_length:
        return options.model_copy(update={"calibration_max_length": length})
    return options


def _check_distillation(source: SourceModel, options: CompressOptions) -> None:
    from .integration.fidelity import is_language_model

    if options.calibration is None:
        raise BadInputError("--distill-steps learns from the calibration text: give --calibration FILE too")
    if not is_language_model(source.config.get("architectures")):
        raise BadInputError("--distill-steps matches next-token distributions, so it needs a language model "
                            "(config.json's architectures name a ...ForCausalLM), not "
                            f"{source.config.get('architectures')}")


def _plan_layers(source: SourceModel, options: CompressOptions, ranks: dict[str, int] | None) -> list[dict]:
    if options.key_cache is not None:
        raise BadInputError("--key-cache sizes the shared-key form, which --form collaborative is not; give --rank")
    if options.rank is None:
        raise BadInputError("give --rank R (the shared query/key dimension), or --rank auto")
    layers = []
    for layer in source.layers:
        rank = (ranks or {}).get(layer.prefix, options.rank)
        if rank != "auto":
            layer.check_rank(rank)
        before = original_cost(layer.shape, has_bias=layer.has_query_bias).parameters
        keeps_bias = layer.stores_content_bias(options.calibration is not None)
        after = collaborative_cost(layer.shape, rank, keeps_bias).parameters if rank != "auto" else None
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
              refine: bool = True, scratch: Path | None = None):
    """Input statistics of every layer on the calibration texts, and what the report says about them. With a
    `scratch` folder the model runs a block at a time and the statistics wait there (capture.py)."""
    from .integration.capture import collect_statistics

    refines = refine and bool(options.refine_steps)
    metrics, batches = collect_statistics(
        source.folder, source.layout, source.family.position_bias, [layer.prefix for layer in source.layers], texts,
        options.calibration_max_length, progress, keep_samples=options.refine_samples if refines else 0,
        token_budget=options.calibration_tokens, scratch=scratch,
        width=source.width, device=options.device,
    )
    if refines:
        from .decompose.refinement import BATCH_SEQUENCES, QUERY_ROWS

        refinement = (f"Adam on the attention KL, {options.refine_steps} steps per layer on average, shared out by "
                      f"each layer's KL before refinement; each step on {BATCH_SEQUENCES} of "
                      f"{min(options.refine_samples, len(texts))} sequences and {QUERY_ROWS} query positions in each, "
                      "stopped and chosen on a held-out tenth of them")
    else:
        refinement = "off"
    calibration = {
        "source": str(options.calibration),
        "examples": batches.texts,
        "tokens": batches.tokens,
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
            metric = metrics[layer.prefix]
            products = whiten(products, metric.query, metric.key)
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
    there) in place of the ones they replace. With refinement, every layer is fitted first and the refinement
    steps are shared out by each layer's attention error (`refinement_steps`)."""
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
        else:
            projections, layer_fit, bias = _fit(source, layer, options, rank, metric, progress, labels)
        refinement = None
        if steps.get(layer.prefix) and rank < layer.shape.key_dim:
            with reused_heap():
                refinement = _refine(projections, layer, layer_fit, bias, metric, steps, labels, options,
                                     progress)
            layer_fit.factors, bias = refinement.pop("factors"), refinement.pop("content_bias")
            layer_fit.relative_error = relative_error(projections.products(layer.shape.num_heads), layer_fit.factors)
        tensors = collaborative_tensors(layer.prefix, layer_fit.factors.shared_query, layer_fit.factors.shared_key,
                                        layer_fit.factors.mixing, bias, projections.query_weight.dtype)
        keeps_bias = layer.stores_content_bias(calibrated)
        if not keeps_bias:
            zeros = tensors.pop(f"{layer.prefix}.{CONTENT_BIAS}")
            assert not zeros.any(), "a layer without query bias or calibration has no content bias"
        tensors.update(projections.kept)
        return _layer_report(layer, rank, layer_fit, refinement, time.perf_counter() - started, keeps_bias), tensors

    return stream_weights(source, folder, parse_size(options.max_shard_size), progress, specs, fit, finished,
                          workers=0 if steps else fit_workers())


def fit_workers() -> int:
    """Layers fitted side by side when fits are independent of each other: one per thread the math was given."""
    return max(1, torch.get_num_threads())


def refinement_steps(source: SourceModel, options: CompressOptions, ranks: dict[str, int], metrics, progress: Progress,
                     finished: "FinishedLayers | None" = None):
    """(fits by layer as (fit, content bias, seconds), refinement steps by layer): each layer
    fitted, its held-out attention KL measured, and `refine_steps` x layers steps shared out in proportion to
    those KLs (decompose/refinement.share_steps). A resumed run reuses the split it saved, so its output stays
    byte-identical; its layers are fitted again as they come."""
    from .decompose.refinement import AttentionTarget, share_steps

    saved = finished.load_plan() if finished else None
    if saved is not None:
        return {}, saved
    labels = layer_labels(source)
    # fits wait on disk beside statistics that do (a block-at-a-time calibration): memory holds one layer
    fits = SpillFolder(metrics.folder.parent / "fits") if isinstance(metrics, SpillFolder) else {}
    losses = []
    for layer in source.layers:
        # one input shard mapped at a time here too: the pages each layer's fit read would otherwise stay
        # resident (file-backed) for every layer until writing begins
        source.reader.release_all_but(layer.anchor)
        rank, metric = ranks[layer.prefix], metrics[layer.prefix]
        started = time.perf_counter()
        projections, fit, bias = _fit(source, layer, options, rank, metric, progress, labels)
        fits[layer.prefix] = fit, bias, time.perf_counter() - started
        if rank >= layer.shape.key_dim or not metric.query_samples:
            losses.append(0.0)
            continue
        target = AttentionTarget(metric.query_samples, metric.key_samples, projections.query_weight,
                                 projections.query_bias, projections.key_weight, layer.shape.num_heads,
                                 score_scale(layer, metric), layer.causal, getattr(metric, "position_bias", None),
                                 device=options.device)
        losses.append(target.held_out_kl((fit.factors.shared_query, fit.factors.shared_key, fit.factors.mixing, bias)))
    steps = dict(zip(fits, share_steps(losses, options.refine_steps * len(source.layers)), strict=True))
    if finished:
        finished.save_plan(steps)
    return fits, steps


def layer_labels(source: SourceModel) -> dict[str, str]:
    """'layer k/L' by prefix, in the order the layers are written: what progress shows."""
    return {layer.prefix: f"layer {index + 1}/{len(source.layers)}" for index, layer in enumerate(source.layers)}


def score_scale(layer: AttentionLayer, metric) -> float:
    """What the layer multiplies its scores by: the module's own `scaling` where calibration read one (GPT-2's
    per-layer and optional scalings included), else 1/sqrt(d_k)."""
    scaling = getattr(metric, "scaling", None)
    return scaling if scaling is not None else layer.shape.head_dim**-0.5


def _fit(source: SourceModel, layer: AttentionLayer, options: CompressOptions, rank: int, metric, progress: Progress,
         labels: dict[str, str]):
    """(projections, fit, content bias) of one layer, before any refinement."""
    progress(f"fitting{DETAIL}{labels[layer.prefix]}", list(labels).index(layer.prefix), len(labels))
    projections = source.read_projections(layer)
    products = projections.products(layer.shape.num_heads)
    fit = method_named(options.method).fit(FitRequest(
        products, rank, options.max_iterations, options.tolerance, options.device, options.seed,
        query_metric=metric.query if metric else None, key_metric=metric.key if metric else None,
    ))
    bias = content_bias(projections.key_weight, projections.query_bias, layer.shape.num_heads)
    if fit.content_bias_correction is not None:
        bias = bias + fit.content_bias_correction
    return projections, fit, bias


class FinishedLayers:
    """Each fitted layer's tensors and report, saved as it finishes (safetensors + JSON) in the staging folder,
    so that --resume after a killed run reuses them instead of fitting again: the costly part of a long
    calibrated run. Saved tensors are exactly what is written, so a resumed output is byte-identical."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def _paths(self, layer: AttentionLayer) -> tuple[Path, Path]:
        stem = layer.prefix.replace("/", "_")
        return self.folder / f"{stem}.safetensors", self.folder / f"{stem}.json"

    def has(self, layer: AttentionLayer) -> bool:
        return self.folder is not None and all(path.is_file() for path in self._paths(layer))

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

    def load_plan(self) -> dict[str, int] | None:
        """The refinement steps per layer a killed run had chosen, if it got that far."""
        path = self.folder / "refinement_steps.json" if self.folder else None
        if path is None or not path.is_file():
            return None
        try:
            return {str(k): int(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
        except (ValueError, AttributeError):
            return None

    def save_plan(self, steps: dict[str, int]) -> None:
        if self.folder is not None:
            path = self.folder / "refinement_steps.json"
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(steps), encoding="utf-8")
            partial.replace(path)

    def put(self, layer: AttentionLayer, report: LayerReport, tensors: dict[str, torch.Tensor]) -> None:
        if self.folder is None:
            return
        from safetensors.torch import save_file

        tensors_path, report_path = self._paths(layer)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tensors_path))
        report_path.with_suffix(".order").write_text(json.dumps(list(tensors)), encoding="utf-8")
        report_path.write_text(json.dumps(report.to_dict()), encoding="utf-8")  # last: marks the layer done


LayerFitter = Callable[[AttentionLayer, Progress], tuple[LayerReport, dict[str, torch.Tensor]]]


def stream_weights(source: SourceModel, folder: Path, max_shard_size: int, progress: Progress,
                   layer_specs: Callable[[AttentionLayer], list[TensorSpec]], fit: LayerFitter,
                   finished: FinishedLayers | None = None, workers: int = 0):
    """Stream every tensor to the output in input order; at each attention layer, fit it and write its new
    tensors in place of the ones they replace. Every output tensor's name, dtype and shape is known
    (layer_specs) before anything is computed.

    workers = 0 fits each layer where it streams past, with torch's threads. workers >= 1 fits up to that many
    layers ahead of the writer in worker threads while the writer copies tensors through: reading, the math
    and writing overlap, and memory holds at most `workers` layers in flight. There every torch operation runs
    on one thread, so the output bytes do not depend on the number of workers (a product summed by two
    threads rounds differently from one summed by one)."""
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
    names = reader.names()
    labels = layer_labels(source)
    ahead = _FitsAhead(fit, workers, [by_anchor[name] for name in names if name in by_anchor], finished)
    try:
        for index, name in enumerate(names):
            reader.release_all_but(name)  # keep one input shard mapped at a time
            if name in by_anchor:
                layer = by_anchor[name]
                done = finished.get(layer) if finished else None
                report, tensors = done if done else ahead.result(layer, progress, labels[layer.prefix])
                if finished and not done:
                    finished.put(layer, report, tensors)
                reports.append(report)
                progress("writing", index, len(names))
                for new_name, tensor in tensors.items():
                    writer.add(new_name, tensor)
            elif index % 16 == 0:
                progress("writing", index, len(names))
            if name not in replaced:
                location = reader.byte_range(name)
                if location is None:
                    writer.add(name, reader.get(name))
                else:
                    writer.copy_bytes(reader.spec(name), location)
    finally:
        ahead.close()
    progress("writing", len(names), len(names))
    files = writer.finish()
    progress("writing", len(names), len(names))
    return reports, files


class _FitsAhead:
    """Layer fits submitted in write order to a few worker threads, at most `workers` of them ahead."""

    def __init__(self, fit: LayerFitter, workers: int, layers: list[AttentionLayer], finished: FinishedLayers | None):
        self.fit, self.workers = fit, workers
        self.waiting = [layer for layer in layers if not (finished and finished.has(layer))] if workers else []
        self.pending: dict[str, Any] = {}
        self.pool = self.threads = None
        if workers:
            # one thread per operation for every fit of this run, the ones fitted in place included (a saved
            # layer that fails to load on --resume): the bytes must not depend on where a layer was fitted
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)
        if self.waiting:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="collab-fit")
            self._top_up()

    def _top_up(self) -> None:
        while self.waiting and len(self.pending) < self.workers:
            layer = self.waiting.pop(0)
            self.pending[layer.prefix] = self.pool.submit(self.fit, layer, no_progress)

    def result(self, layer: AttentionLayer, progress: Progress, label: str):
        future = self.pending.pop(layer.prefix, None)
        if future is None:  # fitted where it streams past (no workers, or a saved layer that failed to load)
            return self.fit(layer, progress)
        if not future.done():  # the writer waits on the math: show it as fitting
            progress(f"fitting{DETAIL}{label}", 0, 1)
        result = future.result()
        self._top_up()
        return result

    def close(self) -> None:
        if self.pool is not None:
            for future in self.pending.values():
                future.cancel()
            self.pool.shutdown(wait=True)
        if self.threads is not None:
            torch.set_num_threads(self.threads)


def _refine(projections: Projections, layer: AttentionLayer, fit: LayerFit, bias, metric, steps: dict[str, int],
            labels: dict[str, str], options: CompressOptions, progress: Progress) -> dict[str, Any]:
    """Refine one layer's fitted factors against the original layer's attention on the calibration sequences,
    with the steps its error earned; progress shows the held-out KL as it falls."""
    from .decompose.refinement import refine_attention

    total, before = sum(steps.values()), sum(steps[p] for p in list(steps)[: list(steps).index(layer.prefix)])
    label = labels[layer.prefix]

    def on_check(step: int, loss: float) -> None:
        progress(f"refining{DETAIL}{label}, held-out KL {loss:.4f}", before + step, total)

    progress(f"refining{DETAIL}{label}", before, total)
    refined = refine_attention(
        metric.query_samples, metric.key_samples, projections.query_weight, projections.query_bias,
        projections.key_weight, fit.factors, bias, layer.shape.num_heads, score_scale(layer, metric),
        causal=layer.causal, steps=steps[layer.prefix], seed=options.seed, on_check=on_check,
        position_bias=getattr(metric, "position_bias", None), device=options.device,
    )
    return {"kl_before": refined.kl_before, "kl_after": refined.kl_after, "steps": refined.steps,
            "factors": refined.factors, "content_bias": refined.content_bias.to(bias.dtype)}


def _layer_report(layer: AttentionLayer, rank: int, fit: LayerFit, refinement: dict[str, Any] | None,
                  seconds: float, content_bias: bool = True) -> LayerReport:
    before = original_cost(layer.shape, has_bias=layer.has_query_bias).cached(layer.caches_keys)
    after = collaborative_cost(layer.shape, rank, content_bias).cached(layer.caches_keys)
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


def write_format_config(source: SourceModel, reports: list[LayerReport], folder: Path, method: str,
                        calibrated: bool = False) -> None:
    by_prefix = {layer.prefix: layer for layer in source.layers}
    layers = {r.name: FormatConfig.layer_entry(r.rank, HeadCounts(r.num_heads, by_prefix[r.name].kv_heads),
                                               by_prefix[r.name].stores_content_bias(calibrated))
              for r in reports}
    write_config(source.config, source.family.name, method, layers, folder)


def distill_checkpoint(source: SourceModel, folder: Path, texts: list[str], options: CompressOptions,
                       progress: Progress) -> dict[str, Any]:
    """--distill-steps: tune the written checkpoint's collaborative tensors together against the original
    (integration/distillation.py) and write the best state over them in place; what happened, for the report."""
    from .integration.distillation import distill
    from .io.reader import TensorReader
    from .io.writer import overwrite_tensors

    progress("distilling", 0, options.distill_steps)
    with reused_heap():  # every step allocates the same activations afresh (cpu.reused_heap)
        tuned, report = distill(source.folder, folder, texts, options.calibration_max_length, options.distill_steps,
                                options.seed, progress, options.device)
    reader = TensorReader(folder)
    try:
        on_disk = set(reader.names())
    finally:
        reader.close()
    # The loaded model may name tensors with its head's base-model prefix ("model.") where the checkpoint has none.
    renamed = {}
    for name, tensor in tuned.items():
        stripped = name.split(".", 1)[-1]
        renamed[name if name in on_disk or stripped not in on_disk else stripped] = tensor
    overwrite_tensors(folder, renamed)
    progress("distilling", options.distill_steps, options.distill_steps)
    return report.as_dict()
