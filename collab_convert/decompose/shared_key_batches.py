"""Calibration sequences of one shared-key layer as the refinement's batches (pure torch: no model, no files).

The sequences are stacked once (queries turned by RoPE, keys, values, and the original attention's output where
known); a batch gathers the rows it needs, and holds the original attention (fixed) beside the shared form's as a
function of the parameters: the attention KL, or the error of the layer's output through its output projection.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..devices import HOST, Device, moved
from .quadratic_error import QuadraticTargets, quadratic_pays
from .rotary_ops import rotate_half_dims, slot_coordinates
from .shared_key import HeadGeometry
from .shared_key_attention import AttentionProblem

# Sequences turned by RoPE at a time while stacking: their float32 copies are the stacking's transient memory (32
# SmolLM2 sequences were 9 MB a copy, several copies at once)
BLOCK = 8


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


def _operands(record: torch.dtype, products: torch.dtype) -> torch.dtype:
    """The dtype keys and values wait in where the targets are known: only a step's operands then, cast as it gathers
    them. The products' dtype where that is narrower than float32, else the record's own where that is (float16
    keeps them exactly, in half of float32's bytes: 23 MB less a layer of a GPT-2-medium shape at 32 sequences of
    128), else float32."""
    if products != torch.float32:
        return products
    return record if record.itemsize < 4 else torch.float32


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
        self.layers = 1  # layers folded side by side (folded())
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
        # record's own dtype (float16: the targets exactly as recorded) and reach float32 as a step gathers them; so
        # do queries no rotation turns (their slot coordinates are the recorded numbers) where keys do (_operands)
        narrow = products != torch.float32 and recorded
        record, operands = samples[0].keys.dtype, _operands(samples[0].keys.dtype, products)
        if recorded:  # with the targets known, the original attention is never computed again: no queries kept
            self.queries = None
            self.slot_queries = self._turned_slots(samples, stacked, slots, samples[0].queries.dtype if narrow or (
                not geometry.rotary_dim and operands == record) else torch.float32)
        else:
            self.queries = self._turned(stacked("queries"))  # (S, n, H, d)
            # what a step's shared query reads: gathering a batch's slots from its rows took 4% of a SmolLM2 step
            self.slot_queries = slot_coordinates(self.queries, slots, geometry.rotary_dim)  # (S, n, H, 2W + p)
        self.keys = stacked("keys", operands if recorded else torch.float32)  # (S, m, G, d), before RoPE
        self.values = stacked("values", operands if recorded else torch.float32) if has_values else None
        self.target_output = None
        if recorded:  # recorded by the calibration pass (computing them again took 0.11 s of a SmolLM2 layer's ~2 s)
            self.target_output = stacked("target_output",
                                         samples[0].target_output.dtype if narrow else torch.float32)
        elif targets:
            with torch.no_grad():  # in float32, as every check's target; one problem's attention held at a time
                self.target_output = torch.cat([problem.target_output for problem in self.each_problem(2)])
            self.queries = None
            self.keys, self.values = self.keys.to(operands), self.values.to(operands)
        if self.target_output is not None and products != torch.float32:
            # with targets known, the output projection is only an operand too: kept in the products' dtype
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
        for start in range(0, len(samples), BLOCK):
            part = slot_coordinates(self._turned(stacked("queries", among=samples[start : start + BLOCK])), slots,
                                    self.geometry.rotary_dim)
            if out is None:
                out = torch.zeros(len(samples), int(self.query_lengths.max()), *part.shape[2:], dtype=dtype,
                                  device=part.device)
            out[start : start + len(part), : part.shape[1]] = part
        return out

    @classmethod
    def folded(cls, stacks: list[StackedSequences]) -> StackedSequences:
        """Several layers' stacked sequences as one, for steps that refine the layers side by side: each layer's
        rows one after the other's, taken at the same (sequence, position) draws, each against its own output
        projection. The layers must hold the same sequences (the same lengths) in the same shapes (their slots
        padded alike: decompose/shared_key_refinement.py), with targets known as quadratic forms or outputs. Each
        stack's tensors are let go as they are joined."""
        first = stacks[0]
        out = cls.__new__(cls)
        out.geometry, out.layers = first.geometry, len(stacks)
        out.query_lengths, out.key_lengths = first.query_lengths, first.key_lengths
        out.slots = torch.stack([stack.slots for stack in stacks])  # (L, W)
        out.queries = None
        weights = [stack.setting.output_weight for stack in stacks]
        out.setting = replace(first.setting, output_weight=None if weights[0] is None else torch.stack(weights))

        def joined(part: str, among=stacks) -> torch.Tensor | None:  # (L S, ...), each part let go once copied
            first = getattr(among[0], part)
            if first is None:
                return None
            size = first.shape[0]
            out_tensor = first.new_empty(len(among) * size, *first.shape[1:])
            first = None
            for index, stack in enumerate(among):
                out_tensor[index * size : (index + 1) * size] = getattr(stack, part)
                setattr(stack, part, None)
            return out_tensor

        out.slot_queries, out.keys, out.values = joined("slot_queries"), joined("keys"), joined("values")
        out.target_output = joined("target_output")
        quadratics = [stack.quadratic for stack in stacks]
        out.quadratic = None if quadratics[0] is None else QuadraticTargets(
            torch.stack([q.gram for q in quadratics]), joined("back", quadratics), joined("energy", quadratics))
        for stack in stacks:
            stack.quadratic = None
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
        # every layer's copy of the chosen sequences: layer l's sequence i is stacked at l S + i
        every = (torch.arange(self.layers, device=chosen.device)[:, None] * len(self) + chosen).flatten()
        if picks is None:
            positions = torch.arange(self.slot_queries.shape[1], device=chosen.device).expand(len(chosen), -1)
            row_valid = positions < self.query_lengths[chosen][:, None]
        else:
            positions, row_valid = (t.to(chosen.device) for t in picks)
        length = int(lengths.max())
        key_valid = torch.arange(length, device=chosen.device)[None, :] < lengths[:, None]
        # index_select on flattened (sequence, position) rows: 4-9x faster on a CPU than advanced indexing
        rows = (every[:, None] * self.slot_queries.shape[1] + positions.repeat(self.layers, 1)).flatten()

        def gathered(stacked: torch.Tensor) -> torch.Tensor:  # (B, rows, ...)
            return stacked.flatten(0, 1).index_select(0, rows).view(len(every), positions.shape[1], *stacked.shape[2:])

        # rows kept in a narrower dtype (see __init__) reach float32 here: the error's subtraction and the cores'
        # elementwise products stay in float32
        target = gathered(self.target_output).float() if self.target_output is not None else None
        queries = gathered(self.queries).transpose(1, 2) if self.queries is not None else None
        quadratic = self.quadratic.gathered(gathered) if self.quadratic is not None else None
        return AttentionProblem(queries, self.keys[:, :length].index_select(0, every),
                                self.values[:, :length].index_select(0, every) if self.values is not None else None,
                                positions, row_valid, key_valid, self.geometry, self.setting, self.slots, products,
                                target, gathered(self.slot_queries).float().transpose(1, 2), quadratic, self.layers)

    def problems(self, size: int = 8) -> list[AttentionProblem]:
        """Every sequence at every position, `size` sequences a problem."""
        return list(self.each_problem(size))

    def each_problem(self, size: int = 8) -> Iterator[AttentionProblem]:
        """problems(), each made as it is asked for: a problem keeps its original attention (a few MB per
        sequence), so where each is used once, only one is held (not all 34 of SmolLM2's 270 sequences)."""
        for start in range(0, len(self), size):
            yield self.problem(torch.arange(start, min(start + size, len(self))))
