"""The original model run one block at a time, so calibration holds one block's weights and one batch of
activations, whatever the model's size.

The model is loaded through transformers' big-model path with every block offloaded to disk: accelerate's hooks
read a block's weights from the checkpoint itself (memory-mapped safetensors, converted to float32) when it
runs and drop them after. A forward pass per batch stops at the first block, where a hook catches that block's
inputs (hidden states, masks, position tables: whatever the model hands its blocks). Then block k runs on every
batch's hidden states, its attention inputs are observed on the way, and its outputs replace its inputs on disk
for block k+1. Each block runs once per batch, as in one forward pass of the whole model.

This needs a model that is one stack of blocks, each holding one of the attention layers and run once per
forward pass. Others (shared layers like ALBERT's, encoder-decoder stacks) are observed in whole forward passes
instead (capture.py).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from ..devices import HOST, Device, floating_dtype, in_pass_dtype, moved
from ..modeling.collaborative import strip_prefix
from .heads import float32_in_slices
from .loading import for_measuring


def block_stack(skeleton: nn.Module, prefixes: list[str]) -> list[tuple[str, str]] | None:
    """[(block module name, attention prefix)] in run order, where one ModuleList of `skeleton` (a model built
    without weights) has one block per attention layer, each holding exactly one; None where the model is not
    laid out so."""
    config = getattr(skeleton, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return None
    if len(set(getattr(config, "layer_types", None) or [])) > 1:
        return None  # blocks get different masks (Gemma's sliding and full layers): the first block's won't do
    base = getattr(skeleton, "base_model_prefix", None)
    by_name = {strip_prefix(p, base): p for p in prefixes}
    depth = getattr(config, "num_hidden_layers", None)
    for list_name, blocks in skeleton.named_modules():
        if not isinstance(blocks, nn.ModuleList) or len(blocks) != len(prefixes):
            continue
        stack = []
        for index in range(len(blocks)):
            block = f"{list_name}.{index}" if list_name else str(index)
            inside = [p for name, p in by_name.items() if name == block or name.startswith(block + ".")]
            if len(inside) != 1:
                break
            stack.append((block, inside[0]))
        # a block applied more than once per pass (shared layers) shows as fewer blocks than the config's depth
        if len(stack) == len(prefixes) and (not isinstance(depth, int) or depth == len(stack)):
            return stack
    return None


def offload_map(skeleton: nn.Module, blocks: list[str]) -> dict[str, str]:
    """A device map putting every block, and every module outside the blocks, on "disk": each gets its own
    accelerate hook, so only the module running has its weights in memory."""
    mapping: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, _ in module.named_parameters(recurse=False):
            mapping[f"{prefix}{name}"] = "disk"
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full in blocks or not any(block.startswith(full + ".") for block in blocks):
                mapping[full] = "disk"
            else:
                visit(full + ".", child)

    visit("", skeleton)
    return mapping


class _BlockInputs(Exception):
    """Raised by the hook on the first block, carrying what the model passed it."""

    def __init__(self, hidden: torch.Tensor, args: tuple, kwargs: dict):
        super().__init__("caught the first block's inputs")
        self.hidden, self.args, self.kwargs = hidden, args, kwargs


def _float32(value):
    """Floating tensors (in tuples, lists, dicts too) as float32: the modules before the first block run in the
    checkpoint's dtype; what the first block receives is kept in float32 and cast to the blocks' dtype as they
    run."""
    return moved(value, dtype=torch.float32)


def _catch(module, args, kwargs):
    if "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, args = args[0], args[1:]
    raise _BlockInputs(_float32(hidden), _float32(args), _float32(kwargs))


@torch.no_grad()
def first_block_inputs(model: nn.Module, first_block: nn.Module, inputs: dict) -> tuple[torch.Tensor, tuple, dict]:
    """(hidden states, other positional arguments, keyword arguments) that `model`'s forward pass on `inputs`
    hands `first_block`, floating tensors in float32; the pass stops there."""
    handle = first_block.register_forward_pre_hook(_catch, with_kwargs=True)
    try:
        model(**inputs)
    except _BlockInputs as caught:
        return caught.hidden, caught.args, caught.kwargs
    finally:
        handle.remove()
    raise RuntimeError("the model's forward pass never reached its first block")


@contextlib.contextmanager
def weights_held(block: nn.Module):
    """Within: an offloaded block keeps its weights loaded across calls. accelerate's hook otherwise reads and
    converts them at every call and drops them after: once per batch."""
    hook = getattr(block, "_hf_hook", None)
    if not getattr(hook, "offload", False):
        yield
        return
    hook.pre_forward(block)  # loads the weights (and places no inputs: there are none)
    hook.offload = False
    try:
        yield
    finally:
        hook.offload = True
        hook.post_forward(block, None)  # drops them


# Activations between blocks stay in host memory up to this share of the checkpoint's bytes, less the working set of
# the block that runs (held_bytes); the rest wait on disk. Saving and loading every batch at every block took 7% of
# SmolLM2's blocks (34.4 s against 32.1 s); its 38,400 calibration tokens hold 45 MB against a 257 MB checkpoint.
HELD_SHARE = 0.25
# A block's working set, in multiples of its weights in the pass's precision: the weights, its batch's feed-forward
# activations and the statistics' float64 sums (a GPT-2-medium block run in float32 at 512 tokens a batch: 50, 25
# and 17 MB).
BLOCK_WORKING_SET = 2


def held_bytes(checkpoint_bytes: int, block_bytes: int) -> int:
    """How many bytes of activations may wait in host memory between blocks, for a checkpoint whose largest block
    holds `block_bytes` of weights in the pass's precision: what HELD_SHARE leaves beside that block's working set.
    With HELD_SHARE alone, a 12-layer GPT-2-medium-shaped checkpoint run in float32 (a CPU without bfloat16
    products) held its 34 MB of activations and its calibrating stage peaked at 180-204 MB above the imports
    against the memory bound's 203 MB; with them on disk, 123-165 MB. SmolLM2 keeps some in memory: all of them
    on disk cost its calibrating stage 5-9% (2 cores with AVX2 only)."""
    return max(0, int(HELD_SHARE * checkpoint_bytes) - BLOCK_WORKING_SET * block_bytes)


class BlockRunner:
    """The model's blocks, run one at a time on `device` over batches whose activations wait between blocks in
    host memory, up to held_bytes, or on disk under `scratch` (io.spill.HeldOrSpilled)."""

    def __init__(self, folder: Path, skeleton_blocks: list[tuple[str, str]], mapping: dict[str, str],
                 scratch: Path, device: Device = HOST):
        from transformers import AutoModel

        from ..io.folders import weight_bytes
        from ..io.spill import HeldOrSpilled

        self.scratch, self.device = scratch, torch.device(device)
        scratch.mkdir(parents=True, exist_ok=True)
        # the statistics come from the model as transformers runs it by default: in the checkpoint's dtype where
        # the device multiplies it natively (half the time of float32 for bfloat16 on AVX512-BF16)
        self.model = _offloaded(AutoModel, folder, mapping, [name for name, _ in skeleton_blocks], scratch / "offload",
                                self.device, native=True)
        modules = dict(self.model.named_modules())
        self.blocks = [(modules[name], prefix) for name, prefix in skeleton_blocks]
        # every block casts its floating inputs to this dtype as it starts (_cast_at_boundaries): kept so, they
        # take half the bytes of the float32 first-block inputs in a bfloat16 pass, and the blocks see the same
        self.dtype = floating_dtype(self.blocks[0][0])
        self.checkpoint_bytes = weight_bytes(folder)  # what the memory it holds is measured against
        block_bytes = max(sum(p.numel() for p in block.parameters()) for block, _ in self.blocks) * self.dtype.itemsize
        self.activations = HeldOrSpilled(scratch, held_bytes(self.checkpoint_bytes, block_bytes))
        self.batches = 0
        self.returns_tuple = False  # whether the blocks return tuples (their states first), once one has run

    @torch.no_grad()
    def start(self, inputs: dict) -> None:
        """Run the model up to its first block on one batch; keep what the block would have received."""
        hidden, args, kwargs = first_block_inputs(self.model, self.blocks[0][0], moved(inputs, self.device))
        self.activations[f"inputs-{self.batches}"] = moved({"args": args, "kwargs": kwargs}, HOST, self.dtype)
        self.activations[f"hidden-{self.batches}"] = moved(hidden, HOST, self.dtype)
        self.batches += 1

    def weights_held(self, index: int):
        """Within: block `index` keeps its weights loaded across calls (weights_held)."""
        return weights_held(self.blocks[index][0])

    @torch.no_grad()
    def run_block(self, index: int, batch: int, keep_output: bool) -> None:
        """Block `index` on one batch: its attention hooks see the inputs; its output becomes the batch's
        hidden states for the next block."""
        saved = moved(self.activations[f"inputs-{batch}"], self.device)
        hidden = moved(self.activations[f"hidden-{batch}"], self.device)
        output = self.blocks[index][0](hidden, *saved["args"], **saved["kwargs"])
        self.returns_tuple = isinstance(output, (tuple, list))
        if keep_output:
            output = output[0] if self.returns_tuple else output
            self.activations[f"hidden-{batch}"] = output.to(HOST).contiguous()


def load_offloaded(folder: Path, auto_class=None, device: Device = HOST, native: bool = False):
    """The model in `folder` (eval mode), each block (every ModuleList entry) and each module outside the blocks
    offloaded to disk: a forward pass holds one of them in memory at a time, on `device`. Blocks run in float32,
    or with `native` in the checkpoint's dtype where the device multiplies it natively, as in `_offloaded`. For
    measuring fidelity on models too big to hold twice. Collaborative checkpoints load through our quantizer as
    usual."""
    from transformers import AutoModel

    from .loading import register

    register()
    auto_class = auto_class or AutoModel
    skeleton = _skeleton(folder, auto_class)
    containers = [f"{name}.{index}" for name, module in skeleton.named_modules() if isinstance(module, nn.ModuleList)
                  for index in range(len(module))]
    return _offloaded(auto_class, folder, offload_map(skeleton, containers), containers, None, torch.device(device),
                      native)


def blocks_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a loaded model's blocks (its first ModuleList's entries) run in: float32, or the checkpoint's own
    where load_offloaded left it."""
    stack = next((module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)), None)
    return floating_dtype(stack[0] if stack is not None else model)


def _skeleton(folder: Path, auto_class) -> nn.Module:
    """The model in `folder` built on the meta device, to read its layout: nothing is allocated or loaded."""
    from transformers import AutoConfig

    with torch.device("meta"):
        return auto_class.from_config(AutoConfig.from_pretrained(folder))


def _offloaded(auto_class, folder: Path, mapping: dict[str, str], blocks: list[str], offload_folder: Path | None,
               device: torch.device, native: bool = False):
    """Loaded in the checkpoint's own dtype (converting at load would materialise every weight at once), then the
    blocks declared float32 (or, `native`, left in the checkpoint's dtype where the device multiplies it natively:
    devices.pass_dtype): accelerate casts each weight to its parameter's dtype as it loads it for a forward pass.
    The modules outside the blocks keep the checkpoint's dtype (a 50k-word embedding table is 200 MB in float32,
    and a lookup reads a few rows of it); inputs are cast at each boundary. Every module runs on `device`: its
    hook loads its weights there."""
    # accelerate warns that offloaded parameters sit on the meta device: here that is the point
    big_modeling = logging.getLogger("accelerate.big_modeling")
    level = big_modeling.level
    big_modeling.setLevel(logging.ERROR)
    try:
        model = auto_class.from_pretrained(folder, dtype="auto", device_map=mapping,
                                           offload_folder=None if offload_folder is None else str(offload_folder))
    finally:
        big_modeling.setLevel(level)
    _run_on(model, device)
    modules = dict(model.named_modules())
    for block in blocks:
        # meta parameters change dtype for free; buffers and the few loaded ones are small
        if native:
            in_pass_dtype(modules[block], device)
        else:  # nn.Module's own float(): transformers refuses its override on models loaded through our quantizer
            nn.Module.float(modules[block])
        _load_whole_block(modules[block], device)
    _cast_at_boundaries(modules, blocks, [name for name in mapping if name in modules and name not in blocks])
    return for_measuring(model)


def _run_on(model: nn.Module, device: torch.device) -> None:
    """Every accelerate hook of `model` loads its module's weights on `device` and moves its inputs there, and the
    buffers accelerate keeps in memory (position ids, rotary frequencies) move there too, as its hooks put them
    on their execution device when they are attached. A map of nothing but "disk" leaves that device on the
    CPU, and transformers' loader has no word for another."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for one in getattr(hook, "hooks", [hook]):  # accelerate's SequentialHook holds several
            if getattr(one, "execution_device", None) is not None:
                one.execution_device = device
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)


def _cast_at_boundaries(modules: dict[str, nn.Module], blocks: list[str], others: list[str]) -> None:
    """Blocks run in their own dtype (float32, or the checkpoint's where `_offloaded` left it), the modules around
    them (embeddings, final norm, language-model head) in the checkpoint's dtype: each gets its floating inputs
    in its own dtype."""
    for name in blocks:
        dtype = floating_dtype(modules[name])
        modules[name].register_forward_pre_hook(lambda module, args, kwargs, dtype=dtype: (
            moved(args, dtype=dtype), moved(kwargs, dtype=dtype)), with_kwargs=True)
    for name in others:
        module = modules[name]
        dtype = floating_dtype(module)
        if dtype == torch.float32:  # float32 weights, or none
            continue
        if isinstance(module, nn.Linear):  # a language-model head: float32 math, a slice of its weight at a time
            float32_in_slices(module)
        else:
            module.register_forward_pre_hook(lambda module, args, kwargs, dtype=dtype: (
                moved(args, dtype=dtype), moved(kwargs, dtype=dtype)), with_kwargs=True)


def _load_whole_block(block: nn.Module, device: torch.device) -> None:
    """accelerate hooks every submodule that holds weights, loading them as that submodule runs; a collaborative
    attention module reads its submodules' weights directly (one GEMM over shared_key and content_bias). One
    hook on the block loads all of the block's weights as it starts and drops them as it ends instead."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules
    from accelerate.utils import PrefixedDataset

    for name, module in block.named_modules():
        hook = getattr(module, "_hf_hook", None)
        weights = getattr(hook, "weights_map", None)
        if isinstance(weights, PrefixedDataset):
            prefix = weights.prefix[: len(weights.prefix) - len(name) - 1] if name else weights.prefix
            dataset = weights.dataset
            break
    else:
        return  # nothing offloaded here
    remove_hook_from_submodules(block)
    add_hook_to_module(block, AlignDevicesHook(execution_device=device, offload=True,
                                               weights_map=PrefixedDataset(dataset, prefix), place_submodules=True))


def plan_blocks(folder: Path, prefixes: list[str]) -> tuple[list[tuple[str, str]], dict[str, str]] | None:
    """(blocks, device map) for a block-at-a-time run of the model in `folder`, or None where it is not one stack
    of blocks."""
    from transformers import AutoModel

    skeleton = _skeleton(folder, AutoModel)
    blocks = block_stack(skeleton, prefixes)
    if blocks is None:
        return None
    return blocks, offload_map(skeleton, [name for name, _ in blocks])
