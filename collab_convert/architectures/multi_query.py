"""How a rotary decoder's attention is laid out as stock multi-query attention: the ONE reader and writer of the
multi-query form's tensors, in the family's own names, so that the output is a checkpoint of the same family.

The form replaces the query, key, value and output projections of each attention layer (the output projection's
bias, where there is one, stays): one key/value head of width W, and N_h query heads of width W. A family whose own
config cannot hold that shape is written as the closest stock family that can (StockFamily: Phi-3 as Llama, its
fused projections split; as Mistral where it has a sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..io.headers import TensorSpec
from ..io.reader import TensorReader
from ..io.writer import Passed
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
class StockFamily:
    """The stock family a model is written as where its own config cannot hold one wider key/value head: its
    model_type (another where the model has a sliding window), the class-name prefix its architectures take, fused
    tensors it splits into equal row blocks, and config keys it drops or adds."""

    model_type: str
    class_prefix: tuple[str, str]  # (the model's, the stock family's): "Phi3ForCausalLM" -> "LlamaForCausalLM"
    splits: tuple[tuple[str, tuple[str, ...]], ...] = ()  # name suffix -> the suffixes of its row blocks
    dropped: tuple[str, ...] = ()
    added: tuple[tuple[str, object], ...] = ()
    windowed: tuple[str, tuple[str, str]] | None = None  # (model_type, class prefix) with a sliding window

    def config(self, config: dict) -> dict:
        windowed = self.windowed if self.windowed and config.get("sliding_window") else None
        model_type, (old, new) = windowed if windowed else (self.model_type, self.class_prefix)
        written = {key: value for key, value in config.items()
                   if key not in self.dropped and (windowed or key != "sliding_window")}
        written.update(dict(self.added), model_type=model_type)
        written["architectures"] = [name.replace(old, new, 1) for name in config.get("architectures") or []]
        return written


# Phi-3's config checks RoPE factors against hidden_size / num_attention_heads, not head_dim; Llama's (Mistral's, with
# a sliding window) is Phi-3's own computation with q/k/v and gate/up unfused.
PHI3_AS_LLAMA = StockFamily(
    model_type="llama", class_prefix=("Phi3", "Llama"),
    splits=(("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),),
    dropped=("embd_pdrop", "resid_pdrop", "original_max_position_embeddings", "partial_rotary_factor", "auto_map"),
    added=(("attention_bias", False), ("mlp_bias", False)),
    windowed=("mistral", ("Phi3", "Mistral")),
)


@dataclass(frozen=True)
class MultiQueryProjections(SharedKeyProjections):
    """A rotary decoder's projections (the shared-key layout's names), read whole and written back in stock
    multi-query shapes: in its own family, or `written_as` another (separate q/k/v projections, then)."""

    written_as: StockFamily | None = None
    written_names: tuple[str, str, str] = field(default=("q_proj", "k_proj", "v_proj"))

    def passing(self, name: str, spec: TensorSpec) -> list[Passed]:
        """How a tensor outside the attention layers is written: unchanged, or split as the stock family wants."""
        for suffix, parts in self.written_as.splits if self.written_as else ():
            if name.endswith(suffix):
                rows = spec.shape[0] // len(parts)
                return [Passed(name[: -len(suffix)] + part, i * rows, (i + 1) * rows) for i, part in enumerate(parts)]
        return [Passed(name)]

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
        query, key, value = self._names()
        rows = {query: heads * width, key: width, value: width}
        if self.fused and not self.written_as:
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
        parts = dict(zip(self._names(), (query, key, value), strict=True))
        if self.fused and not self.written_as:
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

    def _names(self) -> tuple[str, str, str]:
        """The written query, key and value projections' names (a fused family written as another splits them)."""
        return self.written_names if self.fused else (self.query, self.key, self.value)
