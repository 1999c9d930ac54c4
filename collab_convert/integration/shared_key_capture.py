"""Statistics of real attention for the shared-key form: the original model run on calibration text.

Forward pre-hooks on the attention modules compute the module's own queries and keys (after any QK-norm, before
RoPE) from the hidden states it receives, and add their energies and second moments to the layer's record
(decompose/shared_key.py), with a few raw sequences (queries, keys, values) and how the layer turns scores into
attention (scale, RoPE tables, soft-capping, output projection), for refinement. The module's own forward then
reuses the projections the hook computed (ProjectionReplay) rather than computing them again. The run itself is
model_runs.py's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..devices import HOST, Device, host_copy
from ..errors import BadInputError
from .batches import CurrentBatch
from .model_runs import CalibrationRun, modules_of, observe_calibration, position_bias_of


@dataclass
class SharedKeyCalibration:
    """One shared-key layer on calibration text: its statistics, and for refinement a few raw sequences and how
    the layer turns scores into attention."""

    statistics: object  # decompose.shared_key.KeyStatistics, means per token
    samples: list  # decompose.shared_key_batches.SharedKeySample, float16 to halve their memory
    setting: object | None  # decompose.shared_key_batches.AttentionSetting
    value_moment: torch.Tensor | None = None  # (G d, G d): E[v v^T] per token, where asked for (value_latent.py)


@dataclass
class ProjectionReplay:
    """An attention module's projections, called by a pre-hook on the hidden states the module then receives:
    while the hook runs, each projection's output is kept with its input; when the module's forward calls the
    same projection on the same tensor, it gets the kept output back instead of a second product. The queries,
    keys and values recomputed in the hook were ~10% of SmolLM2's calibration pass.

    A projection is any leaf child with a 2-D weight (nn.Linear, GPT-2's Conv1D); a call on another input, or
    after the forward, runs the projection as before. `release` restores every projection's own forward (an
    accelerate hook's wrapper included): at the next hook, after the forward, and when the hooks are removed."""

    kept: dict = field(default_factory=dict)  # projection -> (input, output), from the hook's calls
    patched: dict = field(default_factory=dict)  # projection -> its own `forward` attribute (None: the class's)
    replaying: bool = False

    def recording(self, module: torch.nn.Module) -> None:
        """Keep what `module`'s projections return from now until `replay`."""
        self.release()
        for child in module.children():
            weight = getattr(child, "weight", None)
            if next(child.children(), None) is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                self.patched[child] = child.__dict__.get("forward")
                child.forward = self._standing_in(child, child.forward)

    def replay(self) -> None:
        self.replaying = True

    def release(self, *_) -> None:
        for child, own in self.patched.items():
            if own is None:
                del child.forward
            else:
                child.forward = own
        self.kept, self.patched, self.replaying = {}, {}, False

    def remove(self) -> None:  # a hook handle's interface: the driver removes the observer's handles
        self.release()

    def _standing_in(self, child, run):
        def forward(hidden, *args, **kwargs):
            kept = self.kept.get(child)
            if kept is not None and kept[0] is hidden and not args and not kwargs:
                if self.replaying:  # the forward calls a projection once per input
                    del self.kept[child]
                return kept[1]  # (while recording: a fused projection read for the keys and again for the values)
            output = run(hidden, *args, **kwargs)
            if not self.replaying and not args and not kwargs:
                self.kept[child] = (hidden, output)
            return output

        return forward


class SharedKeyObserver:
    """Forward pre-hooks on attention modules that compute the module's own queries, keys (and values)
    from the hidden states it receives and add them to that layer's record."""

    def __init__(self, layout, position_bias, layers: dict, keep_samples: int, current: CurrentBatch,
                 value_moments: bool = False):
        self.layout, self.read_position_bias, self.layers = layout, position_bias, layers
        self.keep, self.current, self.value_moments = keep_samples, current, value_moments
        self.found = {prefix: SharedKeyCalibration(None, [], None) for prefix in layers}
        self.tokens = dict.fromkeys(layers, 0)
        self.replay = ProjectionReplay()
        self.awaiting: dict[str, list] = {}  # prefix -> (row, sample) kept this call, awaiting the module's output

    def attach(self, model, prefixes: list[str]) -> list:
        handles = []
        for prefix, module in modules_of(model, prefixes).items():
            handles.append(module.register_forward_pre_hook(self.hook(prefix), with_kwargs=True))
            handles.append(module.register_forward_hook(self.replay.release, always_call=True))
            if self.keep:
                output = self.layout.output_module(module)
                handles.append(output.register_forward_hook(self.output_hook(prefix)))
        return handles + [self.replay]

    def output_hook(self, prefix: str):
        """A forward hook on the output projection: the samples kept in this call get the attention's output as
        the model computed it, the refinement's target (a pass stopped before the module ran leaves theirs empty,
        and refinement computes it)."""
        current = self.current

        def hook(projection, args, output):
            awaiting = self.awaiting.pop(prefix, None)
            if not awaiting:
                return
            bias = getattr(projection, "bias", None)  # the refinement's output projection has none
            rows = current.sequences(output)
            for row, sample in awaiting:
                sample.target_output = host_copy(rows[row] if bias is None else rows[row] - bias, torch.float16)
            current.stop_if_seen()  # the hook let the pass go on to here (below)

        return hook

    def hook(self, prefix: str):
        from ..decompose.shared_key import statistics_of
        from ..decompose.shared_key_batches import AttentionSetting, SharedKeySample
        from ..decompose.value_latent import value_moment

        geometry, heads, causal = self.layers[prefix]
        record, layout, current = self.found[prefix], self.layout, self.current

        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            source = kwargs.get("key_value_states")  # encoder-decoder attention: keys and values from the encoder
            source = hidden if source is None else source
            self.replay.recording(module)
            queries, keys = layout.original_queries_keys(module, hidden, heads, source)
            wanted = self.keep or self.value_moments
            values = layout.original_values(module, source, heads) if wanted else queries
            self.replay.replay()
            real = [current.sequences(part) for part in (queries, keys, values)]  # each cut to its real tokens
            # the batch's real tokens end to end: its statistics in one call (no padding counted; a call per
            # sequence left hundreds of small float64 tensors in the pass's heap: its peak 245 -> 207 MB)
            # (in their own dtype: the statistics widen them to float64 themselves)
            joined = [torch.cat(parts) for parts in real[: 3 if self.value_moments else 2]]
            more = statistics_of(joined[0], joined[1], geometry, [key.shape[0] for key in real[1]])
            record.statistics = more if record.statistics is None else record.statistics + more
            if self.value_moments:
                moment = value_moment(joined[2])
                record.value_moment = moment if record.value_moment is None else record.value_moment + moment
            self.tokens[prefix] += joined[0].shape[0]
            kept = self.awaiting[prefix] = []
            for row, (query, key, value) in enumerate(zip(*real, strict=True)):
                if len(record.samples) < self.keep:
                    record.samples.append(SharedKeySample(*(host_copy(t, torch.float16) for t in (query, key, value))))
                    kept.append((row, record.samples[-1]))
            cos, sin = rotary_tables(kwargs, hidden)
            if record.setting is None or record.setting.cos.shape[0] < cos.shape[1]:
                output = layout.output_weight(module)
                record.setting = AttentionSetting(float(module.scaling), host_copy(cos[0], torch.float32),
                                                  host_copy(sin[0], torch.float32),
                                                  getattr(module, "attn_logit_softcapping", None),
                                                  host_copy(output, torch.float32), causal,
                                                  self._position_bias(module, args, kwargs))
            # the last observation stops the pass, but not before the samples it kept have their output: without it
            # the last layer's samples past the first batch lacked their targets, and its refinement computed them
            # all again in float32 (SmolLM2, 300 documents: that layer's refining peak 189 MB, the others' 100-150)
            current.observed_one(stop=not kept)

        return hook

    def _position_bias(self, module, args, kwargs) -> torch.Tensor | None:
        """The relative position bias the module adds to its scores (T5's), (N_h, n, m), for refinement."""
        if self.read_position_bias is None:
            return None
        bias = position_bias_of(module, self.read_position_bias, inspect.signature(module.forward), args, kwargs)
        return None if bias is None else host_copy(bias[0], torch.float32)

    def finished(self, prefix: str) -> SharedKeyCalibration:
        """The layer's record, statistics as means per token in host memory; forgotten here."""
        record = self.found.pop(prefix)
        if record.statistics is None:
            raise BadInputError(f"calibration never reached {prefix}")
        record.statistics = record.statistics.scaled(1 / self.tokens[prefix]).to(HOST)
        if record.value_moment is not None:
            record.value_moment = (record.value_moment / self.tokens[prefix]).to(HOST)
        return record


def rotary_tables(kwargs: dict, hidden: torch.Tensor):
    """RoPE's cos/sin tables as the module receives them; empty ones (no rotated dimension) for a decoder with
    absolute positions, whose shared key is all pass-through."""
    tables = kwargs.get("position_embeddings")
    if tables is not None:
        return tables
    empty = hidden.new_ones(1, hidden.shape[1], 0)
    return empty, empty


def collect_shared_key_statistics(folder: Path, layout, position_bias, layers: dict, texts: list[str],
                                  max_length: int = 128, progress=None, keep_samples: int = 0,
                                  token_budget: int | None = None, scratch: Path | None = None,
                                  width: int | None = None, device: Device = HOST, value_moments: bool = False):
    """Query energy and key second moments of every shared-key layer on real text (decompose/shared_key.py), as
    means per token, and up to `keep_samples` raw sequences per layer. `layers` maps a prefix to (geometry, head
    counts, causal); `layout` computes a module's own queries, keys and values; `position_bias` reads a relative
    position bias from a module's arguments (a family's, or None). The queries and keys are the module's own, after
    any QK-norm and before RoPE, computed from the hidden states it receives; RoPE tables, scale and soft-capping
    are read from the same call. Returns the records by prefix and the batches that ran. With a `scratch` folder a
    block at a time (model_runs.py). `value_moments`: also each layer's value second moment (the multi-query
    form's value latent)."""
    current = CurrentBatch()
    observer = SharedKeyObserver(layout, position_bias, layers, keep_samples, current, value_moments)
    run = CalibrationRun(max_length, token_budget, width, scratch, device)
    return observe_calibration(folder, list(layers), texts, observer, current, run, progress)
