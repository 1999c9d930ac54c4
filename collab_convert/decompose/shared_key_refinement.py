"""Refining a shared rotary key against the original layer's attention (pure torch: no model, no files).

The weighted PCA (shared_key.py) keeps the most score energy, but softmax only listens to the keys that win.
Layer by layer, Adam adjusts the key mixing and the per-head cores (and, for the multi-query form, the value
latent's down- and up-projections, value_latent.py) so that each head's attention on calibration sequences
(causal in decoders; T5's position bias added) matches the original's, through its values and output
projection. Stochastic, as the CP refinement is: each step sees a few sequences and a few sampled query
positions, so its cost does not grow with the calibration set; a held-out tenth of the sequences decides when to
stop and which parameters to keep (the start counts, so the result is never worse there than the PCA it started
from). The key mixing and the down-projection read the keys and the values, whose dimensions differ in scale by
orders of magnitude: Adam moves them in coordinates preconditioned by those inputs' second moment
(preconditioning.py). The batches the steps run on: shared_key_batches.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..cpu import return_freed_heap
from ..devices import HOST, Device, training_products
from .held_out_adam import adam_with_held_out_groups, held_out_count, starting_leaves
from .preconditioning import InputPreconditioner, second_moment
from .refinement import drawn_rows
from .shared_key import HeadGeometry, SharedKeyFactors, slot_frequencies
from .shared_key_batches import AttentionSetting, SharedKeySample, StackedSequences
from .value_latent import ValueLatent


# Steps between held-out checks. The held-out curves of SmolLM2's layers still fall at the last step, so the state
# kept is the last one's with checks every 20 steps or every 40 (the same held-out errors on its dumped layers at
# 50% and 75% of the key cache and in the multi-query form), and the checks were 7% of a refinement at 20.
CHECK_EVERY = 40
# Checks without a gain before a layer stops: 120 steps, as 5 checks of 20 were 100. At 75% of SmolLM2's key cache
# four layers never beat their start and stopped so; with 5 checks of 40 they ran all 200 steps (8% more).
PATIENCE = 3
QUERY_ROWS = 32  # query positions a step draws in each of its sequences
# A held-out check scores every row of its sequences, several sequences a problem: at most this many bytes of shared
# queries (sequences x N_h x n x (2W + p) float32) a problem, and at most 8 sequences. SmolLM2's layers keep 8 (3.5 MB
# at half the key cache); a GPT-2-medium shape at rank 768 takes one at a time (6.3 MB a sequence: three at once set
# its refining stage's peak)
CHECK_BYTES = 8 << 20
# Steps over which the learning rate rises to its full value: on SmolLM2's dumped layers 10 of them took the summed
# held-out error from 0.36593 to 0.36482 at half the key cache, 0.03636 to 0.03572 at 75%, and in the multi-query
# form 0.55190 to 0.53725 (0.54957 at 130 steps instead of 160). docs/benchmarks.md, "A cheaper refinement step".
WARMUP = 10
# Adam's step, a share of each tensor's typical entry, in the preconditioned coordinates (preconditioning.py), and
# with a value latent refined too. On SmolLM2's dumped layers the summed held-out error against the unpreconditioned
# 9e-2: 4.5e-2 -4.9% at half the key cache, -7.2% at 75%, -4.7% in the multi-query form; 9e-2 -5.4%, +1.2% (a layer
# at 75% never beat its start), -6.3%; 6e-2 -5.6%, -3.2%, -5.7%.
LEARNING_RATE, LEARNING_RATE_WITH_VALUES = 4.5e-2, 9e-2


@dataclass
class SharedKeyRefinement:
    factors: SharedKeyFactors
    kl_before: float  # mean attention KL on the held-out sequences, whatever the objective
    kl_after: float
    steps: int
    objective: str = "attention KL"
    loss_before: float = 0.0  # the objective on the held-out sequences (relative output error, or KL)
    loss_after: float = 0.0
    values: ValueLatent | None = None  # the refined value latent, where one was refined with the key



def attention_output_errors(samples: list[SharedKeySample], factors: SharedKeyFactors, geometry: HeadGeometry,
                            setting: AttentionSetting, candidates: list[ValueLatent | None],
                            device: Device = HOST) -> list[float]:
    """The error of the layer's attention output through the output projection on every sample, as a share of its
    energy, with each candidate value latent (None: the original values): how good a start is. The shared
    attention is computed once for all candidates, against the outputs the calibration pass recorded where the
    samples carry them (computing both attentions per candidate was a fifth of SmolLM2's multi-query refining)."""
    slots = slot_frequencies(factors.ranks).to(device)
    setting = setting.on(device)
    key = [t.to(device, torch.float32) for t in (factors.key_mixing, factors.query_core, factors.pass_core)]
    reads = [() if values is None else (values.down.to(device, torch.float32), (
        values.up if values.up.shape[0] == geometry.num_heads else values.up[geometry.group_of_head]
    ).to(device, torch.float32)) for values in candidates]  # the up-projections one per head
    totals, energy = [0.0] * len(candidates), 0.0
    with torch.no_grad():
        for problem in StackedSequences(samples, geometry, setting, slots, device, targets=True).each_problem():
            probabilities = problem.attention(*key)
            for index, read in enumerate(reads):
                totals[index] += float(problem.output_error(probabilities, *read))
            energy += problem.output_energy
    return [total / max(energy, 1e-30) for total in totals]


@dataclass
class LayerToRefine:
    """One layer's refinement: its calibration samples, the fit it starts from, its shape and attention setting,
    and the value latent refined with the key, where there is one."""

    samples: list[SharedKeySample]
    factors: SharedKeyFactors
    geometry: HeadGeometry
    setting: AttentionSetting
    values: ValueLatent | None = None

    def starts(self) -> list[torch.Tensor]:
        """What its refinement starts from, in their own shapes: the key mixing, the query cores and the pass cores,
        then the value latent's down-projection and an up-projection per head (its output projection absorbs it, so
        this costs nothing at inference: the PCA's per-group ones are where they start)."""
        starts = [self.factors.key_mixing, self.factors.query_core, self.factors.pass_core]
        if self.values is not None:
            starts += [self.values.down, self.values.up[self.geometry.group_of_head]]
        return starts


def foldable(layers: list[LayerToRefine]) -> bool:
    """Whether these layers can share steps (refine_shared_keys): the same shapes, the same sequences (lengths),
    the same attention besides its weights (scale, soft-capping, causality; no position bias), and the output as
    the objective."""
    first = layers[0]

    def alike(layer: LayerToRefine) -> bool:
        a, b = layer.setting, first.setting
        return (layer.geometry == first.geometry and len(layer.samples) == len(first.samples)
                and (a.scaling, a.softcap, a.causal) == (b.scaling, b.softcap, b.causal)
                and a.output_weight is not None and a.output_weight.shape == b.output_weight.shape
                and (layer.values is None) == (first.values is None)
                and (layer.values is None or layer.values.down.shape == first.values.down.shape)
                and all(x.queries.shape[0] == y.queries.shape[0] and x.keys.shape[0] == y.keys.shape[0]
                        and x.values is not None for x, y in zip(layer.samples, first.samples, strict=True)))

    return all(layer.setting.position_bias is None and alike(layer) for layer in layers)


def refine_shared_key(samples: list[SharedKeySample], factors: SharedKeyFactors, geometry: HeadGeometry,
                      setting: AttentionSetting, steps: int = 200, learning_rate: float | None = None,
                      batch_sequences: int = 8, query_rows: int = QUERY_ROWS, seed: int = 0,
                      device: Device = HOST, values: ValueLatent | None = None,
                      consume: bool = False) -> SharedKeyRefinement:
    """One layer's refine_shared_keys."""
    (refined,) = refine_shared_keys([LayerToRefine(samples, factors, geometry, setting, values)], steps=steps,
                                    learning_rate=learning_rate, batch_sequences=batch_sequences,
                                    query_rows=query_rows, seed=seed, device=device, consume=consume)
    return refined


def refine_shared_keys(layers: list[LayerToRefine], steps: int = 200, learning_rate: float | None = None,
                       batch_sequences: int = 8, query_rows: int = QUERY_ROWS, seed: int = 0,
                       device: Device = HOST, consume: bool = False) -> list[SharedKeyRefinement]:
    """Adam on the error of the attention output through the output projection where the samples carry values
    (else the mean attention KL(original || shared) per head and query; see the module docstring), with a value
    latent refined together with the key where one is given. Layers that are `foldable` share each step: their
    batches side by side, their losses summed (each layer's gradient is its own), each checked and kept on its
    own held-out sequences, as if refined alone; others are refined one at a time. The steps run on `device`;
    the samples wait in host memory, and the results come back there. `consume`: the samples' tensors are let go
    once stacked (where none are held out, after the checks' copy), and factors already in float32 on `device`
    become the parameters themselves (changed in place), not copied. `learning_rate`: None for LEARNING_RATE, or
    LEARNING_RATE_WITH_VALUES where a value latent is refined."""
    if learning_rate is None:
        learning_rate = LEARNING_RATE if layers[0].values is None else LEARNING_RATE_WITH_VALUES
    if len(layers) > 1 and not foldable(layers):
        return [refined for layer in layers for refined in refine_shared_keys(
            [layer], steps=steps, learning_rate=learning_rate, batch_sequences=batch_sequences,
            query_rows=query_rows, seed=seed, device=device, consume=consume)]
    width = max(layer.factors.query_core.shape[-1] for layer in layers)
    pass_width = max(layer.factors.pass_core.shape[-1] for layer in layers)
    # a layer with fewer slots than the widest takes extra ones at zero: their key mixing and cores stay zero (each
    # one's gradient is a product with the other), so the layer's scores are its own
    slots = [padded_slots(layer.factors.ranks, width).to(device) for layer in layers]
    held = held_out_count(len(layers[0].samples))
    checks, parameters, conditioners = _set_up(layers, slots, held, width, pass_width, device, consume)

    def held_out(indices: list[int]) -> list[float]:
        with torch.no_grad():
            losses = [[p.loss(*conditioners[index].readable(parameters[index])) for p in checks[index]]
                      for index in indices]
            return [float(sum(loss for loss, _ in each)) / max(sum(norm for _, norm in each), 1e-30)
                    for each in losses]

    kl_before = [_held_out_kl(problems, conditioner.readable(state))
                 for problems, state, conditioner in zip(checks, parameters, conditioners, strict=True)]
    folded_conditioner = _Conditioners.stacked(conditioners)
    products = training_products(device)  # the steps' products; the held-out checks stay in float32
    stacks = [_stacked(layer, layer_slots, held, device, products, consume, len(layers) > 1)
              for layer, layer_slots in zip(layers, slots, strict=True)]
    sequences, stacks = stacks[0] if len(stacks) == 1 else StackedSequences.folded(stacks), None
    lengths, generator = sequences.query_lengths.to(HOST), torch.Generator().manual_seed(seed)

    def minibatch_loss() -> torch.Tensor:
        # the rows of all the chosen sequences in one draw (a draw and a sort per sequence, and the positions
        # assembled row by row, were a tenth of a SmolLM2 step)
        chosen = torch.randperm(len(lengths), generator=generator)[:batch_sequences]
        picks = drawn_rows(lengths[chosen], query_rows, generator)
        stacked = [torch.stack(kind) for kind in zip(*parameters, strict=True)] if len(parameters) > 1 else [
            t[None] for t in parameters[0]]
        return sequences.problem(chosen, picks, products).step_loss(*folded_conditioner.readable(stacked))

    results = adam_with_held_out_groups(parameters, minibatch_loss, held_out, steps, learning_rate,
                                        check_every=CHECK_EVERY, patience=PATIENCE, warmup=WARMUP,
                                        typical=[_typical(state, layer) for state, layer in zip(parameters, layers,
                                                                                                strict=True)])
    objective = "attention output" if checks[0][0].values is not None else "attention KL"
    return [_refined(layer, problems, before, conditioner.readable(best), *rest, objective)
            for layer, problems, before, conditioner, (best, *rest) in zip(layers, checks, kl_before, conditioners,
                                                                            results, strict=True)]


class _Conditioners:
    """A layer's refinement in preconditioned coordinates (decompose/preconditioning.py): the key mixing reads the
    keys, and a value latent's down-projection the values, each through its inputs' second moment on the training
    sequences. `moved` takes the parameters there, `readable` back to what the layer reads."""

    def __init__(self, keys: InputPreconditioner, values: InputPreconditioner | None):
        self.keys, self.values = keys, values

    @classmethod
    def of(cls, layer: LayerToRefine, held: int, device: Device) -> _Conditioners:
        train = layer.samples[:-held] if held else layer.samples
        keys = InputPreconditioner.of(second_moment([sample.keys for sample in train])).to(device)
        values = None
        if layer.values is not None and train[0].values is not None:
            values = InputPreconditioner.of(second_moment([sample.values for sample in train])).to(device)
        return cls(keys, values)

    @classmethod
    def stacked(cls, conditioners: list[_Conditioners]) -> _Conditioners:
        """For layers refined side by side: their parameters stacked (L, ...)."""
        if len(conditioners) == 1:
            return conditioners[0]
        values = None if conditioners[0].values is None else InputPreconditioner.stacked(
            [c.values for c in conditioners])
        return cls(InputPreconditioner.stacked([c.keys for c in conditioners]), values)

    def _mapped(self, state: list[torch.Tensor], way: str) -> list[torch.Tensor]:
        """The key mixing (first) and the down-projection (fourth, where values are preconditioned) mapped `way`
        ("readable" or "moved"); the other parameters as they are."""
        out = list(state)
        out[0] = getattr(self.keys, way)(out[0])
        if self.values is not None:
            out[3] = getattr(self.values, way)(out[3])
        return out

    def readable(self, state: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._mapped(state, "readable")

    def moved(self, state: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters (Adam's leaves) taken to the preconditioned coordinates in place: where they are the
        caller's own tensors (consume), no copy sits beside them."""
        with torch.no_grad():
            for parameter, moved in zip(state, self._mapped(state, "moved"), strict=True):
                if moved is not parameter:
                    parameter.copy_(moved)
        return state


def _set_up(layers: list[LayerToRefine], slots: list[torch.Tensor], held: int, width: int, pass_width: int,
            device: Device, consume: bool) -> tuple[list, list, list]:
    """Each layer's held-out problems, its parameters (Adam's leaves, in preconditioned coordinates) and the
    coordinates' conditioners, taken from its samples before they are let go."""
    checks, parameters, conditioners = [], [], []
    for layer, layer_slots in zip(layers, slots, strict=True):
        conditioners.append(_Conditioners.of(layer, held, device))
        check = layer.samples[-held:] if held else layer.samples
        longest = max(sample.queries.shape[0] for sample in check)
        size = max(1, min(8, CHECK_BYTES // (layer.geometry.num_heads * longest * (2 * width + pass_width) * 4)))
        checks.append([problem.let_go_of_original() for problem in StackedSequences(
            check, layer.geometry, layer.setting.on(device), layer_slots, device,
            consume=consume and bool(held)).each_problem(size)])
        parameters.append(conditioners[-1].moved(_parameters(layer, width, pass_width, device, consume)))
    return checks, parameters, conditioners


def _stacked(layer: LayerToRefine, slots: torch.Tensor, held: int, device: Device, products: torch.dtype,
             consume: bool, trimmed: bool) -> StackedSequences:
    """The layer's training sequences stacked for the steps. `trimmed`: what the stacking freed is handed back at
    once (cpu.return_freed_heap), so that several layers stacked in turn do not pile their transients up (four
    SmolLM2 layers stacked inside the steps' reused heap, as they were then: 270 MB above their live tensors)."""
    stack = StackedSequences(layer.samples[:-held] if held else layer.samples, layer.geometry,
                             layer.setting.on(device), slots, device, targets=True, products=products,
                             consume=consume, for_steps=True)
    if trimmed:
        return_freed_heap()
    return stack


def padded_slots(ranks, width: int) -> torch.Tensor:
    """The layer's slot frequencies, then frequency 0 for the slots it lacks up to `width`."""
    slots = slot_frequencies(ranks)
    return torch.cat([slots, slots.new_zeros(width - len(slots))])


def _parameters(layer: LayerToRefine, width: int, pass_width: int, device: Device, consume: bool):
    """The layer's parameters, float32 on `device`, with zero slots up to `width` complex and `pass_width` pass
    ones: the key mixing's rows (real parts, imaginary parts, pass rows) and the cores' columns."""
    factors, start = layer.factors, layer.starts()
    own, own_pass = factors.query_core.shape[-1], factors.pass_core.shape[-1]
    if (own, own_pass) != (width, pass_width):
        mixing = factors.key_mixing.new_zeros(2 * width + pass_width, factors.key_mixing.shape[1])
        for begin, to, count in ((0, 0, own), (own, width, own), (2 * own, 2 * width, own_pass)):
            mixing[to : to + count] = factors.key_mixing[begin : begin + count]
        start[:3] = [mixing, torch.nn.functional.pad(factors.query_core, (0, width - own)),
                     torch.nn.functional.pad(factors.pass_core, (0, pass_width - own_pass))]
    return starting_leaves(start, device, consume)


def _typical(state: list[torch.Tensor], layer: LayerToRefine) -> list[float]:
    """Each parameter's typical entry, which sets its rate: the mean size of its own entries, not of its zero slots."""
    return [float(t.detach().abs().mean().clamp_min(1e-8)) if t.numel() == mine.numel() else
            max(float(t.detach().abs().sum()) / max(mine.numel(), 1), 1e-8)
            for t, mine in zip(state, layer.starts(), strict=True)]


def _held_out_kl(checks, state: list[torch.Tensor]) -> float:
    """The mean attention KL on the held-out sequences; each problem's original attention let go once read."""
    total, rows = 0.0, 0
    with torch.no_grad():
        for problem in checks:
            total += float(problem.kl_sum(problem.predicted(*state[:3])))
            rows += int(problem.valid.sum())
            problem.let_go_of_original()
    return total / max(rows, 1)


def _refined(layer: LayerToRefine, checks, kl_before: float, best, initial: float, best_loss: float, taken: int,
             objective: str) -> SharedKeyRefinement:
    """The layer's result: its best parameters back in its own slots, dtype and host memory."""
    kl_after = _held_out_kl(checks, best)
    factors, values = layer.factors, layer.values
    own, own_pass = factors.query_core.shape[-1], factors.pass_core.shape[-1]
    width = best[1].shape[-1]
    mixing = torch.cat([best[0][:own], best[0][width : width + own], best[0][2 * width : 2 * width + own_pass]])
    dtype = factors.key_mixing.dtype
    refined = replace(factors, key_mixing=mixing.to(HOST, dtype), query_core=best[1][..., :own].to(HOST, dtype),
                      pass_core=best[2][..., :own_pass].to(HOST, dtype))
    if values is not None:
        values = replace(values, down=best[3].to(HOST, values.down.dtype), up=best[4].to(HOST, values.up.dtype))
    return SharedKeyRefinement(refined, kl_before, kl_after, taken, objective, initial, best_loss, values)
