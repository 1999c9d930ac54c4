"""Refining a shared rotary key against the original layer's attention (pure torch: no model, no files).

The weighted PCA (shared_key.py) keeps the most score energy, but softmax only listens to the keys that win.
Layer by layer, Adam adjusts the key mixing and the per-head cores (and, for the multi-query form, the value
latent's down- and up-projections, value_latent.py) so that each head's attention on calibration sequences
(causal in decoders; T5's position bias added) matches the original's, through its values and output
projection. Stochastic, as the CP refinement is: each step sees a few sequences and a few sampled query
positions, so its cost does not grow with the calibration set; a held-out tenth of the sequences decides when to
stop and which parameters to keep (the start counts, so the result is never worse there than the PCA it started
from). The batches the steps run on: shared_key_batches.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..devices import HOST, Device, training_products
from .held_out_adam import adam_with_held_out, held_out_count
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
# Steps over which the learning rate rises to its full value: on SmolLM2's dumped layers 10 of them took the summed
# held-out error from 0.36593 to 0.36482 at half the key cache, 0.03636 to 0.03572 at 75%, and in the multi-query
# form 0.55190 to 0.53725 (0.54957 at 130 steps instead of 160). docs/benchmarks.md, "A cheaper refinement step".
WARMUP = 10


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


def refine_shared_key(samples: list[SharedKeySample], factors: SharedKeyFactors, geometry: HeadGeometry,
                      setting: AttentionSetting, steps: int = 200, learning_rate: float = 9e-2,
                      batch_sequences: int = 8, query_rows: int = QUERY_ROWS, seed: int = 0,
                      device: Device = HOST, values: ValueLatent | None = None,
                      consume: bool = False) -> SharedKeyRefinement:
    """Adam on the error of the attention output through the output projection where the samples carry values
    (else the mean attention KL(original || shared) per head and query; see the module docstring), with a value
    latent refined together with the key where one is given. The steps run on `device`; the samples wait in host
    memory, and the result comes back there. `consume`: the samples' tensors are let go once stacked (the caller
    reads them no more; where none are held out, only after the checks' copy), not held beside their stacked copy,
    and factors already in float32 on `device` become the parameters themselves (changed in place), not copied."""
    slots = slot_frequencies(factors.ranks).to(device)
    setting = setting.on(device)
    held = held_out_count(len(samples))
    train, check = (samples[:-held], samples[-held:]) if held else (samples, samples)
    checks = StackedSequences(check, geometry, setting, slots, device, consume=consume and bool(held)).problems()
    check_rows = sum(int(p.valid.sum()) for p in checks)
    if values is not None and checks[0].values is None:
        raise ValueError("refining a value latent needs samples with values and the layer's output projection")
    # every head reads the shared latent through an up-projection of its own (its output projection absorbs it, so
    # this costs nothing at inference): the PCA's per-group ones are where they start
    per_head = (values.down, values.up[geometry.group_of_head]) if values is not None else ()
    start = (factors.key_mixing, factors.query_core, factors.pass_core) + per_head
    parameters = [(t.to(device, torch.float32) if consume else t.to(device, torch.float32).clone()).detach()
                  .requires_grad_(True) for t in start]

    def held_out() -> float:
        with torch.no_grad():
            losses = [p.loss(*parameters) for p in checks]
            return float(sum(loss for loss, _ in losses)) / max(sum(norm for _, norm in losses), 1e-30)

    def held_out_kl(state: list[torch.Tensor]) -> float:
        with torch.no_grad():
            return float(sum(p.kl_sum(p.predicted(*state[:3])) for p in checks)) / max(check_rows, 1)

    generator = torch.Generator().manual_seed(seed)
    kl_before = held_out_kl(parameters)
    products = training_products(device)  # the steps' products; the held-out checks stay in float32
    sequences = StackedSequences(train, geometry, setting, slots, device, targets=True, products=products,
                                 consume=consume, for_steps=True)
    lengths = sequences.query_lengths.to(HOST)

    def minibatch_loss() -> torch.Tensor:
        # the rows of all the chosen sequences in one draw (a draw and a sort per sequence, and the positions
        # assembled row by row, were a tenth of a SmolLM2 step)
        chosen = torch.randperm(len(train), generator=generator)[:batch_sequences]
        picks = drawn_rows(lengths[chosen], query_rows, generator)
        loss, norm = sequences.problem(chosen, picks, products).loss(*parameters)
        return loss / max(norm, 1e-30)

    best, initial, best_loss, taken = adam_with_held_out(parameters, minibatch_loss, held_out, steps, learning_rate,
                                                         check_every=CHECK_EVERY, patience=PATIENCE, warmup=WARMUP)
    kl_after = held_out_kl(best)
    dtype = factors.key_mixing.dtype
    refined = replace(factors, key_mixing=best[0].to(HOST, dtype), query_core=best[1].to(HOST, dtype),
                      pass_core=best[2].to(HOST, dtype))
    if values is not None:
        values = replace(values, down=best[3].to(HOST, values.down.dtype), up=best[4].to(HOST, values.up.dtype))
    objective = "attention output" if checks[0].values is not None else "attention KL"
    return SharedKeyRefinement(refined, kl_before, kl_after, taken, objective, initial, best_loss, values)
