"""How a family lays out its query and key projections: the ONE reader of that layout.

A layout answers every question that depends on it, for tensors in a checkpoint and for modules in memory:
which tensors make an attention layer, how to read its query/key weights (grouped keys included), what the
collaborative layer writes in their place, how to take the projections off a module, and where calibration
hooks see the inputs. Two layouts cover every family so far:

- SeparateProjections: one Linear for queries and one for keys (BERT's query/key, BART's q_proj/k_proj).
- FusedProjection: one projection holding [queries | keys | values] side by side (GPT-2's Conv1D c_attn,
  GPTBigCode's Linear c_attn); the value part stays as `value_projection`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..decompose.costs import LayerShape
from ..decompose.products import HeadProducts
from ..errors import BadInputError
from ..format import FUSED_VALUE, HeadCounts, LayerFormat
from ..io.headers import TensorSpec
from ..io.reader import TensorReader


@dataclass
class AttentionLayer:
    """One attention module of a checkpoint, found from tensor headers (nothing loaded)."""

    prefix: str  # tensor-name prefix of the attention module, e.g. "encoder.layer.0.attention.self"
    shape: LayerShape
    anchor: str  # the tensor whose place in the file the collaborative tensors take
    replaced: list[str]  # tensors the collaborative form removes
    has_query_bias: bool
    kv_heads: int  # key/value heads: fewer than the query heads under grouped-query attention
    key_input_dim: int  # width of the key-side inputs (the query side's for self-attention)
    causal: bool = False
    # its keys are cached while generating: decoder self-attention and encoder-decoder attention; an
    # encoder-decoder's encoder self-attention runs once over the input and caches nothing
    caches_keys: bool = True
    shared_key: bool = False  # the shared-key form: per-head queries kept, one key shared by all heads
    rotary_dim: int = 0  # rotary families: RoPE's dimensions per head (the shared key is per frequency)

    @property
    def key_rows(self) -> int:
        return self.kv_heads * self.shape.head_dim

    @property
    def full_rank(self) -> int:
        """Where the collaborative form is exact: every head's query/key dimension, or for the rotary shared
        key every key head's numbers (the per-head queries stay)."""
        return self.key_rows if self.shared_key else self.shape.key_dim

    def stores_content_bias(self, calibrated: bool) -> bool:
        """Whether the collaborative layer keeps a content bias: it comes from the query bias, and calibration
        adds what the mean of the query-side inputs does. Without either it is all zeros, and leaving it out
        keeps N_h numbers per token out of a decoder's cache."""
        return self.has_query_bias or calibrated

    def check_rank(self, rank: int) -> None:
        """The one refusal of a rank above the layer's full rank, where the collaborative form is exact."""
        if rank > self.full_rank:
            heads = self.kv_heads if self.shared_key else self.shape.num_heads
            kind = " key" if self.shared_key else ""
            raise BadInputError(
                f"rank {rank} exceeds the full rank of {self.prefix} "
                f"({heads}{kind} heads x {self.shape.head_dim} = {self.full_rank})"
            )


@dataclass
class HeadOutputs:
    """Each QUERY head's value rows (grouped values repeated) and output columns: calibrated fits weigh by them."""

    value_heads: torch.Tensor  # (N_h, d_k, D_key_in)
    output_heads: torch.Tensor  # (N_h, D_out, d_k)


@dataclass
class Projections:
    """One layer's query/key projections in nn.Linear layout, and tensors that replace a fused projection."""

    query_weight: torch.Tensor
    key_weight: torch.Tensor  # one key block per QUERY head (grouped keys repeated)
    query_bias: torch.Tensor | None
    kept: dict[str, torch.Tensor]  # e.g. the value part of GPT-2's c_attn, under its new name

    def products(self, num_heads: int) -> HeadProducts:
        return HeadProducts.from_projections(self.query_weight, self.key_weight, num_heads)


def finite(reader: TensorReader, name: str) -> torch.Tensor:
    tensor = reader.get(name)
    if not torch.isfinite(tensor).all():
        raise BadInputError(f"{name} contains NaN or Inf values; the model's weights are corrupt")
    return tensor


def per_query_head(key_weight: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """Grouped keys repeated so that row block i is the key of query head i."""
    if layer.kv_heads == layer.shape.num_heads:
        return key_weight
    groups = layer.shape.num_heads // layer.kv_heads
    blocks = key_weight.reshape(layer.kv_heads, layer.shape.head_dim, -1)
    return blocks.repeat_interleave(groups, dim=0).reshape(layer.shape.key_dim, -1)


def split_error(name: str, shape, heads: HeadCounts) -> BadInputError:
    grouped = f" and {heads.kv_heads} key/value heads" if heads.kv_heads != heads.num_heads else ""
    return BadInputError(f"{name} has shape {tuple(shape)}, which does not split into {heads.num_heads} heads{grouped}")


def _bias_if_present(reader: TensorReader, name: str) -> list[str]:
    return [name] if name in reader else []


def weight_beside(prefix: str, name: str) -> str:
    """The weight of a module named relative to the attention module ("../" climbs to its parent)."""
    while name.startswith("../"):
        prefix, name = prefix.rpartition(".")[0], name[3:]
    return f"{prefix}.{name}.weight" if prefix else f"{name}.weight"


def split_by_head(reader: TensorReader, layer: AttentionLayer, value: str | None, output: str,
                  conv1d: bool = False) -> bool:
    """From the headers: whether value (N_kv d_k, D_in) and output (D_out, N_h d_k) weights exist and split by
    head as the queries do (`value` None: the values are a fused projection's last third)."""
    if output not in reader or (value is not None and value not in reader):
        return False
    shape = tuple(reader.spec(output).shape)[:: -1 if conv1d else 1]
    values = value is None or len(reader.spec(value).shape) == 2 and reader.spec(value).shape[0] == layer.key_rows
    return values and len(shape) == 2 and shape[1] == layer.shape.key_dim


def split_head_outputs(value_weight: torch.Tensor, output_weight: torch.Tensor, layer: AttentionLayer) -> HeadOutputs:
    """Value (N_kv d_k, D_in) and output (D_out, N_h d_k) Linears split by head."""
    heads, head_dim = layer.shape.num_heads, layer.shape.head_dim
    value_heads = per_query_head(value_weight, layer).reshape(heads, head_dim, -1)
    return HeadOutputs(value_heads, output_weight.reshape(-1, heads, head_dim).transpose(0, 1))


@dataclass(frozen=True)
class SeparateProjections:
    """A query Linear and a key Linear, each (N_h d_k, D_in); keys may have fewer heads (grouped queries). `value`
    and `output`: the value and output Linears (relative names; "../" climbs to the parent module), read to weigh
    the heads in calibrated fits."""

    query: str = "query"
    key: str = "key"
    value: str | None = None
    output: str | None = None

    @property
    def marker(self) -> str:
        return self.query

    # --- checkpoints -------------------------------------------------------------------------------------
    def find(self, reader: TensorReader, prefix: str, heads: HeadCounts, causal: bool,
             config: dict) -> AttentionLayer:
        query_weight, key_weight = f"{prefix}.{self.query}.weight", f"{prefix}.{self.key}.weight"
        if key_weight not in reader:
            raise BadInputError(f"{prefix} has a query projection but no key projection ({key_weight})")
        query_shape, key_shape = reader.spec(query_weight).shape, reader.spec(key_weight).shape
        if len(query_shape) != 2 or query_shape[0] == 0 or query_shape[0] % heads.num_heads:
            raise split_error(query_weight, query_shape, heads)
        head_dim = query_shape[0] // heads.num_heads
        if len(key_shape) != 2 or key_shape[0] == 0 or key_shape[0] % head_dim or heads.num_heads % max(key_shape[0] // head_dim, 1):
            raise split_error(key_weight, key_shape, heads)
        return AttentionLayer(
            prefix=prefix,
            shape=LayerShape(input_dim=query_shape[1], num_heads=heads.num_heads, head_dim=head_dim),
            anchor=query_weight,
            replaced=[query_weight, key_weight, *_bias_if_present(reader, f"{prefix}.{self.query}.bias"),
                      *_bias_if_present(reader, f"{prefix}.{self.key}.bias")],
            has_query_bias=f"{prefix}.{self.query}.bias" in reader,
            kv_heads=key_shape[0] // head_dim,  # from the tensors: the key projection says how many heads it has
            key_input_dim=key_shape[1],
            causal=causal,
        )

    def read(self, reader: TensorReader, layer: AttentionLayer) -> Projections:
        query_bias = f"{layer.prefix}.{self.query}.bias"
        return Projections(
            query_weight=finite(reader, f"{layer.prefix}.{self.query}.weight"),
            key_weight=per_query_head(finite(reader, f"{layer.prefix}.{self.key}.weight"), layer),
            query_bias=finite(reader, query_bias) if query_bias in reader else None,
            kept={},
        )

    def weighs_heads(self, reader: TensorReader, layer: AttentionLayer) -> bool:
        """Whether its value and output weights are named, there, and split by head (headers only)."""
        return bool(self.value and self.output) and split_by_head(reader, layer, *self._head_output_names(layer))

    def _head_output_names(self, layer: AttentionLayer) -> tuple[str, str]:
        return weight_beside(layer.prefix, self.value), weight_beside(layer.prefix, self.output)

    def head_outputs(self, reader: TensorReader, layer: AttentionLayer) -> HeadOutputs:
        """Each head's value rows and output columns, where weighs_heads."""
        return split_head_outputs(*(finite(reader, name) for name in self._head_output_names(layer)), layer)

    def output_specs(self, reader: TensorReader, layer: AttentionLayer, rank: int) -> list[TensorSpec]:
        return _collaborative_specs(reader, layer, rank)

    # --- modules in memory ---------------------------------------------------------------------------------
    def module_dims(self, module: nn.Module, heads: HeadCounts) -> tuple[int, int, torch.Tensor]:
        """(D_in, head size, a weight for device and dtype) of the projections about to be replaced."""
        query = getattr(module, self.query)
        return query.in_features, query.out_features // heads.num_heads, query.weight

    def detach_projections(self, module: nn.Module, heads: HeadCounts) -> None:
        delattr(module, self.query)
        delattr(module, self.key)

    def members(self) -> dict[str, property]:
        """The original forward calls self.<query>(h): hand it the shared query instead (and so on)."""
        return {
            self.query: property(lambda self: self.collaborative_query),
            self.key: property(lambda self: self.collaborative_key),
        }

    def finish(self, module: nn.Module, heads: HeadCounts) -> None:
        pass

    def hook_points(self, module: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """Submodules whose inputs are the query-side and key-side inputs of the attention."""
        return [(getattr(module, self.query), ("query",)), (getattr(module, self.key), ("key",))]


@dataclass(frozen=True)
class FusedProjection:
    """One projection [queries (N_h d_k) | keys (N_kv d_k) | values (N_kv d_k)]. `conv1d`: stored (D_in, D_out) as
    transformers' Conv1D does; otherwise (D_out, D_in) as nn.Linear."""

    name: str
    conv1d: bool = False
    output: str | None = None  # the output projection, in the same layout (read to weigh the heads)

    @property
    def marker(self) -> str:
        return self.name

    def _linear(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.T if self.conv1d else weight

    # --- checkpoints -------------------------------------------------------------------------------------
    def find(self, reader: TensorReader, prefix: str, heads: HeadCounts, causal: bool,
             config: dict) -> AttentionLayer:
        name = f"{prefix}.{self.name}.weight"
        shape = reader.spec(name).shape  # from the header: nothing is loaded until the layer is fitted
        if len(shape) != 2:
            raise split_error(name, shape, heads)
        d_in, width = shape if self.conv1d else shape[::-1]
        head_dim = width // (heads.num_heads + 2 * heads.kv_heads)
        if head_dim == 0 or head_dim * (heads.num_heads + 2 * heads.kv_heads) != width:
            raise split_error(name, shape, heads)
        return AttentionLayer(
            prefix=prefix,
            shape=LayerShape(input_dim=d_in, num_heads=heads.num_heads, head_dim=head_dim),
            anchor=name,
            replaced=[name, *_bias_if_present(reader, f"{prefix}.{self.name}.bias")],
            has_query_bias=f"{prefix}.{self.name}.bias" in reader,
            kv_heads=heads.kv_heads,
            key_input_dim=d_in,
            causal=causal,
        )

    def read(self, reader: TensorReader, layer: AttentionLayer) -> Projections:
        linear = self._linear(finite(reader, layer.anchor))  # (3 widths, D_in)
        width, key_end = layer.shape.key_dim, layer.shape.key_dim + layer.key_rows
        bias_name = f"{layer.prefix}.{self.name}.bias"
        bias = finite(reader, bias_name) if bias_name in reader else None
        kept = {f"{layer.prefix}.{FUSED_VALUE}.weight": self._linear(linear[key_end:]).contiguous()}
        if bias is not None:
            kept[f"{layer.prefix}.{FUSED_VALUE}.bias"] = bias[key_end:].contiguous()
        return Projections(
            query_weight=linear[:width],
            key_weight=per_query_head(linear[width:key_end], layer),
            query_bias=bias[:width] if bias is not None else None,
            kept=kept,
        )

    def weighs_heads(self, reader: TensorReader, layer: AttentionLayer) -> bool:
        """Whether its output weight is named, there, and split by head (headers only)."""
        output = weight_beside(layer.prefix, self.output) if self.output else ""
        return bool(output) and split_by_head(reader, layer, None, output, self.conv1d)

    def head_outputs(self, reader: TensorReader, layer: AttentionLayer) -> HeadOutputs:
        """Each head's value rows (the fused projection's last third) and output columns, where weighs_heads."""
        values = self._linear(finite(reader, layer.anchor))[layer.shape.key_dim + layer.key_rows:]
        output = self._linear(finite(reader, weight_beside(layer.prefix, self.output)))
        return split_head_outputs(values, output, layer)

    def output_specs(self, reader: TensorReader, layer: AttentionLayer, rank: int) -> list[TensorSpec]:
        """The collaborative tensors, then the value third of the fused projection, in the fused layout."""
        anchor = reader.spec(layer.anchor)
        used = layer.shape.key_dim + layer.key_rows  # query and key rows; the rest are values
        value_shape = (anchor.shape[0], anchor.shape[1] - used) if self.conv1d else (anchor.shape[0] - used, anchor.shape[1])
        specs = _collaborative_specs(reader, layer, rank)
        specs.append(TensorSpec(f"{layer.prefix}.{FUSED_VALUE}.weight", anchor.dtype, value_shape))
        bias = f"{layer.prefix}.{self.name}.bias"
        if bias in reader:
            bias_spec = reader.spec(bias)
            specs.append(TensorSpec(f"{layer.prefix}.{FUSED_VALUE}.bias", bias_spec.dtype, (bias_spec.shape[0] - used,)))
        return specs

    # --- modules in memory ---------------------------------------------------------------------------------
    def module_dims(self, module: nn.Module, heads: HeadCounts) -> tuple[int, int, torch.Tensor]:
        fused = getattr(module, self.name)
        d_in, width = fused.weight.shape if self.conv1d else fused.weight.shape[::-1]
        return d_in, width // (heads.num_heads + 2 * heads.kv_heads), fused.weight

    def detach_projections(self, module: nn.Module, heads: HeadCounts) -> None:
        d_in, head_dim, weight = self.module_dims(module, heads)
        factory = {"device": weight.device, "dtype": weight.dtype}
        if self.conv1d:
            from transformers.pytorch_utils import Conv1D

            value = Conv1D(heads.kv_heads * head_dim, d_in).to(**factory)
        else:
            value = nn.Linear(d_in, heads.kv_heads * head_dim, **factory)
        delattr(module, self.name)
        setattr(module, FUSED_VALUE, value)

    def members(self) -> dict[str, property]:
        # Fused families run forwards of our own (modeling/forwards.py), which read the shared query, the packed
        # key and FUSED_VALUE directly: nothing stands in for the fused projection.
        return {}

    def finish(self, module: nn.Module, heads: HeadCounts) -> None:
        pass

    def hook_points(self, module: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
        return [(getattr(module, self.name), ("query", "key"))]


Layout = SeparateProjections | FusedProjection


def _collaborative_specs(reader: TensorReader, layer: AttentionLayer, rank: int) -> list[TensorSpec]:
    shape = LayerFormat(rank, layer.shape.num_heads, layer.shape.input_dim, layer.key_input_dim)
    return shape.specs(layer.prefix, reader.spec(layer.anchor).dtype)


def natural_key(text: str) -> list:
    """'layer.10' after 'layer.9'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]

