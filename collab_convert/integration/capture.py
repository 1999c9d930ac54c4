"""Statistics of real attention inputs: the original model run on calibration text.

For every attention layer the query-side inputs x and key-side inputs y are caught on their way into the
query and key projections (forward pre-hooks). The texts run in batches of similar length, padded on the
right; the hooks cut each sequence back to its real tokens, so no padding token is ever counted. What is kept
is small and enough for a calibrated fit: the mean and covariance of x, and the covariance of y around each
sequence's own mean (what a softmax over keys can see). The cost is bounded by a token budget, not by the
number or length of the texts.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decompose.calibrated import InputMetric
from ..devices import HOST, Device, host_copy, moved
from ..errors import BadInputError
from ..io.spill import SpillFolder
from ..modeling.collaborative import strip_prefix
from ..progress import DETAIL

BATCH_TOKENS = 4096  # padded tokens per forward pass: the activations of one batch stay small
BATCH_SEQUENCES = 64
ACTIVATION_BYTES = 96 << 20  # a batch's activations inside one block, roughly: wide models get fewer tokens


def batch_tokens(width: int | None) -> int:
    """Padded tokens per batch for a model of hidden size `width`: a block's activations (the 4x-wide feed-forward
    twice, queries, keys, values: about 16 float32 numbers per token and hidden unit) within ACTIVATION_BYTES.
    all-MiniLM-L6-v2 (384): 4096 tokens; GPT-2-medium (1024): 1536. BATCH_TOKENS where the width is unknown."""
    if not width:
        return BATCH_TOKENS
    return max(256, min(BATCH_TOKENS, ACTIVATION_BYTES // (64 * width)))


@dataclass
class LayerCalibration:
    query: InputMetric
    key: InputMetric
    query_samples: list  # per sequence (n, D) float16, for refinement
    key_samples: list
    # the module's own score scale (transformers' `scaling`: 1/sqrt(d_k), or GPT-2's per-layer and optional
    # scalings), read from the module the statistics came from; None where the module has none
    scaling: float | None = None
    # (H, N, N): a relative position bias the module adds to its scores (MPNet), for the longest sequence seen;
    # a shorter sequence's is its top-left corner (the bias depends only on j - i). None where there is none
    position_bias: torch.Tensor | None = None


@dataclass
class CalibrationBatches:
    """Calibration texts as token batches: each (input_ids, attention_mask, lengths), right-padded, sequences of
    similar length together; `tokens`: real tokens in all, at most the budget."""

    batches: list
    tokens: int
    texts: int


def token_batches(tokenizer, texts: list[str], max_length: int, token_budget: int | None,
                  most_tokens: int = BATCH_TOKENS) -> CalibrationBatches:
    """Tokenise `texts` (each cut at `max_length` tokens), keep them in order until `token_budget` real tokens
    (the last one cut to fit), and group them into length-sorted batches of at most `most_tokens` padded tokens."""
    encoded = tokenizer(texts, truncation=True, max_length=max_length, padding=False)["input_ids"]
    kept, tokens = [], 0
    for ids in encoded:
        if token_budget is not None and tokens + len(ids) > token_budget:
            ids = ids[: token_budget - tokens]
        if len(ids) < 1:
            break
        kept.append(ids)
        tokens += len(ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(kept)), key=lambda i: len(kept[i]))
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        # sorted ascending: the last sequence of a batch is its longest, so padded size = count x its length
        while (end < len(order) and end - start < BATCH_SEQUENCES
               and (end + 1 - start) * len(kept[order[end]]) <= most_tokens):
            end += 1
        chosen = [kept[i] for i in order[start:end]]
        batches.append((*right_padded(chosen, pad), [len(ids) for ids in chosen]))
        start = end
    return CalibrationBatches(batches, tokens, len(kept))


def right_padded(sequences: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token id lists, padded on the right to the longest."""
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


class _SeenEverything(Exception):
    """Raised by the last hook of a forward pass: what runs after it is never observed."""


class _CurrentBatch:
    """The real length of each sequence in the batch running now, for hooks to cut the padding off; and how
    many observations a forward pass makes, so later passes stop at the last one (the layers after the last
    attention input, e.g. the last feed-forward block, need not run)."""

    def __init__(self):
        self.lengths: list[int] = []
        self.observed = 0
        self.observations: int | None = None  # per forward pass, counted on the first

    def sequences(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """(batch, n, ...) right-padded -> each sequence's real rows."""
        return [hidden[row, :length] for row, length in enumerate(self.lengths)]

    def observed_one(self) -> None:
        self.observed += 1
        if self.observed == self.observations:
            raise _SeenEverything

    def forward(self, model, inputs: dict, lengths: list[int]) -> None:
        self.lengths, self.observed = lengths, 0
        try:
            model(**inputs)
        except _SeenEverything:
            return
        if self.observations is None:
            self.observations = self.observed


@dataclass
class _Moments:
    """Running sums of one layer's inputs. Rows are shifted by the first batch's mean before they are summed,
    which leaves the covariance unchanged and keeps E[xx^T] - mu mu^T from cancelling away its small
    directions; each batch's product runs in float32 (one GEMM), the sums are kept in float64."""

    keep: int = 0  # raw sequences to keep for refinement
    scaling: float | None = None
    position_bias: torch.Tensor | None = None
    query_shift: torch.Tensor | None = None
    query_sum: torch.Tensor | None = None
    query_outer: torch.Tensor | None = None
    query_count: int = 0
    key_outer: torch.Tensor | None = None
    key_count: int = 0
    query_samples: list = field(default_factory=list)
    key_samples: list = field(default_factory=list)
    _last_query: list | None = None  # the inputs the query side saw last, to share them with the key side

    def add_query(self, sequences: list[torch.Tensor]) -> None:
        self._last_query = sequences
        for x in sequences[: max(self.keep - len(self.query_samples), 0)]:
            self.query_samples.append(host_copy(x, torch.float16))
        rows = torch.cat(sequences).float()
        if self.query_shift is None:  # the sums live where the inputs do: one copy to the host, at the end
            self.query_shift = rows.mean(0)
            self.query_sum = rows.new_zeros(rows.shape[1], dtype=torch.float64)
            self.query_outer = rows.new_zeros(rows.shape[1], rows.shape[1], dtype=torch.float64)
        rows = rows - self.query_shift
        self.query_sum += rows.sum(0).double()
        self.query_outer += (rows.T @ rows).double()
        self.query_count += rows.shape[0]

    def add_key(self, sequences: list[torch.Tensor]) -> None:
        same = self._last_query is not None and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in zip(sequences, self._last_query))
        for index, y in enumerate(sequences[: max(self.keep - len(self.key_samples), 0)]):
            # self-attention: the key side saw the very tensor the query side did; keep it once
            self.key_samples.append(self.query_samples[len(self.key_samples)] if same and index < len(
                self.query_samples) else host_copy(y, torch.float16))
        # each sequence centred on its own mean: a shift shared by every key of a sequence is lost in softmax
        centred = torch.cat([y.float() - y.float().mean(0, keepdim=True) for y in sequences])
        outer = (centred.T @ centred).double()
        self.key_outer = outer if self.key_outer is None else self.key_outer + outer
        self.key_count += sum(max(y.shape[0] - 1, 0) for y in sequences)

    def result(self) -> LayerCalibration:
        mean = self.query_sum / self.query_count
        query_cov = (self.query_outer / self.query_count - torch.outer(mean, mean)).to(HOST)
        key_cov = (self.key_outer / max(self.key_count, 1)).to(HOST)
        key_metric = InputMetric(key_cov, torch.zeros(key_cov.shape[0], dtype=key_cov.dtype))
        return LayerCalibration(InputMetric(query_cov, (mean + self.query_shift.double()).to(HOST)), key_metric,
                                self.query_samples, self.key_samples, self.scaling, self.position_bias)

    def add_position_bias(self, bias: torch.Tensor) -> None:
        if self.position_bias is None or bias.shape[-1] > self.position_bias.shape[-1]:
            self.position_bias = host_copy(bias[0], torch.float32)


def _tokenizer(folder: Path):
    from .loading import load_tokenizer

    return load_tokenizer(folder, "calibration")


def _within_positions(folder: Path, max_length: int) -> int:
    from ..architectures.families import within_positions
    from ..io.folders import read_config

    return within_positions(read_config(folder), max_length)


def collect_statistics(
    folder: Path,
    family,
    prefixes: list[str],
    texts: list[str],
    max_length: int = 128,
    progress=None,
    keep_samples: int = 0,
    token_budget: int | None = None,
    scratch: Path | None = None,
    width: int | None = None,
    device: Device = HOST,
) -> tuple[Mapping[str, LayerCalibration], CalibrationBatches]:
    """Run the original model on `texts` (at most `token_budget` tokens); return input statistics (and up to
    `keep_samples` raw sequences) for each attention prefix, and the batches that ran.

    With a `scratch` folder, a model that is one stack of blocks runs a block at a time (layerwise.py) and each
    layer's statistics wait in `scratch` until asked for: memory holds one block and one layer's statistics.
    Otherwise the whole model runs, with every layer's statistics in memory. `width`: the hidden size, to size
    batches by (batch_tokens). The model runs on `device`; the statistics come back in host memory."""
    from .layerwise import plan_blocks

    batches = token_batches(_tokenizer(folder), texts, _within_positions(folder, max_length), token_budget,
                            batch_tokens(width))
    plan = plan_blocks(folder, prefixes) if scratch is not None else None
    if plan is not None:
        current = _CurrentBatch()

        def observe(model, prefix: str):
            moments = {prefix: _Moments(keep=keep_samples)}

            def finished() -> LayerCalibration:
                if moments[prefix].query_count == 0 or moments[prefix].key_outer is None:
                    raise BadInputError(f"calibration never reached {prefix}")
                return moments[prefix].result()

            return _attach_hooks(model, family, moments, current), finished

        return _by_block(folder, plan, batches, current, observe, progress, scratch, device), batches
    model = _whole_model(folder, device)
    moments = {p: _Moments(keep=keep_samples) for p in prefixes}
    current = _CurrentBatch()
    handles = _attach_hooks(model, family, moments, current)
    try:
        _run(model, batches, current, progress, device)
    finally:
        for handle in handles:
            handle.remove()
    missing = [p for p, m in moments.items() if m.query_count == 0 or m.key_outer is None]
    if missing:
        raise BadInputError(f"calibration never reached {missing[0]}")
    return {p: m.result() for p, m in moments.items()}, batches


def _whole_model(folder: Path, device):
    """The model in `folder`, loaded whole for measuring, on `device`."""
    from transformers import AutoModel

    from .loading import for_measuring

    return for_measuring(AutoModel.from_pretrained(folder)).to(device)


def _by_block(folder: Path, plan, batches: CalibrationBatches, current: _CurrentBatch, observe, progress,
              scratch: Path, device) -> SpillFolder:
    """Each layer's record from a block-at-a-time run (layerwise.BlockRunner), kept in `scratch`.
    `observe(model, prefix)` hooks that layer and returns (hook handles, a function giving its record once every
    batch has run through its block)."""
    from .layerwise import BlockRunner

    blocks, device_map = plan
    runner = BlockRunner(folder, blocks, device_map, scratch / "activations", device)
    found = SpillFolder(scratch / "statistics")
    for input_ids, attention_mask, _ in batches.batches:
        runner.start({"input_ids": input_ids, "attention_mask": attention_mask})
    label, steps = f"calibrating{DETAIL}{batches.tokens} tokens", len(blocks) * len(batches.batches)
    for index, (_, prefix) in enumerate(blocks):
        handles, finished = observe(runner.model, prefix)
        last = index + 1 == len(blocks)
        current.observations = None
        try:
            for batch, (_, _, lengths) in enumerate(batches.batches):
                if progress:
                    progress(f"{label}, layer {index + 1}/{len(blocks)}", index * len(batches.batches) + batch, steps)
                current.lengths, current.observed = lengths, 0
                try:
                    runner.run_block(index, batch, keep_output=not last)
                except _SeenEverything:
                    continue
                if last:
                    # the last block's output feeds nothing: once a whole run has counted its observations,
                    # the other batches stop at the last one (its feed-forward and output never run)
                    current.observations = current.observed
        finally:
            current.observations = None
            for handle in handles:
                handle.remove()
        found[prefix] = finished()
    if progress:
        progress(f"{label}, layer {len(blocks)}/{len(blocks)}", steps, steps)
    return found


def _attach_hooks(model, family, moments: dict[str, _Moments], current: _CurrentBatch) -> list:
    """Forward pre-hooks where the family's layout says the query- and key-side inputs pass."""
    base = getattr(model, "base_model_prefix", None)
    wanted = {strip_prefix(p, base): p for p in moments}
    handles = []
    for name, module in model.named_modules():
        prefix = wanted.get(strip_prefix(name, base))
        if prefix is None:
            continue
        scaling = getattr(module, "scaling", None)
        moments[prefix].scaling = float(scaling) if isinstance(scaling, (int, float)) else None
        adders = {"query": moments[prefix].add_query, "key": moments[prefix].add_key}
        for point, sides in family.layout.hook_points(module):
            handles.append(point.register_forward_pre_hook(_hook(current, *(adders[side] for side in sides))))
        if moments[prefix].keep and family.position_bias is not None:
            hook = _position_bias_hook(module, family.position_bias, moments[prefix])
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    if not handles:
        raise BadInputError("no attention module of the model could be observed for calibration")
    return handles


@torch.no_grad()
def _run(model, batches: CalibrationBatches, current: _CurrentBatch, progress, device) -> None:
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    done = 0
    for input_ids, attention_mask, lengths in batches.batches:
        if progress:
            progress(f"calibrating{DETAIL}{batches.tokens} tokens", done, batches.texts)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if encoder_decoder:
            inputs.update(decoder_input_ids=input_ids, decoder_attention_mask=attention_mask)
        current.forward(model, moved(inputs, device), lengths)
        done += len(lengths)
    if progress:
        progress(f"calibrating{DETAIL}{batches.tokens} tokens", done, batches.texts)


def _position_bias_hook(module, read_bias, moments: _Moments):
    """The relative position bias the module adds to its scores (family.position_bias reads it from the
    module's arguments), for refinement to add as the module does."""
    signature = inspect.signature(module.forward)

    def hook(module, args, kwargs):
        bias = _position_bias(module, read_bias, signature, args, kwargs)
        if bias is not None:
            moments.add_position_bias(bias)

    return hook


def _position_bias(module, read_bias, signature: inspect.Signature, args, kwargs) -> torch.Tensor | None:
    """The bias `read_bias` (a family's position_bias) finds in one call's arguments: (1 or b, N_h, n, m), or None."""
    bias = read_bias(module, signature.bind_partial(*args, **kwargs).arguments)
    return bias if isinstance(bias, torch.Tensor) else None


def _hook(current: _CurrentBatch, *adders):
    def hook(module, args):
        sequences = current.sequences(args[0].detach())
        for add in adders:
            add(sequences)
        current.observed_one()

    return hook


@dataclass
class SharedKeyCalibration:
    """One rotary layer on calibration text: its statistics, and for refinement a few raw sequences and how
    the layer turns scores into attention."""

    statistics: object  # decompose.shared_key.KeyStatistics, means per token
    samples: list  # decompose.shared_key_refinement.SharedKeySample, float16 to halve their memory
    setting: object | None  # decompose.shared_key_refinement.AttentionSetting


class SharedKeyObserver:
    """Forward pre-hooks on rotary attention modules that compute the module's own queries, keys (and values)
    from the hidden states it receives and add them to that layer's record."""

    def __init__(self, family, layers: dict, keep_samples: int, current: _CurrentBatch):
        self.family, self.layers, self.keep, self.current = family, layers, keep_samples, current
        self.found = {prefix: SharedKeyCalibration(None, [], None) for prefix in layers}
        self.tokens = dict.fromkeys(layers, 0)

    def hook(self, prefix: str):
        from ..decompose.shared_key import statistics_of
        from ..decompose.shared_key_refinement import AttentionSetting, SharedKeySample

        geometry, heads, causal = self.layers[prefix]
        record, layout, current = self.found[prefix], self.family.layout, self.current

        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            source = kwargs.get("key_value_states")  # encoder-decoder attention: keys and values from the encoder
            source = hidden if source is None else source
            queries, keys = layout.original_queries_keys(module, hidden, heads, source)
            values = layout.original_values(module, source, heads) if self.keep else queries
            real = zip(current.sequences(queries), current.sequences(keys), current.sequences(values), strict=True)
            for query, key, value in real:  # each cut to its real tokens: no padding counted
                more = statistics_of(query.float(), key.float(), geometry)
                record.statistics = more if record.statistics is None else record.statistics + more
                self.tokens[prefix] += query.shape[0]
                if len(record.samples) < self.keep:
                    record.samples.append(SharedKeySample(*(host_copy(t, torch.float16) for t in (query, key, value))))
            cos, sin = rotary_tables(kwargs, hidden)
            if record.setting is None or record.setting.cos.shape[0] < cos.shape[1]:
                output = layout.output_weight(module)
                record.setting = AttentionSetting(float(module.scaling), host_copy(cos[0], torch.float32),
                                                  host_copy(sin[0], torch.float32),
                                                  getattr(module, "attn_logit_softcapping", None),
                                                  host_copy(output, torch.float32), causal,
                                                  self._position_bias(module, args, kwargs))
            current.observed_one()

        return hook

    def _position_bias(self, module, args, kwargs) -> torch.Tensor | None:
        """The relative position bias the module adds to its scores (T5's), (N_h, n, m), for refinement."""
        if self.family.position_bias is None:
            return None
        bias = _position_bias(module, self.family.position_bias, inspect.signature(module.forward), args, kwargs)
        return None if bias is None else host_copy(bias[0], torch.float32)

    def finished(self, prefix: str) -> SharedKeyCalibration:
        """The layer's record, statistics as means per token in host memory; forgotten here."""
        record = self.found.pop(prefix)
        record.statistics = record.statistics.scaled(1 / self.tokens[prefix]).to(HOST)
        return record


def rotary_tables(kwargs: dict, hidden: torch.Tensor):
    """RoPE's cos/sin tables as the module receives them; empty ones (no rotated dimension) for a decoder with
    absolute positions, whose shared key is all pass-through."""
    tables = kwargs.get("position_embeddings")
    if tables is not None:
        return tables
    empty = hidden.new_ones(1, hidden.shape[1], 0)
    return empty, empty


def collect_shared_key_statistics(folder: Path, family, layers: dict, texts: list[str], max_length: int = 128,
                              progress=None, keep_samples: int = 0, token_budget: int | None = None,
                              scratch: Path | None = None, width: int | None = None,
                              device: Device = HOST):
    """Query energy and key second moments of every rotary layer on real text (decompose/shared_key.py), as means
    per token, and up to `keep_samples` raw sequences per layer. `layers` maps a prefix to (geometry, head
    counts, causal). The queries and keys are the module's own, after any QK-norm and before RoPE, computed from the
    hidden states it receives; RoPE tables, scale and soft-capping are read from the same call. Returns the
    records by prefix and the batches that ran. With a `scratch` folder the model runs a block at a time and
    the records wait there, as collect_statistics does. The model runs on `device`; the records come back in host
    memory."""
    from .layerwise import plan_blocks

    batches = token_batches(_tokenizer(folder), texts, _within_positions(folder, max_length), token_budget,
                            batch_tokens(width))
    current = _CurrentBatch()
    observer = SharedKeyObserver(family, layers, keep_samples, current)
    plan = plan_blocks(folder, list(layers)) if scratch is not None else None
    if plan is not None:

        def observe(model, prefix: str):
            module = _modules_of(model, [prefix])[prefix]
            return [module.register_forward_pre_hook(observer.hook(prefix), with_kwargs=True)], (
                lambda: observer.finished(prefix))

        return _by_block(folder, plan, batches, current, observe, progress, scratch, device), batches
    model = _whole_model(folder, device)
    handles = [module.register_forward_pre_hook(observer.hook(prefix), with_kwargs=True)
               for prefix, module in _modules_of(model, layers).items()]
    try:
        _run(model, batches, current, progress, device)
    finally:
        for handle in handles:
            handle.remove()
    return {prefix: observer.finished(prefix) for prefix in layers}, batches


def _modules_of(model, prefixes) -> dict:
    """The model's module for each attention prefix (names compared without the base-model prefix)."""
    base = getattr(model, "base_model_prefix", None)
    wanted = {strip_prefix(p, base): p for p in prefixes}
    modules = {wanted[strip_prefix(name, base)]: module for name, module in model.named_modules()
               if strip_prefix(name, base) in wanted}
    if len(modules) != len(wanted):
        raise BadInputError("not every attention module of the model could be observed for calibration")
    return modules
