"""One batch of a shared-key refinement: the original attention of its rows (fixed) beside the shared form's, as a
function of the parameters (pure torch: no model, no files).

A batch may hold several layers folded into one: their sequences side by side (layer by layer, the same sequences
and rows in each) and their parameters stacked, so that a step of L layers runs each operator once, not L times. A
step of one SmolLM2 layer is a few hundred operators on small tensors, and on a CPU their count, not their size,
sets its time (docs/benchmarks.md, "Layers refined side by side in one step").
"""

from __future__ import annotations

from functools import cached_property

import torch

from .quadratic_error import QuadraticError, QuadraticTargets, per_layer
from .refinement import MASKED
from .rotary_ops import rotate_half_dims, rotate_slots, slot_coordinates
from .shared_key import HeadGeometry


class AttentionProblem:
    """The original attention of a batch (fixed) and the shared form's, as a function of the parameters.

    With values and the output projection, the loss is the error of the layer's attention output (through the
    output projection, so heads count as much as they reach the residual stream); else the attention KL.

    `layers` L > 1: the batch is L layers' batches of b sequences each, layer by layer (L b sequences), at the same
    positions; their parameters come stacked (L, ...) to `step_loss`, and `slots` (L, W) are each layer's."""

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None,
                 positions: torch.Tensor, row_valid: torch.Tensor, key_valid: torch.Tensor, geometry: HeadGeometry,
                 setting, slots: torch.Tensor, products: torch.dtype = torch.float32,
                 target_output: torch.Tensor | None = None, slot_queries: torch.Tensor | None = None,
                 quadratic: QuadraticTargets | None = None, layers: int = 1):
        """`queries` (L b, H, rows, d) turned by RoPE at `positions` (None where targets are given); `keys` and
        `values` (L b, m, G, d) before it; `target_output` the original attention's output at those rows, or
        `quadratic` what a step's error needs of it (QuadraticError), where known; `slot_queries` the queries'
        slot_coordinates, where already gathered. `positions`, `row_valid` and `key_valid` are one layer's (b)."""
        self.geometry, self.setting, self.slots, self.layers = geometry, setting, slots, layers
        self.products = products  # the dtype of the products that depend on the parameters (the target: float32)
        length = keys.shape[1]
        # RoPE's tables at each kept slot's frequency: the shared key turns by them ((L, 1, m, W) per layer)
        self.key_cos, self.key_sin = setting.cos[:length], setting.sin[:length]
        if slots.dim() == 2:
            self.slot_cos, self.slot_sin = (t[:, slots].permute(1, 0, 2)[:, None] for t in (self.key_cos, self.key_sin))
        else:
            self.slot_cos, self.slot_sin = self.key_cos[..., slots], self.key_sin[..., slots]
        self.queries = queries
        if slot_queries is not None:
            self._slot_queries = slot_queries  # the cached property's value, given
        self.raw_keys = keys
        self.keys = keys.flatten(2)  # (L b, m, G d)
        allowed = key_valid[:, None, :].expand(-1, positions.shape[1], -1)
        if setting.causal:
            allowed = allowed & (torch.arange(length, device=keys.device)[None, None, :] <= positions[:, :, None])
        # what every step adds to the scaled scores: MASKED where a key is not seen (b, 1, rows, m), and T5's
        # position bias at each row's own position (b, H, rows, m). One add (masking anew: a tenth of a step); the
        # same for every layer of the batch
        self.mask = torch.zeros(allowed.shape, device=keys.device).masked_fill_(~allowed, MASKED)[:, None]
        if setting.position_bias is not None:
            bias = setting.position_bias[:, :, :length]
            self.mask = self.mask + bias[:, positions.clamp_max(bias.shape[1] - 1)].permute(1, 0, 2, 3)
        self.rows = row_valid.repeat(layers, 1) if layers > 1 else row_valid  # (L b, rows)
        self.valid = self.rows[:, None, :].expand(-1, geometry.num_heads, -1)
        self.values = self.stacked_values = None
        self.quadratic = quadratic
        if values is not None and setting.output_weight is not None:
            self.values = values.transpose(1, 2)  # (L b, G, m, d): a group's heads read them in one product
            self.stacked_values = values.flatten(2)  # (L b, m, G d): what a value latent reads
            if quadratic is not None:
                self.target_output, self.row_energy = None, quadratic.energy * self.rows
            else:
                if target_output is None:
                    with torch.no_grad():
                        target_output = self._output(self.target_p, products=torch.float32)
                self.target_output = target_output
                self.row_energy = (target_output**2).sum(-1) * self.rows
            self.output_energy = float(self.row_energy.sum())

    def let_go_of_original(self) -> AttentionProblem:
        """Drops the original attention (L b, H, rows, m) kept for the KL: computed again if asked. A held-out
        check's problems wait through every step, and their original attention was two fifths of what a SmolLM2
        layer's refinement held."""
        for name in ("_target_scores", "target", "target_p"):
            self.__dict__.pop(name, None)
        return self

    @cached_property
    def _target_scores(self) -> torch.Tensor:
        """The original attention's logits (L b, H, rows, m): a group's heads against its keys in one product."""
        rotated = rotate_half_dims(self.raw_keys.transpose(1, 2), self.key_cos, self.key_sin,
                                   self.geometry.rotary_dim)  # (L b, G, m, d)
        size, heads, rows, dim = self.queries.shape
        grouped = self.queries.reshape(size, rotated.shape[1], -1, dim)
        with torch.no_grad():
            return self._scores((grouped @ rotated.transpose(-1, -2)).reshape(size, heads, rows, -1))

    @cached_property
    def target(self) -> torch.Tensor:
        """The original attention's log-probabilities (L b, H, rows, m)."""
        return torch.log_softmax(self._target_scores, dim=-1)

    @cached_property
    def target_p(self) -> torch.Tensor:
        return torch.softmax(self._target_scores, dim=-1)

    def _scores(self, products: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """q.k (L b, H, rows, m) as the layer turns it into attention logits: scaled (unless `scaled` already),
        soft-capped, masked and biased."""
        scores = products if scaled else products * self.setting.scaling
        if self.setting.softcap:
            scores = torch.tanh(scores / self.setting.softcap) * self.setting.softcap
        return (scores.view(self.layers, -1, *scores.shape[1:]) + self.mask).view(scores.shape)

    def _output(self, probabilities: torch.Tensor, down: torch.Tensor | None = None,
                up: torch.Tensor | None = None, products: torch.dtype | None = None) -> torch.Tensor:
        """The layer's output (L b, rows, D) in the products' dtype, its products in `products` (None: the
        problem's own)."""
        dtype = products or self.products  # (no row is all -inf: the mask is finite, MASKED)
        read = self._read(probabilities, down, up, dtype)
        return per_layer(read.to(dtype), self.setting.output_weight.transpose(-1, -2).to(dtype), self.layers)

    def _read(self, probabilities: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
        """What the heads read, side by side (L b, rows, H d): the output projection's input. With a value latent
        (down (L, W, G d), up (L, H, d, W)), every head averages the latent and reads its group's values back
        through `up`."""

        def product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            return self._product(left, right, dtype)

        size, heads, rows, length = probabilities.shape
        if down is None:  # the heads of a group side by side, against their group's values: no copy per head
            grouped = probabilities.reshape(size, self.values.shape[1], -1, length)
            read = product(grouped, self.values).reshape(size, heads, rows, -1).transpose(1, 2)  # (L b, rows, H, d)
            return read.flatten(2)
        # every head's rows against the one latent, then each head's up-projection on all its rows: two plain
        # batched products (broadcasting the latent over heads, or the up-projections over sequences, copied them
        # for every step's forward and summed them back in its backward)
        layers = self.layers
        latent = per_layer(self.stacked_values.to(dtype), down.transpose(-1, -2).to(dtype), layers)  # (L b, m, W)
        averaged = product(probabilities.reshape(size, heads * rows, length), latent)  # (L b, H rows, W)
        averaged = averaged.view(layers, -1, heads, rows, averaged.shape[-1]).transpose(1, 2)
        read = product(averaged.reshape(layers, heads, -1, averaged.shape[-1]), up.transpose(-1, -2))
        return read.view(layers, heads, -1, rows, read.shape[-1]).permute(0, 2, 3, 1, 4).reshape(size, rows, -1)

    def _product(self, left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """left @ right in `dtype` (None: the problem's products), the result left in it: each product's result is
        the next one's operand, or reaches float32 in the elementwise step after it (a mask's add, the error's
        subtraction); a cast to float32 and back between them was a copy each."""
        dtype = dtype or self.products
        return left.to(dtype) @ right.to(dtype)

    @cached_property
    def _slot_queries(self) -> torch.Tensor:
        """The rotated queries' slot_coordinates, (L b, H, rows, 2W + p)."""
        return slot_coordinates(self.queries, self.slots, self.geometry.rotary_dim)

    def _shared_scores(self, mixing: torch.Tensor, core: torch.Tensor, pass_core: torch.Tensor) -> torch.Tensor:
        """The shared form's scaled q.k, (L b, H, rows, m), from each layer's parameters stacked (L, ...). A query's
        slot is its frequency's complex coordinate times the head's complex core (a scalar per frequency commutes
        with RoPE), the scale folded into the cores: a few products on the gathered queries, where one real matrix
        per head took a product per head and a sixth of a step to assemble and transpose."""
        layers, keys = self.layers, self.keys
        size, length = keys.shape[:2]
        # rotated in float32, then rounded once for the scores' product
        shared_key = per_layer(keys.to(self.products), mixing.transpose(-1, -2).to(self.products), layers).float()
        shared_key = rotate_slots(shared_key.view(layers, -1, length, shared_key.shape[-1]), self.slot_cos,
                                  self.slot_sin).view(size, length, -1)  # (L b, m, K)
        width, queries = core.shape[-1], self._slot_queries
        heads, rows = queries.shape[1:3]
        queries = queries.view(layers, -1, heads, rows, queries.shape[-1])
        real, imaginary = queries[..., :width], queries[..., width:2 * width]
        core = core * self.setting.scaling
        core_real, core_imaginary = core[:, None, :, 0, None, :], core[:, None, :, 1, None, :]  # (L, 1, H, 1, W)
        parts = [real * core_real - imaginary * core_imaginary, real * core_imaginary + imaginary * core_real]
        if pass_core.shape[-1]:
            parts.append(queries[..., 2 * width:] @ (pass_core * self.setting.scaling)[:, None])
        # every head against the one shared key in a single product per sequence: no per-head copy of the key
        shared_query = torch.cat(parts, dim=-1).reshape(size, heads * rows, -1)
        products = self._product(shared_query, shared_key.transpose(1, 2)).view(size, heads, rows, -1)
        # the mask's add takes the products to float32 in the same pass (soft-capping wants them there first)
        return self._scores(products.float() if self.setting.softcap else products, scaled=True)

    def _attention(self, *stacked: torch.Tensor) -> torch.Tensor:
        # softmax itself, not exp of log-probabilities: exp is slow on the masked keys' -inf, a twentieth of a step
        return torch.softmax(self._shared_scores(*stacked), dim=-1)

    def step_loss(self, mixing, core, pass_core, down=None, up=None) -> torch.Tensor:
        """What Adam's steps minimise: the sum over the batch's layers of each one's objective over its own
        normaliser (the parameters stacked (L, ...)). Each layer's gradient is then its own alone."""
        if self.values is None:  # the KL's normaliser, the real (head, query) rows, is the same in every layer
            return self.kl_sum(torch.log_softmax(self._shared_scores(mixing, core, pass_core), dim=-1)) / max(
                float(self.valid.sum()) / self.layers, 1e-30)
        energy = self.row_energy.view(self.layers, -1).sum(-1).clamp_min(1e-30)  # each layer's normaliser
        weights = self.rows / energy.repeat_interleave(self.rows.shape[0] // self.layers)[:, None]
        return self._output_error(self._attention(mixing, core, pass_core), down, up, weights)

    # One layer's parameters in their own shapes, as the held-out checks and the tests read them

    def predicted(self, mixing: torch.Tensor, core: torch.Tensor, pass_core: torch.Tensor) -> torch.Tensor:
        """The shared form's attention log-probabilities (B, H, rows, m)."""
        return torch.log_softmax(self._shared_scores(mixing[None], core[None], pass_core[None]), dim=-1)

    def kl_sum(self, predicted: torch.Tensor) -> torch.Tensor:
        kl = (self.target_p * (self.target - predicted)).nan_to_num(0.0).sum(-1)
        return kl[self.valid].sum()

    def loss(self, mixing, core, pass_core, down=None, up=None) -> tuple[torch.Tensor, float]:
        """(the objective's sum over this batch, its normaliser)."""
        if self.values is None:
            return self.kl_sum(self.predicted(mixing, core, pass_core)), float(self.valid.sum())
        return self.output_error(self.attention(mixing, core, pass_core), down, up), self.output_energy

    def attention(self, mixing: torch.Tensor, core: torch.Tensor, pass_core: torch.Tensor) -> torch.Tensor:
        """The shared form's attention probabilities (B, H, rows, m)."""
        return self._attention(mixing[None], core[None], pass_core[None])

    def output_error(self, probabilities: torch.Tensor, down=None, up=None) -> torch.Tensor:
        """The squared error of the layer's output from these attention probabilities, summed over the rows."""
        return self._output_error(probabilities, None if down is None else down[None], None if up is None else up[None],
                                  self.rows)

    def _output_error(self, probabilities: torch.Tensor, down, up, weights: torch.Tensor) -> torch.Tensor:
        """The squared error of the output, summed over the rows with these weights (L b, rows)."""
        if self.quadratic is not None:  # for Adam's steps: the gradient for one product with the projection
            read, quadratic = self._read(probabilities, down, up, self.products), self.quadratic
            return (QuadraticError.apply(read, quadratic.gram, quadratic.back, weights, self.layers)
                    + float((self.row_energy * weights).sum()))
        error = ((self._output(probabilities, down, up) - self.target_output) ** 2).sum(-1)
        # a product with the rows' 0/1 weights, not a boolean index: that gathers, and its backward scatters
        return (error * weights).sum()
