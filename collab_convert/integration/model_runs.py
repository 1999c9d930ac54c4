"""The original model run on calibration text with observers on its attention modules: the one driver that every
form's statistics go through (capture.py for the CP form, shared_key_capture.py for the shared-key form).

With a scratch folder, a model that is one stack of blocks runs a block at a time (layerwise.py) and each
layer's record waits in the scratch folder until asked for: memory holds one block and one layer's record.
Otherwise the whole model runs, with every layer's record in memory. The model runs on `device`; the records
come back in host memory.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..cpu import HEAP_TRIM_THRESHOLD, BoundedHeap, release_unreachable, reused_heap
from ..devices import HOST, Device, moved
from ..errors import BadInputError
from ..io.spill import SpillFolder
from ..modeling.collaborative import strip_prefix
from ..progress import DETAIL
from .batches import CalibrationBatches, CurrentBatch, SeenEverything, batch_tokens, token_batches


class Observer(Protocol):
    """What an observer of attention modules gives the driver: hooks on the modules of some layers, and each
    layer's record once every batch has run through it."""

    def attach(self, model, prefixes: list[str]) -> list:
        """Hook handles on the modules of `prefixes` (checkpoint prefixes)."""

    def finished(self, prefix: str):
        """The layer's record, forgotten by the observer; BadInputError if no batch ever reached the layer."""


@dataclass(frozen=True)
class CalibrationRun:
    """How the calibration texts are run: tokens per text and in all, the hidden size batches are sized by, the
    folder records wait in (None: in memory), where the model runs."""

    max_length: int = 128
    token_budget: int | None = None
    width: int | None = None
    scratch: Path | None = None
    device: Device = HOST


@dataclass
class KeptStates:
    """The original's stack of blocks on held-out texts, run by the calibration pass for the fidelity check, which
    then runs only the original's head (and what the body does after its blocks): the stack's output on each of
    the check's batches (batches.probe_batches), in host memory. `states` stays None where the pass ran the whole
    model rather than a block at a time; the check then runs the original itself, as it does without one."""

    texts: list[str]
    max_length: int
    states: Sequence[torch.Tensor] | None = None  # in memory, or on disk until the check (ParkedStates)
    as_tuple: bool = False  # the blocks return tuples, the states first
    stack: list[str] | None = None  # the blocks' names within the body

    def fetch(self) -> None:
        """The states back in memory where they wait on disk (ParkedStates): before their folder goes."""
        if isinstance(self.states, ParkedStates):
            self.states = list(self.states)

    def serve(self, texts: list[str], max_length: int, stack: list[str] | None, batches: int) -> bool:
        """Whether these states are the stack's output on exactly this check's batches."""
        return (self.states is not None and stack is not None and stack == self.stack and texts == self.texts
                and max_length == self.max_length and len(self.states) == batches)


class ParkedStates(Sequence):
    """Kept states waiting in a file (the calibration's scratch folder) from the calibration pass to the fidelity
    check, read whole when iterated: held in memory, they sat under the peak of every stage between (7.5 MB for
    32 texts at GPT-2-medium's width, benchmarks/memory.py)."""

    def __init__(self, states: list[torch.Tensor], path: Path):
        torch.save(states, path)
        self.path, self.count = path, len(states)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        return torch.load(self.path, weights_only=True)[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.load(self.path, weights_only=True))


_KEEPING: ContextVar[KeptStates | None] = ContextVar("collab_kept_states", default=None)


@contextlib.contextmanager
def keeping_states(kept: KeptStates | None):
    """Within: a block-at-a-time calibration pass also runs `kept.texts` through each block, unobserved, after
    its calibration batches, and fills `kept` (None: nothing kept). The original's blocks are loaded there anyway:
    the fidelity check then need not load and run them again."""
    token = _KEEPING.set(kept)
    try:
        yield kept
    finally:
        _KEEPING.reset(token)


def calibration_tokenizer(folder: Path):
    from .loading import load_tokenizer

    return load_tokenizer(folder, "calibration")


def calibration_batches(folder: Path, texts: list[str], run: CalibrationRun) -> CalibrationBatches:
    """The texts as token batches, each cut where the model's position embeddings end."""
    from ..architectures.lookup import within_positions
    from ..format import original_config
    from ..io.folders import read_config

    # a compressed folder (the fidelity check's) positions its tokens as the original model does
    length = within_positions(original_config(read_config(folder)), run.max_length)
    return token_batches(calibration_tokenizer(folder), texts, length, run.token_budget, pass_batch_tokens(folder, run))


def pass_batch_tokens(folder: Path, run: CalibrationRun) -> int:
    """Padded tokens per calibration batch: batches.batch_tokens times pass_share."""
    return max(1, int(batch_tokens(run.width) * pass_share(folder, run.device)))


def pass_share(folder: Path, device, in_pass=None) -> float:
    """The bytes of a number as `folder` stores it over those of a number in a pass on `device` (devices.pass_dtype,
    or `in_pass` where the caller runs another dtype), at most 1: what a batch's tokens are scaled by, so that its
    activations keep the same share of the checkpoint whatever precision the pass runs in. A bfloat16 checkpoint
    run in float32 (a CPU without bfloat16 products) holds its block's weights and every activation at twice the
    bytes: with the tokens of a bfloat16 pass, a 12-layer GPT-2-medium-shaped checkpoint's calibration peaked at
    263 MB above the imports, 64.5% of it; with half of them (calibration and held-out batches alike) at 193 MB,
    47.3%, and the 24-layer one's at 217 MB, 30.5% (300 MB before; 2 cores with AVX2 only)."""
    from ..devices import pass_dtype
    from ..io.folders import stored_float_type
    from ..io.headers import DTYPES_BY_NAME

    stored = DTYPES_BY_NAME[stored_float_type(folder)]
    return min(1.0, stored.itemsize / (in_pass or pass_dtype(device, stored)).itemsize)


def observe_calibration(folder: Path, prefixes: list[str], texts: list[str], observer: Observer,
                        current: CurrentBatch, run: CalibrationRun,
                        progress=None) -> tuple[Mapping, CalibrationBatches]:
    """Run the original model on `texts` with `observer` on the attention modules of `prefixes`; return each
    prefix's record and the batches that ran. `current` is the batch the observer's hooks cut sequences by."""
    from .layerwise import plan_blocks

    batches = calibration_batches(folder, texts, run)
    plan = plan_blocks(folder, prefixes) if run.scratch is not None else None
    if plan is not None:
        records = _by_block(folder, plan, batches, current, observer, progress, run)
    else:
        records = _whole_passes(folder, prefixes, batches, current, observer, progress, run)
    # The model that ran is garbage now, but transformers' and accelerate's modules sit in reference cycles,
    # which only the cycle collector frees, and it may not run for minutes: a GPT-2-medium-shaped block's float32
    # weights (51 MB; 0.9 GB for an 8B Llama's) stayed through every layer's refinement.
    release_unreachable()
    return records, batches


def _whole_passes(folder: Path, prefixes: list[str], batches: CalibrationBatches, current: CurrentBatch,
                  observer: Observer, progress, run: CalibrationRun) -> Mapping:
    """Each layer's record from whole forward passes of the model, loaded whole."""
    model = whole_model(folder, run.device)
    handles = observer.attach(model, prefixes)
    try:
        run_whole(model, batches, current, progress, run.device)
    finally:
        for handle in handles:
            handle.remove()
    return {prefix: observer.finished(prefix) for prefix in prefixes}


def whole_model(folder: Path, device):
    """The model in `folder`, loaded whole for measuring, on `device`: in the checkpoint's dtype, as transformers
    loads it by default, where the device multiplies it natively, else in float32 (devices.pass_dtype), as the
    block-at-a-time pass runs it."""
    from transformers import AutoModel

    from ..devices import in_pass_dtype
    from .loading import for_measuring

    return for_measuring(in_pass_dtype(AutoModel.from_pretrained(folder), device)).to(device)


# Growth a block's heap may reach between batches before its free pages are handed back (cpu.BoundedHeap). On a
# 24-layer GPT-2-medium shape with 100 documents (9 batches a block), a block's peak rose to ~500 MB above the
# baseline unbounded, against ~265 MB mapped and ~240 MB with this bound on glibc's count of free bytes.
FREE_HEAP_BOUND = 64 << 20
# The free top a block's heap keeps between its batches (cpu.reused_heap's `top`): a share of the checkpoint,
# between KEPT_TOP_FLOOR and the bound on growth. At 16 MiB a feed-forward's freed tensors (a Qwen2-0.5B
# shape's: 17.7 MB, in pairs) went back at every batch and were faulted in again (11.6-12.3M page faults calibrating
# it on 300 documents; 6.4-10.3M at this share). 64 MiB for every checkpoint broke the memory bound on a 407 MB
# GPT-2-medium shape (46-54% of it against 41-43%); this share read 40-45% there.
TOP_SHARE = 1 / 16
# SmolLM2 (269 MB in bfloat16, run in float32 on a CPU without bfloat16 products), 300 documents: 3.5-3.8M page
# faults and 96-97 s calibrating at a 16 MiB top (its share of the checkpoint is less), 1.0M and 71 s at 25 MB
KEPT_TOP_FLOOR = 24 << 20


def kept_top(checkpoint_bytes: int) -> int:
    """The free top a block's heap keeps for a checkpoint of this size (TOP_SHARE, KEPT_TOP_FLOOR)."""
    return int(min(FREE_HEAP_BOUND, max(KEPT_TOP_FLOOR, HEAP_TRIM_THRESHOLD, TOP_SHARE * checkpoint_bytes)))


def _by_block(folder: Path, plan, batches: CalibrationBatches, current: CurrentBatch, observer: Observer, progress,
              run: CalibrationRun) -> SpillFolder:
    """Each layer's record from a block-at-a-time run (layerwise.BlockRunner), kept in the scratch folder; the
    held-out texts of keeping_states, where asked, through the same blocks."""
    from .layerwise import BlockRunner

    blocks, device_map = plan
    runner = BlockRunner(folder, blocks, device_map, run.scratch / "activations", run.device)
    found = SpillFolder(run.scratch / "statistics")
    top = kept_top(runner.checkpoint_bytes)
    for input_ids, attention_mask, _ in batches.batches:
        runner.start({"input_ids": input_ids, "attention_mask": attention_mask})
    kept = _KEEPING.get()
    probes = _started_probes(runner, folder, kept) if kept is not None else []
    label, steps = f"calibrating{DETAIL}{batches.tokens} tokens", len(blocks) * len(batches.batches)
    for index, (_, prefix) in enumerate(blocks):
        # One heap and one load of the block's weights for all its batches: each batch's activations were
        # mapped and zeroed afresh (the 1 MiB mmap threshold, cpu.py) and its weights read and converted
        # again (SmolLM2's blocks alone, 100 documents: 24.6-26.4 s on a heap, 28.8-31.5 s mapped). The heap's
        # top is kept too (kept_top): a batch's freed tensors handed back were faulted in again by the next batch
        # (SmolLM2, 300 documents, an older CPU: 42 s calibrating handed back at once, 34 s at a 16 MiB top;
        # docs/benchmarks.md, "Page faults in the calibration pass"). Batches of other lengths leave holes in the
        # heap a little too small for the next, so its free part is bounded, and it is handed back when the block
        # is done.
        with reused_heap(top=top), runner.weights_held(index):
            heap = BoundedHeap(FREE_HEAP_BOUND)
            handles = observer.attach(runner.model, [prefix])
            current.observations = None
            try:
                for batch, (_, _, lengths) in enumerate(batches.batches):
                    if progress:
                        progress(f"{label}, layer {index + 1}/{len(blocks)}", index * len(batches.batches) + batch,
                                 steps)
                    _run_block(runner, index, batch, lengths, current, last=index + 1 == len(blocks))
                    heap.check()
            finally:
                current.observations = None
                for handle in handles:
                    handle.remove()
            for batch in probes:  # unobserved, and through the whole of the last block
                runner.run_block(index, batch, keep_output=True)
                heap.check()
        found[prefix] = observer.finished(prefix)
    if progress:
        progress(f"{label}, layer {len(blocks)}/{len(blocks)}", steps, steps)
    if probes:
        kept.states = ParkedStates([runner.activations[f"hidden-{batch}"] for batch in probes],
                                   run.scratch / "kept-states.pt")
        kept.as_tuple, kept.stack = runner.returns_tuple, [name for name, _ in blocks]
    return found


def _started_probes(runner, folder: Path, kept: KeptStates) -> list[int]:
    """The runner's batch numbers of the kept texts, batched as the fidelity check batches them."""
    from .batches import probe_batches

    config = runner.model.config.get_text_config()
    first = runner.batches
    for input_ids, attention_mask in probe_batches(calibration_tokenizer(folder), kept.texts, kept.max_length,
                                                   config, pass_share(folder, runner.device)).batches:
        runner.start({"input_ids": input_ids, "attention_mask": attention_mask})
    return list(range(first, runner.batches))


def _run_block(runner, index: int, batch: int, lengths: list[int], current: CurrentBatch, last: bool) -> None:
    current.lengths, current.observed = lengths, 0
    try:
        runner.run_block(index, batch, keep_output=not last)
    except SeenEverything:
        return
    if last:
        # the last block's output feeds nothing: once a whole run has counted its observations, the other
        # batches stop at the last one (its feed-forward and output never run)
        current.observations = current.observed


@torch.no_grad()
def run_whole(model, batches: CalibrationBatches, current: CurrentBatch, progress, device) -> None:
    """Every batch through the whole model (an encoder-decoder's decoder reads the same tokens)."""
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


def modules_of(model, prefixes) -> dict:
    """The model's module for each attention prefix (names compared without the base-model prefix)."""
    base = getattr(model, "base_model_prefix", None)
    wanted = {strip_prefix(p, base): p for p in prefixes}
    modules = {wanted[strip_prefix(name, base)]: module for name, module in model.named_modules()
               if strip_prefix(name, base) in wanted}
    if len(modules) != len(wanted):
        raise BadInputError("not every attention module of the model could be observed for calibration")
    return modules


def position_bias_of(module, read_bias, signature: inspect.Signature, args, kwargs) -> torch.Tensor | None:
    """The bias `read_bias` (a family's position_bias) finds in one call's arguments: (1 or b, N_h, n, m), or None."""
    bias = read_bias(module, signature.bind_partial(*args, **kwargs).arguments)
    return bias if isinstance(bias, torch.Tensor) else None
