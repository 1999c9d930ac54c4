"""The one writer of every form's checkpoint: every input tensor streamed to the output in order, each attention
layer fitted (by the form) where its tensors stream past, up to a few layers ahead in worker threads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .architectures.layouts import AttentionLayer
from .architectures.source import SourceModel
from .format import load_guard
from .io.headers import TensorSpec
from .io.writer import Passed, ShardWriter, parse_size
from .options import CompressOptions
from .progress import DETAIL, Progress, no_progress
from .resume import FinishedLayers
from .results import LayerReport


def layer_labels(source: SourceModel) -> dict[str, str]:
    """'layer k/L' by prefix, in the order the layers are written: what progress shows."""
    return {layer.prefix: f"layer {index + 1}/{len(source.layers)}" for index, layer in enumerate(source.layers)}


def fit_workers() -> int:
    """Layers fitted side by side when fits are independent of each other: one per thread the math was given."""
    return max(1, torch.get_num_threads())


def each_layer(function: Callable[[AttentionLayer], Any], layers: list[AttentionLayer], progress: Progress,
               stage: str) -> list:
    """function(layer) for every layer, results in layer order: fit_workers() layers side by side in threads of
    one torch thread each, as compress fits them (so analyze's fits are compress's, to the bit), progress
    counting the layers done."""
    workers = min(fit_workers(), len(layers))
    progress(stage, 0, len(layers))
    if workers <= 1:
        results = []
        for index, layer in enumerate(layers):
            results.append(function(layer))
            progress(stage, index + 1, len(layers))
        return results
    from concurrent.futures import ThreadPoolExecutor, as_completed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="collab-layer") as pool:
            futures = {pool.submit(function, layer): index for index, layer in enumerate(layers)}
            results: list = [None] * len(layers)
            for done, future in enumerate(as_completed(futures)):
                results[futures[future]] = future.result()
                progress(stage, done + 1, len(layers))
        return results
    finally:
        torch.set_num_threads(threads)


LayerFitter = Callable[[AttentionLayer, Progress], tuple[LayerReport, dict[str, torch.Tensor]]]


class FoldedFits:
    """A LayerFitter whose middle part runs for several layers at once (a refinement whose steps serve a few layers
    side by side): asked for a layer, it starts it and the next layers in `order` still to fit, up to `size` of
    those whose state `joins` (the others are fitted alone), runs `together` on their states, and finishes each;
    the results of the layers the writer has not asked for yet wait here (a layer's fitted tensors: small beside
    its calibration).

    start(layer, announce) -> state; together(states, announce) -> states; finish(layer, state) -> (report,
    tensors); announce(stage) shows the stage and the layers it is at."""

    def __init__(self, order: list[AttentionLayer], start, together, finish, joins, size: int,
                 labels: dict[str, str]):
        """`labels`: every layer's "layer k/L" by prefix (layer_labels), in the order they are written."""
        self.order, self.start, self.together, self.finish = order, start, together, finish
        self.joins, self.size, self.labels = joins, size, labels
        self.positions = {prefix: index for index, prefix in enumerate(labels)}
        self.waiting: dict[str, tuple[LayerReport, dict[str, torch.Tensor]]] = {}

    def __call__(self, layer: AttentionLayer, progress: Progress):
        if layer.prefix in self.waiting:
            return self.waiting.pop(layer.prefix)
        index = self.order.index(layer) if layer in self.order else len(self.order)
        done = self.positions[layer.prefix]  # layers before it in the write order, finished ones (--resume) too

        def announce(stage: str, group: list[AttentionLayer]) -> None:  # "layer 3/30", or "layers 3-6/30"
            first, last = self.labels[group[0].prefix], self.labels[group[-1].prefix]
            where = first if len(group) == 1 else f"layers {first.split()[1].split('/')[0]}-{last.split()[1]}"
            progress(f"{stage}{DETAIL}{where}", done, len(self.labels))

        state = self.start(layer, lambda stage: announce(stage, [layer]))
        group, states = [layer], [state]
        if self.joins(state):
            for following in self.order[index + 1:]:
                if len(group) >= self.size:
                    break
                if following.prefix in self.waiting:
                    continue
                following_state = self.start(following, lambda stage: None)
                if not self.joins(following_state):  # fitted alone, but done now: its result waits
                    self.waiting[following.prefix] = self.finish(following, following_state)
                    continue
                group.append(following)
                states.append(following_state)
            # (a layer alone was announced by its start)
            states = self.together(states, lambda stage: announce(stage, group) if len(group) > 1 else None)
        results = [self.finish(member, member_state) for member, member_state in zip(group, states, strict=True)]
        for member, result in zip(group[1:], results[1:], strict=True):
            self.waiting[member.prefix] = result
        return results[0]


def unchanged(name: str, spec: TensorSpec) -> list[Passed]:
    return [Passed(name)]


# --dtype: the precision every floating tensor is written in
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def written_dtype(source: SourceModel, requested: str) -> torch.dtype | None:
    """The precision the output's floating tensors are written in: `requested` (options.dtype), where "auto" keeps
    each tensor's own, except that a folder dequantised from a GGUF file goes back to the precision the file
    stored its weights in (float32 there is only the dequantiser's working precision). None: as stored."""
    from .io.gguf import source_precision

    if requested == "auto":
        requested = source_precision(source.folder)
    return DTYPES[requested] if requested else None


class Cast:
    """Floating tensors (and their specs) in one precision; None leaves each as it is."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype

    def changes(self, spec: TensorSpec) -> bool:
        return self.dtype is not None and spec.dtype.is_floating_point and spec.dtype != self.dtype

    def spec(self, spec: TensorSpec) -> TensorSpec:
        return TensorSpec(spec.name, self.dtype, spec.shape) if self.changes(spec) else spec

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        changed = self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype
        return tensor.to(self.dtype) if changed else tensor


def stream_weights(source: SourceModel, folder: Path, options: CompressOptions, progress: Progress,
                   layer_specs: Callable[[AttentionLayer], list[TensorSpec]], fit: LayerFitter,
                   finished: FinishedLayers | None = None, workers: int = 0,
                   passing: Callable[[str, TensorSpec], list[Passed]] = unchanged, guarded: bool = False):
    """Stream every tensor to the output in input order; at each attention layer, fit it and write its new
    tensors in place of the ones they replace. Every output tensor's name, dtype and shape is known
    (layer_specs) before anything is computed. Shards hold at most options.max_shard_size bytes; floating
    tensors are written in options.dtype (written_dtype).

    workers = 0 fits each layer where it streams past, with torch's threads. workers >= 1 fits up to that many
    layers ahead of the writer in worker threads while the writer copies tensors through: reading, the math
    and writing overlap, and memory holds at most `workers` layers in flight. There every torch operation runs
    on one thread, so the output bytes do not depend on the number of workers (a product summed by two
    threads rounds differently from one summed by one). `passing` says how each tensor that is not replaced is
    written (unchanged, by default). `guarded` writes each layer's load guard (format.load_guard) after its
    tensors: forms that load only through our quantizer."""
    cast = Cast(written_dtype(source, options.dtype))
    by_anchor = {layer.anchor: layer for layer in source.layers}
    replaced = {name for layer in source.layers for name in layer.replaced}
    guards = {layer.prefix: load_guard(layer.replaced, source.reader.spec(layer.anchor).dtype) if guarded else None
              for layer in source.layers}
    specs = _output_specs(source, layer_specs, guards, passing, by_anchor, replaced)
    writer = ShardWriter(folder, [cast.spec(spec) for spec in specs], parse_size(options.max_shard_size))
    reader, reports = source.reader, []
    names = reader.names()
    labels = layer_labels(source)
    ahead = FitsAhead(fit, workers, [by_anchor[name] for name in names if name in by_anchor], finished)
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
                    writer.add(new_name, cast.tensor(tensor))
                if guards[layer.prefix]:
                    writer.add(guards[layer.prefix].name, cast.tensor(torch.empty(0, dtype=guards[layer.prefix].dtype)))
            elif index % 16 == 0:
                progress("writing", index, len(names))
            if name not in replaced:
                _pass_through(reader, writer, name, passing(name, reader.spec(name)), cast)
    finally:
        ahead.close()
    progress("writing", len(names), len(names))
    files = writer.finish()
    progress("writing", len(names), len(names))
    order = {layer.prefix: index for index, layer in enumerate(source.layers)}  # numeric: layer 2 before layer 10
    return sorted(reports, key=lambda report: order[report.name]), files


def _output_specs(source: SourceModel, layer_specs: Callable[[AttentionLayer], list[TensorSpec]], guards: dict,
                  passing: Callable[[str, TensorSpec], list[Passed]], by_anchor: dict[str, AttentionLayer],
                  replaced: set[str]) -> list[TensorSpec]:
    """Every output tensor's spec in write order: each layer's new tensors (and guard) at its anchor, every
    tensor not `replaced` as `passing` writes it."""
    specs = []
    for name in source.reader.names():
        if name in by_anchor:
            layer = by_anchor[name]
            specs += layer_specs(layer) + ([guards[layer.prefix]] if guards[layer.prefix] else [])
        if name not in replaced:
            spec = source.reader.spec(name)
            specs += [part.spec(spec) for part in passing(name, spec)]
    return specs


def _pass_through(reader, writer: ShardWriter, name: str, parts: list[Passed], cast: Cast) -> None:
    """Copy a tensor (or rows of it) unchanged: its bytes where the input is safetensors and the precision stays,
    never loading it whole; else its values, cast."""
    spec, location = reader.spec(name), reader.byte_range(name)
    for part in parts:
        if location is None or cast.changes(spec):
            writer.add(part.name, cast.tensor(reader.get(name)[part.start:part.stop]))
            continue
        file, start, end = location
        row = (end - start) // spec.shape[0] if spec.shape and spec.shape[0] else 0
        stop = part.stop if part.stop is not None else (spec.shape[0] if spec.shape else 0)
        moved = (file, start + part.start * row, start + stop * row) if row else location
        writer.copy_bytes(part.spec(spec), moved)


class FitsAhead:
    """Layer fits submitted in write order to a few worker threads, at most `workers` of them ahead. A fit names
    its device in every tensor it makes (options.device): torch's modes and a thread's current CUDA device and
    stream are per thread, so nothing set in the caller's thread may be relied on here."""

    def __init__(self, fit: LayerFitter, workers: int, layers: list[AttentionLayer], finished: FinishedLayers | None):
        self.fit, self.workers = fit, workers
        self.done, self.total = 0, len(layers)
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
        # as a fit in place does: the layer the writer takes next, and how many it has taken (each one saved for
        # --resume by then)
        progress(f"fitting{DETAIL}{label}", self.done, self.total)
        result = future.result()
        self.done += 1
        self._top_up()
        return result

    def close(self) -> None:
        if self.pool is not None:
            for future in self.pending.values():
                future.cancel()
            self.pool.shutdown(wait=True)
        if self.threads is not None:
            torch.set_num_threads(self.threads)
