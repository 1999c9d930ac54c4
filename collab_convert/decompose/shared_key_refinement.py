"""Refining a shared rotary key against the original layer's attention (pure torch: no model, no files).

The weighted PCA (shared_key.py) keeps the most score energy, but softmax only listens to the keys that win.
Layer by layer, Adam adjusts the key mixing and the per-head cores (and, for the multi-query form, the value
latent's down- and up-projections, value_latent.py) so that each head's attention on calibration sequences
(causal in decoders; T5's position bias added) matches the original's, through its values and output
projection. Stochastic, as the CP refinement is: each step sees a few sequences and a few sampled query
positions, so its cost does not grow with the calibration set; a held-out tenth of the sequences decides when to
stop and which parameters to keep (the start counts, so the result is never worse there than the PCA it started
from).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..devices import HOST, Device, moved, training_products
from .refinement import adam_with_held_out, product_in
from .rotary_ops import query_in_shared_basis, rotate_half_dims, rotate_shared_key
from .shared_key import HeadGeometry, SharedKeyFactors, slot_frequencies
from .value_latent import ValueLatent


@dataclass
class SharedKeySample:
    """One calibration sequence at one layer: queries (n, N_h, d) and keys (n, G, d) after norms, before RoPE."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor | None = None  # (n, G, d): with them, refinement matches the attention's output


@dataclass
class AttentionSetting:
    """What the layer does to scores besides q.k: its scale, soft-capping, and RoPE tables (positions 0..n-1)."""

    scaling: float
    cos: torch.Tensor  # (n_max, rotary_dim)
    sin: torch.Tensor
    softcap: float | None = None
    output_weight: torch.Tensor | None = None  # (D, N_h d): the output projection, which weighs head errors
    causal: bool = True  # each query sees the keys up to its own position (False: encoders, cross-attention)
    position_bias: torch.Tensor | None = None  # (N_h, n_max, m_max) added to the scaled scores (T5's)


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


def _batch(samples: list[SharedKeySample], rows: int | None, generator, device=HOST) -> tuple:
    """Padded (B, rows, H, d) queries at sampled rows, (B, m, G, d) keys and values, row positions, valid masks:
    gathered in host memory, where the samples wait, and moved to `device` together."""
    length = max(s.keys.shape[0] for s in samples)
    picks = [torch.arange(s.queries.shape[0]) if rows is None
             else torch.randperm(s.queries.shape[0], generator=generator)[:rows].sort().values for s in samples]
    width = max(p.shape[0] for p in picks)
    queries = torch.zeros(len(samples), width, *samples[0].queries.shape[1:])
    keys = torch.zeros(len(samples), length, *samples[0].keys.shape[1:])
    values = torch.zeros(len(samples), length, *samples[0].keys.shape[1:]) if samples[0].values is not None else None
    positions = torch.zeros(len(samples), width, dtype=torch.long)
    row_valid = torch.zeros(len(samples), width, dtype=torch.bool)
    key_valid = torch.zeros(len(samples), length, dtype=torch.bool)
    for i, (sample, pick) in enumerate(zip(samples, picks, strict=True)):
        queries[i, : pick.shape[0]] = sample.queries[pick].float()
        positions[i, : pick.shape[0]] = pick
        row_valid[i, : pick.shape[0]] = True
        keys[i, : sample.keys.shape[0]] = sample.keys.float()
        key_valid[i, : sample.keys.shape[0]] = True
        if values is not None:
            values[i, : sample.values.shape[0]] = sample.values.float()
    return moved((queries, keys, values, positions, row_valid, key_valid), device)


class _Problem:
    """The original attention of a batch (fixed) and the shared form's, as a function of the parameters.

    With values and the output projection, the loss is the error of the layer's attention output (through the
    output projection, so heads count as much as they reach the residual stream); else the attention KL."""

    def __init__(self, batch, geometry: HeadGeometry, setting: AttentionSetting, slots: torch.Tensor,
                 products: torch.dtype = torch.float32):
        queries, keys, values, positions, row_valid, key_valid = batch
        self.geometry, self.setting, self.slots = geometry, setting, slots
        self.products = products  # the dtype of the products that depend on the parameters (the target: float32)
        group_of_head = geometry.group_of_head.to(keys.device)
        length = keys.shape[1]
        cos, sin = setting.cos[:length], setting.sin[:length]
        self.key_cos, self.key_sin = cos, sin
        row_cos, row_sin = setting.cos[positions][:, None], setting.sin[positions][:, None]  # (B, 1, rows, rd)
        self.queries = rotate_half_dims(queries.transpose(1, 2), row_cos, row_sin, geometry.rotary_dim)
        self.keys = keys.flatten(2)  # (B, m, G d)
        allowed = key_valid[:, None, :].expand(-1, positions.shape[1], -1)
        if setting.causal:
            allowed = allowed & (torch.arange(length, device=keys.device)[None, None, :] <= positions[:, :, None])
        self.allowed = allowed[:, None]  # (B, 1, rows, m)
        self.bias = None
        if setting.position_bias is not None:  # each row's bias at its own position: (B, H, rows, m)
            bias = setting.position_bias[:, :, :length]
            self.bias = bias[:, positions.clamp_max(bias.shape[1] - 1)].permute(1, 0, 2, 3)
        self.rows = row_valid
        self.valid = row_valid[:, None, :].expand(-1, geometry.num_heads, -1)
        rotated_keys = rotate_half_dims(keys.transpose(1, 2), cos, sin, geometry.rotary_dim)  # (B, G, m, d)
        grouped = rotated_keys[:, group_of_head]  # (B, H, m, d)
        self.values = self.stacked_values = None
        if values is not None and setting.output_weight is not None:
            self.values = values.transpose(1, 2)[:, group_of_head]  # (B, H, m, d)
            self.stacked_values = values.flatten(2)  # (B, m, G d): what a value latent reads
        with torch.no_grad():
            self.target = self._log_softmax(self.queries @ grouped.transpose(-1, -2))
            self.target_p = self.target.exp()
            if self.values is not None:
                self.target_output = self._output(self.target_p, products=torch.float32)
                self.output_energy = float((self.target_output**2).sum(-1)[self.rows].sum())

    def _log_softmax(self, scores: torch.Tensor) -> torch.Tensor:
        scores = scores * self.setting.scaling
        if self.setting.softcap:
            scores = torch.tanh(scores / self.setting.softcap) * self.setting.softcap
        if self.bias is not None:
            scores = scores + self.bias
        return torch.log_softmax(scores.masked_fill(~self.allowed, float("-inf")), dim=-1)

    def _output(self, probabilities: torch.Tensor, down: torch.Tensor | None = None,
                up: torch.Tensor | None = None, products: torch.dtype | None = None) -> torch.Tensor:
        """The layer's output (B, rows, D); with a value latent, every head averages the latent and reads its
        group's values back through `up`. Its products run in `products` (None: the problem's own)."""
        probabilities = probabilities.nan_to_num(0.0)
        dtype = products or self.products

        def product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            return product_in(left, right, dtype)

        if down is None:
            heads = product(probabilities, self.values)  # (B, H, rows, d)
        else:
            averaged = product(probabilities, product(self.stacked_values, down.T)[:, None])  # (B, H, rows, W)
            heads = product(averaged, up.transpose(-1, -2))  # each head reads the latent through its own up-projection
        return product(heads.transpose(1, 2).flatten(2), self.setting.output_weight.T)

    def _product(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return product_in(left, right, self.products)

    def predicted(self, mixing: torch.Tensor, core: torch.Tensor, pass_core: torch.Tensor) -> torch.Tensor:
        shared_key = rotate_shared_key(self._product(self.keys, mixing.T), self.key_cos, self.key_sin,
                                       self.slots)  # (B, m, K)
        shared_query = query_in_shared_basis(self.queries, core, pass_core, self.slots, self.geometry.rotary_dim)
        return self._log_softmax(self._product(shared_query, shared_key[:, None].transpose(-1, -2)))

    def kl_sum(self, predicted: torch.Tensor) -> torch.Tensor:
        kl = (self.target_p * (self.target - predicted)).nan_to_num(0.0).sum(-1)
        return kl[self.valid].sum()

    def loss(self, mixing, core, pass_core, down=None, up=None) -> tuple[torch.Tensor, float]:
        """(the objective's sum over this batch, its normaliser)."""
        predicted = self.predicted(mixing, core, pass_core)
        if self.values is None:
            return self.kl_sum(predicted), float(self.valid.sum())
        error = ((self._output(predicted.exp(), down, up) - self.target_output) ** 2).sum(-1)
        return error[self.rows].sum(), self.output_energy


def attention_output_error(samples: list[SharedKeySample], factors: SharedKeyFactors, geometry: HeadGeometry,
                           setting: AttentionSetting, values: ValueLatent | None = None,
                           device: Device = HOST) -> float:
    """The error of the layer's attention output through the output projection on every sample, as a share of its
    energy: how good a start is, before refinement."""
    slots = slot_frequencies(factors.ranks).to(device)
    setting = replace(setting, **moved({"cos": setting.cos, "sin": setting.sin, "output_weight": setting.output_weight,
                                        "position_bias": setting.position_bias}, device))
    start = [t.to(device, torch.float32) for t in (factors.key_mixing, factors.query_core, factors.pass_core)]
    if values is not None:
        start += [values.down.to(device, torch.float32),
                  values.up[geometry.group_of_head].to(device, torch.float32) if values.up.shape[0] !=
                  geometry.num_heads else values.up.to(device, torch.float32)]
    total, energy = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(samples), 8):
            loss, norm = _Problem(_batch(samples[i:i + 8], None, None, device), geometry, setting, slots).loss(*start)
            total, energy = total + float(loss), energy + norm
    return total / max(energy, 1e-30)


def refine_shared_key(samples: list[SharedKeySample], factors: SharedKeyFactors, geometry: HeadGeometry,
                      setting: AttentionSetting, steps: int = 200, learning_rate: float = 6e-2,
                      batch_sequences: int = 8, query_rows: int = 32, seed: int = 0,
                      device: Device = HOST, values: ValueLatent | None = None) -> SharedKeyRefinement:
    """Adam on the error of the attention output through the output projection where the samples carry values
    (else the mean attention KL(original || shared) per head and query; see the module docstring), with a value
    latent refined together with the key where one is given. The steps run on `device`; the samples wait in host
    memory, and the result comes back there."""
    slots = slot_frequencies(factors.ranks).to(device)
    setting = replace(setting, **moved({"cos": setting.cos, "sin": setting.sin, "output_weight": setting.output_weight,
                                        "position_bias": setting.position_bias}, device))
    held = max(len(samples) // 10, 1) if len(samples) >= 10 else 0
    train, check = (samples[:-held], samples[-held:]) if held else (samples, samples)
    checks = [_Problem(_batch(check[i:i + 8], None, None, device), geometry, setting, slots)
              for i in range(0, len(check), 8)]
    check_rows = sum(int(p.valid.sum()) for p in checks)
    if values is not None and checks[0].values is None:
        raise ValueError("refining a value latent needs samples with values and the layer's output projection")
    # every head reads the shared latent through an up-projection of its own (its output projection absorbs it, so
    # this costs nothing at inference): the PCA's per-group ones are where they start
    per_head = (values.down, values.up[geometry.group_of_head]) if values is not None else ()
    start = (factors.key_mixing, factors.query_core, factors.pass_core) + per_head
    parameters = [t.to(device, torch.float32).clone().requires_grad_(True) for t in start]

    def held_out() -> float:
        with torch.no_grad():
            losses = [p.loss(*parameters) for p in checks]
            return float(sum(loss for loss, _ in losses)) / max(sum(norm for _, norm in losses), 1e-30)

    def held_out_kl() -> float:
        with torch.no_grad():
            return float(sum(p.kl_sum(p.predicted(*parameters[:3])) for p in checks)) / max(check_rows, 1)

    generator = torch.Generator().manual_seed(seed)
    kl_before = held_out_kl()
    products = training_products(device)  # the steps' products; the held-out checks stay in float32

    def minibatch_loss() -> torch.Tensor:
        chosen = [train[i] for i in torch.randperm(len(train), generator=generator)[:batch_sequences]]
        problem = _Problem(_batch(chosen, query_rows, generator, device), geometry, setting, slots, products)
        loss, norm = problem.loss(*parameters)
        return loss / max(norm, 1e-30)

    best, initial, best_loss, taken = adam_with_held_out(parameters, minibatch_loss, held_out, steps, learning_rate)
    for parameter, kept in zip(parameters, best, strict=True):
        parameter.data.copy_(kept)
    kl_after = held_out_kl()
    dtype = factors.key_mixing.dtype
    refined = replace(factors, key_mixing=best[0].to(HOST, dtype), query_core=best[1].to(HOST, dtype),
                      pass_core=best[2].to(HOST, dtype))
    if values is not None:
        values = replace(values, down=best[3].to(HOST, values.down.dtype), up=best[4].to(HOST, values.up.dtype))
    objective = "attention output" if checks[0].values is not None else "attention KL"
    return SharedKeyRefinement(refined, kl_before, kl_after, taken, objective, initial, best_loss, values)
