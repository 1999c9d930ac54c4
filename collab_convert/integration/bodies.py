"""A language model's body (its base model, without the head): what it returns for a batch, from a forward pass
stopped there, and the same on several batches with its blocks run one at a time."""

from __future__ import annotations

import contextlib

import torch

from ..cpu import BoundedHeap, reused_heap
from .layerwise import block_stack, first_block_inputs, weights_held
from .model_runs import FREE_HEAP_BOUND


class _BodyOutput(Exception):
    """Raised by a hook on a language model's body, carrying what it returned: the head need not run."""

    def __init__(self, output):
        super().__init__("caught the body's output")
        self.output = output


def _catch_output(module, args, output):
    raise _BodyOutput(output)


def body_output(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """What a ...ForCausalLM's body (its base model) returns, its final hidden states first, from a forward pass
    stopped there."""
    handle = getattr(model, model.base_model_prefix).register_forward_hook(_catch_output)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    except _BodyOutput as caught:
        return caught.output
    finally:
        handle.remove()
    raise RuntimeError("the model's forward pass never ran its body")


def block_names(model, prefixes: list[str] | None) -> list[str] | None:
    """The names, within the model's body, of its stack of blocks holding the attention layers `prefixes`; None
    where there is none (or no prefixes given)."""
    if not prefixes:
        return None
    stack = block_stack(getattr(model, model.base_model_prefix), prefixes)
    return [name for name, _ in stack] if stack else None


@torch.no_grad()
def bodies_by_block(model, batches: list, stack: list[str], step) -> list:
    """The body's output on each batch, its blocks run one at a time over every batch: each block's weights load
    once (an offloaded pass reloads every block for each batch) and its batches share one bounded heap, as in
    calibration (model_runs._by_block). The body's own forward then runs with its blocks standing in (_Passed),
    so whatever it does around them (the final norm) is its code."""
    body = getattr(model, model.base_model_prefix)
    blocks = [body.get_submodule(name) for name in stack]
    running = [list(first_block_inputs(model, blocks[0], {"input_ids": ids, "attention_mask": mask}))
               for ids, mask in batches]
    as_tuple = False
    for block in blocks:
        with reused_heap(), weights_held(block):
            heap = BoundedHeap(FREE_HEAP_BOUND)
            for inputs in running:
                output = block(inputs[0], *inputs[1], **inputs[2])
                as_tuple = isinstance(output, (tuple, list))
                inputs[0] = output[0] if as_tuple else output
                heap.check()
        step()
    return finished_bodies(model, batches, stack, [states for states, _, _ in running], as_tuple)


@torch.no_grad()
def finished_bodies(model, batches: list, stack: list[str], states: list, as_tuple: bool) -> list:
    """The body's output on each batch whose stack of blocks gave `states` (returned as tuples where `as_tuple`):
    its own forward, the blocks standing in, runs what comes after them. The states may come from another run of
    the same blocks (the calibration pass's, model_runs.KeptStates)."""
    body = getattr(model, model.base_model_prefix)
    outputs = []
    for (input_ids, attention_mask), final in zip(batches, states, strict=True):
        with standing_in(body, stack, final, as_tuple):
            outputs.append(body_output(model, input_ids, attention_mask))
    return outputs


class _Passed(torch.nn.Module):
    """Stands in for a block that has already run: the first hands on the stack's final states, the others what
    they receive, each as the block returns its output (a tensor, or a tuple of them)."""

    def __init__(self, states: torch.Tensor | None, as_tuple: bool):
        super().__init__()
        self.states, self.as_tuple = states, as_tuple

    def forward(self, hidden, *args, **kwargs):
        output = hidden if self.states is None else self.states
        return (output,) if self.as_tuple else output


@contextlib.contextmanager
def standing_in(body, stack: list[str], states: torch.Tensor, as_tuple: bool):
    """Within: the body's blocks replaced by _Passed, the first handing on `states`."""
    places = [name.rpartition(".") for name in stack]
    parents = [body.get_submodule(parent) if parent else body for parent, _, _ in places]
    originals = [getattr(parent, child) for parent, (_, _, child) in zip(parents, places)]
    try:
        for index, (parent, (_, _, child)) in enumerate(zip(parents, places)):
            setattr(parent, child, _Passed(states if index == 0 else None, as_tuple))
        yield
    finally:
        for parent, (_, _, child), original in zip(parents, places, originals):
            setattr(parent, child, original)
