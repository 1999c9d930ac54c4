"""Calibration sequences of one shared-key layer as the refinement's batches (pure torch: no model, no files).

The sequences are stacked once (queries turned by RoPE, keys, values, and the original attention's output where
known); a batch gathers the rows it needs, and holds the original attention (fixed) beside the shared form's as a
function of the parameters: the attention KL, or the error of the layer's output through its output projection.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from ..devices import HOST, Device, moved
from .refinement import MASKED
from .quadratic_error import QuadraticError, QuadraticTargets, quadratic_pays
from .rotary_ops import rotate_half_dims, rotate_slots, slot_coordinates
from .shared_key import HeadGeometry


@dataclass
class SharedKeySample:
    """One calibration sequence at one layer: queries (n, N_h, d) and keys (n, G, d) after norms, before RoPE."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor | None = None  # (n, G, d): with them, refinement matches the attention's output
    # (n, D): that output through the output projection (its bias left out), as the model computed it in the
    # calibration pass; where every sample has it, refinement need not compute it again
    target_output: torch.Tensor | None = None


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

    def on(self, device: Device) -> AttentionSetting:
        """The same setting with its tables on `device`."""
        return replace(self, **moved({"cos": self.cos, "sin": self.sin, "output_weight": self.output_weight,
                                      "position_bias": self.position_bias}, device))


class StackedSequences:
    """Calibration sequences stacked once, where the steps run: the queries turned by RoPE at their positions,
    the keys and values as the layer reads them, and (`targets`) the original attention's output at every
    position. A step then only gathers its rows (padding and recomputing them per step was a third of the time)."""

    def __init__(self, samples: list[SharedKeySample], geometry: HeadGeometry, setting: AttentionSetting,
                 slots: torch.Tensor, device: Device = HOST, targets: bool = False,
                 products: torch.dtype = torch.float32, consume: bool = False, for_steps: bool = False):
        """`consume`: each sample's tensors are let go once stacked (not read again), so the calibration record
        and its stacked copy are not both held. `for_steps`: for Adam's steps, which read the gradient, not the
        loss (QuadraticError)."""
        self.geometry, self.setting, self.slots, self.quadratic = geometry, setting, slots, None
        # queries and keys may differ in length (encoder-decoder attention reads another sequence's keys)
        self.query_lengths = torch.tensor([sample.queries.shape[0] for sample in samples], device=device)
        self.key_lengths = torch.tensor([sample.keys.shape[0] for sample in samples], device=device)
        has_values = samples[0].values is not None

        def stacked(part: str, dtype=torch.float32, among=samples) -> torch.Tensor:  # (S, n, heads, d), zero-padded
            first = getattr(among[0], part)
            out = torch.zeros(len(among), max(getattr(sample, part).shape[0] for sample in among), *first.shape[1:],
                              dtype=dtype)
            for i, sample in enumerate(among):
                out[i, : getattr(sample, part).shape[0]] = getattr(sample, part)
                if consume:
                    setattr(sample, part, None)
            return out.to(device)

        # targets are the layer's output, which needs the values and the output projection
        targets = targets and has_values and setting.output_weight is not None
        recorded = targets and all(sample.target_output is not None for sample in samples)
        # Where the steps' products round to a narrower dtype anyway, the rows they gather wait in the calibration
        # record's own dtype (float16: the targets exactly as recorded) and reach float32 as a step gathers them;
        # keys and values, only operands then, wait in the products' dtype
        narrow = products != torch.float32 and recorded
        if recorded:  # with the targets known, the original attention is never computed again: no queries kept
            self.queries = None
            self.slot_queries = self._turned_slots(samples, stacked, slots,
                                                   samples[0].queries.dtype if narrow else torch.float32)
        else:
            self.queries = self._turned(stacked("queries"))  # (S, n, H, d)
            # what a step's shared query reads: gathering a batch's slots from its rows took 4% of a SmolLM2 step
            self.slot_queries = slot_coordinates(self.queries, slots, geometry.rotary_dim)  # (S, n, H, 2W + p)
        operands = products if narrow else torch.float32
        self.keys = stacked("keys", operands)  # (S, m, G, d), before RoPE
        self.values = stacked("values", operands) if has_values else None
        self.target_output = None
        if recorded:  # recorded by the calibration pass (computing them again took 0.11 s of a SmolLM2 layer's ~2 s)
            self.target_output = stacked("target_output",
                                         samples[0].target_output.dtype if narrow else torch.float32)
        elif targets:
            with torch.no_grad():  # in float32, as every check's target; one problem's attention held at a time
                self.target_output = torch.cat([problem.target_output for problem in self.each_problem(2)])
            self.queries = None
        if self.target_output is not None and products != torch.float32:
            # with targets known, keys, values and output projection are only operands: kept in the products' dtype
            self.keys, self.values = self.keys.to(products), self.values.to(products)
            self.setting = replace(setting, output_weight=setting.output_weight.to(products))
        if self.target_output is not None and for_steps and quadratic_pays(setting.output_weight):
            # a step's error reads only T W and |T|^2 of the targets (QuadraticError)
            self.quadratic = QuadraticTargets.of(self.target_output, setting.output_weight, products)
            self.target_output = None

    def _turned(self, queries: torch.Tensor) -> torch.Tensor:
        """Stacked queries (S, n, H, d) turned by RoPE at their positions."""
        cos, sin = self.setting.cos[: queries.shape[1]], self.setting.sin[: queries.shape[1]]
        return rotate_half_dims(queries.transpose(1, 2), cos, sin, self.geometry.rotary_dim).transpose(1, 2)

    def _turned_slots(self, samples: list[SharedKeySample], stacked, slots: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """The turned queries' slot coordinates (S, n, H, 2W + p) in `dtype`, a few sequences at a time: the whole
        set's float32 queries, turned and gathered, were three copies of 80 MB at once on a SmolLM2 layer."""
        out = None
        for start in range(0, len(samples), 32):
            part = slot_coordinates(self._turned(stacked("queries", among=samples[start : start + 32])), slots,
                                    self.geometry.rotary_dim)
            if out is None:
                out = torch.zeros(len(samples), int(self.query_lengths.max()), *part.shape[2:], dtype=dtype,
                                  device=part.device)
            out[start : start + len(part), : part.shape[1]] = part
        return out

    def __len__(self) -> int:
        return self.key_lengths.shape[0]

    def problem(self, chosen: torch.Tensor, picks: tuple[torch.Tensor, torch.Tensor] | None = None,
                products: torch.dtype = torch.float32) -> AttentionProblem:
        """Sequences `chosen` at query positions `picks`: (positions, which are real), both (B, rows), as
        refinement.drawn_rows gives them (None: every position up to the longest query sequence of the set); keys
        up to the longest chosen one."""
        chosen = chosen.to(self.key_lengths.device)
        lengths = self.key_lengths[chosen]
        if picks is None:
            positions = torch.arange(self.slot_queries.shape[1], device=chosen.device).expand(len(chosen), -1)
            row_valid = positions < self.query_lengths[chosen][:, None]
        else:
            positions, row_valid = (t.to(chosen.device) for t in picks)
        length = int(lengths.max())
        key_valid = torch.arange(length, device=chosen.device)[None, :] < lengths[:, None]
        # index_select on flattened (sequence, position) rows: 4-9x faster on a CPU than advanced indexing
        rows = (chosen[:, None] * self.slot_queries.shape[1] + positions).flatten()

        def gathered(stacked: torch.Tensor) -> torch.Tensor:  # (B, rows, ...)
            return stacked.flatten(0, 1).index_select(0, rows).view(*positions.shape, *stacked.shape[2:])

        # rows kept in a narrower dtype (see __init__) reach float32 here: the error's subtraction and the cores'
        # elementwise products stay in float32
        target = gathered(self.target_output).float() if self.target_output is not None else None
        queries = gathered(self.queries).transpose(1, 2) if self.queries is not None else None
        quadratic = self.quadratic.gathered(gathered) if self.quadratic is not None else None
        return AttentionProblem(queries, self.keys[:, :length].index_select(0, chosen),
                                self.values[:, :length].index_select(0, chosen) if self.values is not None else None,
                                positions, row_valid, key_valid, self.geometry, self.setting, self.slots, products,
                                target, gathered(self.slot_queries).float().transpose(1, 2), quadratic)

    def problems(self, size: int = 8) -> list[AttentionProblem]:
        """Every sequence at every position, `size` sequences a problem."""
        return list(self.each_problem(size))

    def each_problem(self, size: int = 8) -> Iterator[AttentionProblem]:
        """problems(), each made as it is asked for: a problem keeps its original attention (a few MB per
        sequence), so where each is used once, only one is held (not all 34 of SmolLM2's 270 sequences)."""
        for start in range(0, len(self), size):
            yield self.problem(torch.arange(start, min(start + size, len(self))))


class AttentionProblem:
    """The original attention of a batch (fixed) and the shared form's, as a function of the parameters.

    With values and the output projection, the loss is the error of the layer's attention output (through the
    output projection, so heads count as much as they reach the residual stream); else the attention KL."""

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None,
                 positions: torch.Tensor, row_valid: torch.Tensor, key_valid: torch.Tensor, geometry: HeadGeometry,
                 setting: AttentionSetting, slots: torch.Tensor, products: torch.dtype = torch.float32,
                 target_output: torch.Tensor | None = None, slot_queries: torch.Tensor | None = None,
                 quadratic: QuadraticTargets | None = None):
        """`queries` (B, H, rows, d) turned by RoPE at `positions` (None where targets are given); `keys` and
        `values` (B, m, G, d) before it; `target_output` the original attention's output at those rows, or
        `quadratic` what a step's error needs of it (QuadraticError), where known; `slot_queries` the queries'
        slot_coordinates, where already gathered."""
        self.geometry, self.setting, self.slots = geometry, setting, slots
        self.products = products  # the dtype of the products that depend on the parameters (the target: float32)
        length = keys.shape[1]
        # RoPE's tables at each kept slot's frequency: the shared key turns by them
        self.key_cos, self.key_sin = setting.cos[:length], setting.sin[:length]
        self.slot_cos, self.slot_sin = self.key_cos[..., slots], self.key_sin[..., slots]
        self.queries = queries
        if slot_queries is not None:
            self._slot_queries = slot_queries  # the cached property's value, given
        self.raw_keys = keys
        self.keys = keys.flatten(2)  # (B, m, G d)
        allowed = key_valid[:, None, :].expand(-1, positions.shape[1], -1)
        if setting.causal:
            allowed = allowed & (torch.arange(length, device=keys.device)[None, None, :] <= positions[:, :, None])
        # what every step adds to the scaled scores: MASKED where a key is not seen (B, 1, rows, m), and T5's
        # position bias at each row's own position (B, H, rows, m). One add (masking anew: a tenth of a step).
        self.mask = torch.zeros(allowed.shape, device=keys.device).masked_fill_(~allowed, MASKED)[:, None]
        if setting.position_bias is not None:
            bias = setting.position_bias[:, :, :length]
            self.mask = self.mask + bias[:, positions.clamp_max(bias.shape[1] - 1)].permute(1, 0, 2, 3)
        self.rows = row_valid
        self.valid = row_valid[:, None, :].expand(-1, geometry.num_heads, -1)
        self.values = self.stacked_values = None
        self.quadratic = quadratic
        if values is not None and setting.output_weight is not None:
            self.values = values.transpose(1, 2)  # (B, G, m, d): a group's heads read them in one product
            self.stacked_values = values.flatten(2)  # (B, m, G d): what a value latent reads
            if quadratic is not None:
                self.target_output, self.output_energy = None, float((quadratic.energy * self.rows).sum())
            else:
                if target_output is None:
                    with torch.no_grad():
                        target_output = self._output(self.target_p, products=torch.float32)
                self.target_output = target_output
                self.output_energy = float(((target_output**2).sum(-1) * self.rows).sum())

    @cached_property
    def _target_scores(self) -> torch.Tensor:
        """The original attention's logits (B, H, rows, m): a group's heads against its keys in one product."""
        rotated = rotate_half_dims(self.raw_keys.transpose(1, 2), self.key_cos, self.key_sin,
                                   self.geometry.rotary_dim)  # (B, G, m, d)
        size, heads, rows, dim = self.queries.shape
        grouped = self.queries.reshape(size, rotated.shape[1], -1, dim)
        with torch.no_grad():
            return self._scores((grouped @ rotated.transpose(-1, -2)).reshape(size, heads, rows, -1))

    @cached_property
    def target(self) -> torch.Tensor:
        """The original attention's log-probabilities (B, H, rows, m)."""
        return torch.log_softmax(self._target_scores, dim=-1)

    @cached_property
    def target_p(self) -> torch.Tensor:
        return torch.softmax(self._target_scores, dim=-1)

    def _scores(self, products: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """q.k as the layer turns it into attention logits: scaled (unless `scaled` already), soft-capped, masked
        and biased."""
        scores = products if scaled else products * self.setting.scaling
        if self.setting.softcap:
            scores = torch.tanh(scores / self.setting.softcap) * self.setting.softcap
        return scores + self.mask

    def _output(self, probabilities: torch.Tensor, down: torch.Tensor | None = None,
                up: torch.Tensor | None = None, products: torch.dtype | None = None) -> torch.Tensor:
        """The layer's output (B, rows, D) in the products' dtype, its products in `products` (None: the
        problem's own)."""
        dtype = products or self.products  # (no row is all -inf: the mask is finite, MASKED)
        return self._product(self._read(probabilities, down, up, dtype), self.setting.output_weight.T, dtype)

    def _read(self, probabilities: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
        """What the heads read, side by side (B, rows, H d): the output projection's input. With a value latent,
        every head averages the latent and reads its group's values back through `up`."""

        def product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            return self._product(left, right, dtype)

        size, heads, rows, length = probabilities.shape
        if down is None:  # the heads of a group side by side, against their group's values: no copy per head
            grouped = probabilities.reshape(size, self.values.shape[1], -1, length)
            read = product(grouped, self.values).reshape(size, heads, rows, -1).transpose(1, 2)  # (B, rows, H, d)
        else:
            # every head's rows against the one latent, then each head's up-projection on all its rows: two plain
            # batched products (broadcasting the latent over heads, or the up-projections over sequences, copied
            # them for every step's forward and summed them back in its backward)
            latent = product(self.stacked_values, down.T)  # (B, m, W)
            averaged = product(probabilities.reshape(size, heads * rows, length), latent)  # (B, H rows, W)
            averaged = averaged.view(size, heads, rows, -1).transpose(0, 1).reshape(heads, size * rows, -1)
            read = product(averaged, up.transpose(-1, -2)).view(heads, size, rows, -1).permute(1, 2, 0, 3)
        return read.flatten(2)

    def _product(self, left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """left @ right in `dtype` (None: the problem's products), the result left in it: each product's result is
        the next one's operand, or reaches float32 in the elementwise step after it (a mask's add, the error's
        subtraction); a cast to float32 and back between them was a copy each."""
        dtype = dtype or self.products
        return left.to(dtype) @ right.to(dtype)

    @cached_property
    def _slot_queries(self) -> torch.Tensor:
        """The rotated queries' slot_coordinates, (B, H, rows, 2W + p)."""
        return slot_coordinates(self.queries, self.slots, self.geometry.rotary_dim)

    def _shared_scores(self, mixing: torch.Tensor, core: torch.Tensor, pass_core: torch.Tensor) -> torch.Tensor:
        """The shared form's scaled q.k, (B, H, rows, m). A query's slot is its frequency's complex coordinate
        times the head's complex core (a scalar per frequency commutes with RoPE), the scale folded into the
        cores: a few products on the gathered queries, where one real matrix per head took a product per head
        and a sixth of a step to assemble and transpose."""
        # rotated in float32, then rounded once for the scores' product
        shared_key = rotate_slots(self._product(self.keys, mixing.T).float(), self.slot_cos, self.slot_sin)  # (B, m, K)
        width, queries = core.shape[-1], self._slot_queries
        size, heads, rows, _ = queries.shape
        real, imaginary = queries[..., :width], queries[..., width:2 * width]
        core = core * self.setting.scaling
        core_real, core_imaginary = core[:, 0, None, :], core[:, 1, None, :]  # (H, 1, W)
        parts = [real * core_real - imaginary * core_imaginary, real * core_imaginary + imaginary * core_real]
        if pass_core.shape[-1]:
            parts.append(queries[..., 2 * width:] @ (pass_core * self.setting.scaling))
        # every head against the one shared key in a single product per sequence: no per-head copy of the key
        shared_query = torch.cat(parts, dim=-1).reshape(size, heads * rows, -1)
        products = self._product(shared_query, shared_key.transpose(1, 2)).view(size, heads, rows, -1)
        # the mask's add takes the products to float32 in the same pass (soft-capping wants them there first)
        return self._scores(products.float() if self.setting.softcap else products, scaled=True)

    def predicted(self, mixing: torch.Tensor, core: torch.Tensor, pass_core: torch.Tensor) -> torch.Tensor:
        """The shared form's attention log-probabilities (B, H, rows, m)."""
        return torch.log_softmax(self._shared_scores(mixing, core, pass_core), dim=-1)

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
        # softmax itself, not exp of log-probabilities: exp is slow on the masked keys' -inf, a twentieth of a step
        return torch.softmax(self._shared_scores(mixing, core, pass_core), dim=-1)

    def output_error(self, probabilities: torch.Tensor, down=None, up=None) -> torch.Tensor:
        """The squared error of the layer's output from these attention probabilities, summed over the rows."""
        if self.quadratic is not None:  # for Adam's steps: the gradient for one product with the projection
            read, quadratic = self._read(probabilities, down, up, self.products), self.quadratic
            return QuadraticError.apply(read, quadratic.gram, quadratic.back, self.rows) + self.output_energy
        error = ((self._output(probabilities, down, up) - self.target_output) ** 2).sum(-1)
        # a product with the rows' 0/1 weights, not a boolean index: that gathers, and its backward scatters
        return (error * self.rows).sum()
