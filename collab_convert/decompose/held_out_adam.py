"""Adam with a held-out check: the loop every refinement runs (pure torch).

Each step is Adam on a minibatch's loss; every few steps the average of the steps' parameters is scored on
held-out data, and the best state seen (the start included) is what comes back, so a refinement is never worse
on the held-out data than where it started.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..cpu import HEAP_TRIM_THRESHOLD, reused_heap

AVERAGING = 0.97  # the weight of the average's past at each step (Polyak averaging over about 30 steps)


class _Average:
    """The exponentially weighted average of a run's parameters after each step, without the start's weight
    (started at zero and divided by the weights' sum, as Adam's moments are)."""

    def __init__(self, parameters: list[torch.Tensor], decay: float):
        self.parameters, self.decay, self.steps = parameters, decay, 0
        self.sums = [torch.zeros_like(p, requires_grad=False) for p in parameters] if decay else []

    @torch.no_grad()
    def add(self) -> None:
        self.steps += 1
        if self.sums:
            torch._foreach_lerp_(self.sums, [p.detach() for p in self.parameters], 1 - self.decay)

    @contextlib.contextmanager
    def in_place(self):
        """Within: the parameters hold the average; after: the last step's again."""
        if not self.sums or not self.steps:
            yield
            return
        last = [p.detach().clone() for p in self.parameters]
        with torch.no_grad():  # divided where it lands: no third copy of the parameters
            for parameter, total in zip(self.parameters, self.sums, strict=True):
                parameter.copy_(total).div_(1 - self.decay**self.steps)
        try:
            yield
        finally:
            with torch.no_grad():
                for parameter, kept in zip(self.parameters, last, strict=True):
                    parameter.copy_(kept)


def starting_leaves(tensors, device, consume: bool) -> list[torch.Tensor]:
    """What Adam steps: each tensor in float32 on `device`, a leaf that wants gradients. `consume`: a tensor already
    float32 there is the leaf itself (changed in place by the steps), not a copy, so that its caller's other copy
    need not be held beside it."""
    return [(t.to(device, torch.float32) if consume else t.to(device, torch.float32).clone()).detach()
            .requires_grad_(True) for t in tensors]


def held_out_count(sequences: int) -> int:
    """How many of the last calibration sequences a refinement holds out to judge itself by: a tenth, when there
    are at least ten (else none: it is judged on what it trains on)."""
    return max(sequences // 10, 1) if sequences >= 10 else 0


@dataclass
class _Progress:
    best: list
    initial: float
    best_loss: float
    stale: int = 0
    taken: int = 0  # the steps taken when it stopped (out of patience), or all of them


def adam_with_held_out(parameters: list[torch.Tensor], minibatch_loss, held_out_loss, steps: int,
                       learning_rate: float, check_every: int = 20, patience: int = 5, on_check=None,
                       averaging: float = AVERAGING, warmup: int = 0):
    """Adam on `minibatch_loss()`, checked on `held_out_loss()` every `check_every` steps: stops after
    `patience` checks without a gain and returns (the best parameters seen, the start's held-out loss, the best,
    steps taken). The start counts as a candidate, so the result is never worse on the held-out data.

    Adam steps are scale-free per parameter: each tensor moves by `learning_rate` times its typical entry. What
    is checked (and kept) is the average of the steps' parameters, exponentially weighted by `averaging` (0: the
    last step's): minibatches pull the parameters around the minimum, and their average sits nearer it (Polyak
    averaging; measured on MiniLM's and SmolLM2's layers, the average after 60-80% of the steps was at or below
    the last step's held-out loss after all of them). `warmup`: the learning rate rises linearly over the first
    steps (Adam's first steps move every entry by about the full rate, whatever its gradient's size)."""
    reported = None if on_check is None else (lambda taken, losses: on_check(taken, losses[0]))
    (result,) = adam_with_held_out_groups([parameters], minibatch_loss, lambda which: [held_out_loss()], steps,
                                          learning_rate, check_every, patience, averaging, warmup, reported)
    return result


def adam_with_held_out_groups(groups: list[list[torch.Tensor]], minibatch_loss, held_out_losses, steps: int,
                              learning_rate: float, check_every: int = 20, patience: int = 5,
                              averaging: float = AVERAGING, warmup: int = 0, on_check=None,
                              typical: list[list[float]] | None = None) -> list[tuple]:
    """adam_with_held_out for several independent groups of parameters (layers) whose losses are summed in
    `minibatch_loss()`, so that one backward pass serves them all: `held_out_losses(indices)` gives the held-out
    loss of each group named; each group keeps its own best and stops being checked after `patience` checks
    without a gain, and the steps stop when every group has. One (best, start's loss, best loss, steps taken) per
    group. `on_check(step, losses)`: the held-out losses of the groups checked. `typical`: each tensor's typical
    entry, where its mean size says otherwise (a layer's tensors padded with zeros to another's shape)."""
    parameters = [p for group in groups for p in group]
    sizes = [size for group in typical for size in group] if typical else [
        float(p.detach().abs().mean().clamp_min(1e-8)) for p in parameters]
    # fused: one kernel per step for all the tensors, where torch has one (CPU and CUDA); on SmolLM2's shared-key
    # layers Adam's own step was a tenth of a refinement step
    fused = all(p.device.type in ("cpu", "cuda") for p in parameters)
    optimizer = torch.optim.Adam(
        [{"params": [p], "lr": learning_rate * size} for p, size in zip(parameters, sizes, strict=True)],
        fused=fused or None,
    )
    initial = held_out_losses(list(range(len(groups))))
    states = [_Progress([p.detach().clone() for p in group], loss, loss) for group, loss in zip(groups, initial,
                                                                                                strict=True)]
    average = _Average(parameters, averaging)
    rates = [group["lr"] for group in optimizer.param_groups]
    # The steps, and only they, reuse the heap (cpu.reused_heap): they allocate the same working set again and
    # again. Its way in hands back what the setup freed (stacking the batches, the start's held-out loss) before the
    # steps pile their working set on it (each layer's refinement rose 15-20 MB less: a 12-layer GPT-2-medium-shaped
    # checkpoint, shared key at rank 768). The setup itself runs beside it: its large one-time tensors then come
    # from their own mappings and go back when freed; in the reused heap the float16 samples freed as the float32
    # stack grew left holes no later request fitted (a probe of the same checkpoint's shared key at rank 512: its
    # stacking 181-224 MB above the imports, 176-184 MB so). Bounding the heap's growth between steps as well
    # (cpu.BoundedHeap, 16 or 32 MB) made that refinement 40% slower for no lower peak.
    with reused_heap(top=HEAP_TRIM_THRESHOLD):
        _steps(groups, states, optimizer, rates, average, minibatch_loss, held_out_losses, steps, check_every,
               patience, warmup, on_check)
    return [(state.best, state.initial, state.best_loss, state.taken) for state in states]


def _steps(groups, states, optimizer, rates, average, minibatch_loss, held_out_losses, steps, check_every, patience,
           warmup, on_check) -> None:
    """adam_with_held_out_groups' loop: steps, and every `check_every` the held-out checks of the groups not yet
    out of patience."""
    active = list(range(len(groups)))
    for taken in range(1, steps + 1):
        if taken <= warmup:
            for group, rate in zip(optimizer.param_groups, rates, strict=True):
                group["lr"] = rate * taken / warmup
        minibatch_loss().backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients let go before the check, not kept beside its copies
        average.add()
        if taken % check_every == 0 or taken == steps:
            with average.in_place():
                losses = held_out_losses(active)
                if on_check is not None:
                    on_check(taken, losses)
                for index, loss in zip(active, losses, strict=True):
                    state = states[index]
                    state.taken = taken
                    if loss < state.best_loss:  # copied into the best's tensors: no new copy beside the old
                        torch._foreach_copy_(state.best, [p.detach() for p in groups[index]])
                        state.best_loss, state.stale = loss, 0
                    else:
                        state.stale += 1
            active = [index for index in active if states[index].stale < patience]
            if not active:
                break


def share_steps(losses: list[float], total: int, most: float = 3.0, least: int = 20) -> list[int]:
    """Split `total` refinement steps over layers in proportion to each one's loss before refinement: the
    steps go where the error is. No layer gets more than `most` times the even share; a layer with any loss
    gets at least `least` (one held-out check)."""
    if not losses:
        return []
    even = total / len(losses)
    weights = [max(loss, 0.0) for loss in losses]
    if sum(weights) <= 0:
        return [round(even)] * len(losses)
    shares = [min(total * w / sum(weights), most * even) for w in weights]
    spare = total - sum(shares)  # what the cap took from the largest, spread over the rest by loss
    room = [w if share < most * even else 0.0 for w, share in zip(weights, shares)]
    if spare > 0 and sum(room) > 0:
        shares = [min(share + spare * r / sum(room), most * even) for share, r in zip(shares, room)]
    return [max(int(round(share)), least if w > 0 else 0) for share, w in zip(shares, weights)]
