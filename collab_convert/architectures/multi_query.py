"""How a rotary decoder's attention is laid out as stock multi-query attention: the ONE reader and writer of the
multi-query form's tensors, in the family's own names, so that the output is a checkpoint of the same family.

The form replaces the query, key, value and output projections of each attention layer (the output projection's
bias, where there is one, stays): one key/value head of width W, and N_h query heads of width W. A fused
projection (Phi-3's qkv_proj) is written fused again, [queries | key | value].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..io.headers import TensorSpec
from ..io.reader import TensorReader
from .layouts import AttentionLayer, finite
from .shared_key import SharedKeyProjections


@dataclass
class AttentionWeights:
    """One layer's projections in nn.Linear layout, heads major: queries (N_h d, D), keys and values (G d, D), the
    output projection (D, N_h d)."""

    query_weight: torch.Tensor
    query_bias: torch.Tensor | None
    key_weight: torch.Tensor
    key_bias: torch.Tensor | None
    value_weight: torch.Tensor
    value_bias: torch.Tensor | None
    output_weight: torch.Tensor


@dataclass(frozen=True)
class MultiQueryProjections(SharedKeyProjections):
    """A rotary decoder's projections (the shared-key layout's names), read whole and written back in stock
    multi-query shapes."""

    def find(self, reader: TensorReader, prefix: str, heads, causal: bool, config: dict) -> AttentionLayer:
        layer = super().find(reader, prefix, heads, causal, config)
        names = [f"{prefix}.{self.query}", f"{prefix}.{self.key}", f"{prefix}.{self.value}"]
        projections = [f"{prefix}.{self.fused}"] if self.fused else names
        replaced = [f"{name}.{part}" for name in projections for part in ("weight", "bias")
                    if f"{name}.{part}" in reader]
        return replace(layer, anchor=f"{projections[0]}.weight",
                       replaced=replaced + [f"{prefix}.{self.output}.weight"])

    def read_all(self, reader: TensorReader, layer: AttentionLayer) -> AttentionWeights:
        p = layer.prefix

        def optional(name):
            return finite(reader, name) if name in reader else None

        output = finite(reader, f"{p}.{self.output}.weight")
        if self.fused:
            weight, bias = finite(reader, f"{p}.{self.fused}.weight"), optional(f"{p}.{self.fused}.bias")
            (qw, kw, vw), (qb, kb, vb) = self._split(weight, layer), (
                self._split(bias, layer) if bias is not None else (None, None, None))
            return AttentionWeights(qw, qb, kw, kb, vw, vb, output)
        return AttentionWeights(finite(reader, f"{p}.{self.query}.weight"), optional(f"{p}.{self.query}.bias"),
                                finite(reader, f"{p}.{self.key}.weight"), optional(f"{p}.{self.key}.bias"),
                                finite(reader, f"{p}.{self.value}.weight"), optional(f"{p}.{self.value}.bias"),
                                output)

    def stock_specs(self, reader: TensorReader, layer: AttentionLayer, width: int) -> list[TensorSpec]:
        """The tensors a layer of width W writes, in the order they are written, as stock_tensors makes them."""
        p, dtype = layer.prefix, reader.spec(layer.anchor).dtype
        d_in, heads = layer.shape.input_dim, layer.shape.num_heads
        biased = any(name.endswith(".bias") for name in layer.replaced)
        rows = {self.query: heads * width, self.key: width, self.value: width}
        if self.fused:
            rows = {self.fused: heads * width + 2 * width}
        specs = []
        for name, count in rows.items():
            specs.append(TensorSpec(f"{p}.{name}.weight", dtype, (count, d_in)))
            specs += [TensorSpec(f"{p}.{name}.bias", dtype, (count,))] if biased else []
        output = reader.spec(f"{p}.{self.output}.weight")
        return specs + [TensorSpec(f"{p}.{self.output}.weight", output.dtype, (output.shape[0], heads * width))]

    def stock_tensors(self, layer: AttentionLayer, query: tuple, key: tuple, value: tuple,
                      output: torch.Tensor) -> dict[str, torch.Tensor]:
        """Checkpoint tensors from (weight, bias or None) of the new queries, key and value, and the new output
        projection, in stock_specs' order."""
        p = layer.prefix
        parts = {self.query: query, self.key: key, self.value: value}
        if self.fused:
            biases = [bias for _, bias in parts.values()]
            parts = {self.fused: (torch.cat([weight for weight, _ in parts.values()]),
                                  None if biases[0] is None else torch.cat(biases))}
        tensors = {}
        for name, (weight, bias) in parts.items():
            tensors[f"{p}.{name}.weight"] = weight
            if bias is not None:
                tensors[f"{p}.{name}.bias"] = bias
        tensors[f"{p}.{self.output}.weight"] = output
        return tensors
