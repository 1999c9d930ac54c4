"""How shared-key families lay out queries, keys and values: the ONE reader of that layout, checkpoint and module
side. Rotary decoders, and absolute-position decoders in the shared-key form (GPT-2, OPT, GPTBigCode: nothing
rotates, every key dimension is pass-through).

Three layouts cover the rotary ones: separate q/k/v projections (Llama, Mistral, Qwen, Gemma, OLMo-2, Phi), one fused
[q | k | v] projection (Phi-3), and one fused projection interleaved per head [q_h | k_h | v_h] (GPT-NeoX). QK-norm
families normalise each head's query and key (Qwen3, Gemma3; Phi's optional LayerNorm) or the whole projection
(OLMo-2) before RoPE: their key projection and norm stay, and the shared key mixes the normalised keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..errors import BadInputError
from ..format import FUSED_QUERY, FUSED_VALUE, KEY_MIXING, PASS_CORE, QUERY_CORE, SHARED_KEY, SHARED_KEY_BIAS
from ..format import HeadCounts
from ..io.headers import TensorSpec
from ..io.reader import TensorReader
from .layouts import AttentionLayer, SeparateProjections, finite, split_error
from ..decompose.costs import LayerShape


@dataclass
class SharedKeyWeights:
    """One rotary layer's projections in nn.Linear layout (heads major), and tensors written unchanged."""

    query_weight: torch.Tensor  # (N_h d, D)
    query_bias: torch.Tensor | None
    key_weight: torch.Tensor  # (G d, D)
    key_bias: torch.Tensor | None
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # query/value parts of a fused projection


@dataclass(frozen=True)
class SharedKeyProjections:
    query: str = "q_proj"
    key: str = "k_proj"
    value: str = "v_proj"
    output: str = "o_proj"
    fused: str | None = None  # one projection [queries | keys | values]
    interleaved: bool = False  # the fused projection holds [q_h | k_h | v_h] head after head (GPT-NeoX)
    conv1d: bool = False  # the fused projection is GPT-2's Conv1D: weight (in, out), the transpose of nn.Linear's
    output_dropout: str | None = None  # a dropout module after the output projection (GPT-2's resid_dropout)
    dropout: str = "attention_dropout"  # the attribute with the attention-probability dropout (float or module)
    query_norm: str | None = None  # module attributes of QK-norm, where the family has it
    key_norm: str | None = None
    norm_over_heads: bool = False  # the norm spans the whole projection, not one head (OLMo-2)
    # The norm in front of the attention, a sibling of the attention module: its scale tells a weight-only fit
    # how large each input channel is (None: the family normalises after attention, as OLMo-2 does).
    input_norm: str | None = "input_layernorm"
    # RoPE rotates the keys (rotary decoders); False for absolute or relative positions (GPT-2, OPT, BART, T5 in
    # the shared-key form): no dimension rotates, the whole shared key is pass-through.
    rotates: bool = True

    def input_norm_names(self, prefix: str) -> tuple[str, str] | None:
        """(weight, bias) tensor names of the input norm of the attention module at `prefix`."""
        if self.input_norm is None or "." not in prefix:
            return None
        parent = prefix.rsplit(".", 1)[0]
        return f"{parent}.{self.input_norm}.weight", f"{parent}.{self.input_norm}.bias"

    @property
    def marker(self) -> str:
        return self.fused or self.query

    def keeps_key_projection(self, config: dict) -> bool:
        """With a key norm between projection and RoPE the shared key mixes normalised keys."""
        if self.key_norm is None:
            return False
        return bool(config.get("qk_layernorm", True)) if self.key_norm == "k_layernorm" else True

    # --- checkpoints -------------------------------------------------------------------------------------
    def find(self, reader: TensorReader, prefix: str, heads: HeadCounts, causal: bool,
             config: dict) -> AttentionLayer:
        layer = self._find(reader, prefix, heads, causal, self.keeps_key_projection(config))
        rotary_dim = rotary_dim_of(config, layer.shape.head_dim) if self.rotates else 0
        return replace(layer, shared_key=True, rotary_dim=rotary_dim)

    def _find(self, reader: TensorReader, prefix: str, heads: HeadCounts, causal: bool,
              key_norm: bool) -> AttentionLayer:
        query_bias = f"{prefix}.{self.query}.bias" in reader
        if not self.fused:
            # The same tensors and checks as separate query/key projections; only what the form replaces differs.
            layer = SeparateProjections(self.query, self.key).find(reader, prefix, heads, causal, {})
            key, bias = f"{prefix}.{self.key}.weight", f"{prefix}.{self.key}.bias"
            replaced = [] if key_norm else [key, *([bias] if bias in reader else [])]
            return replace(layer, anchor=key, replaced=replaced,
                           has_query_bias=query_bias or any(n.endswith(".bias") for n in replaced))
        name, bias = f"{prefix}.{self.fused}.weight", f"{prefix}.{self.fused}.bias"
        shape = reader.spec(name).shape
        shape = tuple(reversed(shape)) if self.conv1d else shape
        kv = heads.num_heads if self.interleaved else heads.kv_heads
        if len(shape) != 2 or shape[0] % (heads.num_heads + 2 * kv):
            raise split_error(name, shape, heads)
        replaced = [name, *([bias] if bias in reader else [])]
        return AttentionLayer(
            prefix=prefix, shape=LayerShape(shape[1], heads.num_heads, shape[0] // (heads.num_heads + 2 * kv)),
            anchor=name, replaced=replaced, has_query_bias=query_bias or bias in reader, kv_heads=kv,
            key_input_dim=shape[1], causal=causal,
        )

    def read(self, reader: TensorReader, layer: AttentionLayer) -> SharedKeyWeights:
        if not self.fused:
            def optional(name):
                return finite(reader, name) if name in reader else None

            p = layer.prefix
            return SharedKeyWeights(finite(reader, f"{p}.{self.query}.weight"), optional(f"{p}.{self.query}.bias"),
                                 finite(reader, f"{p}.{self.key}.weight"), optional(f"{p}.{self.key}.bias"))
        weight = finite(reader, layer.anchor)
        weight = weight.T.contiguous() if self.conv1d else weight
        bias_name = f"{layer.prefix}.{self.fused}.bias"
        bias = finite(reader, bias_name) if bias_name in reader else None
        parts = [self._split(weight, layer)] + ([self._split(bias, layer)] if bias is not None else [])
        (qw, kw, vw), (qb, kb, vb) = parts[0], parts[1] if bias is not None else (None, None, None)
        kept = {f"{layer.prefix}.{FUSED_QUERY}.weight": qw, f"{layer.prefix}.{FUSED_VALUE}.weight": vw}
        if bias is not None:
            kept.update({f"{layer.prefix}.{FUSED_QUERY}.bias": qb, f"{layer.prefix}.{FUSED_VALUE}.bias": vb})
        return SharedKeyWeights(qw, qb, kw, kb, kept)

    def _split(self, tensor: torch.Tensor, layer: AttentionLayer):
        """[q | k | v] (heads major) from a fused weight or bias, whatever its interleaving."""
        d, h, kv = layer.shape.head_dim, layer.shape.num_heads, layer.kv_heads
        if self.interleaved:
            per_head = tensor.reshape(h, 3, d, *tensor.shape[1:])
            return tuple(per_head[:, i].reshape(h * d, *tensor.shape[1:]).contiguous() for i in range(3))
        return tuple(part.contiguous() for part in torch.split(tensor, [h * d, kv * d, kv * d]))

    def output_specs(self, reader: TensorReader, layer: AttentionLayer, width: int, slots: int, pass_rank: int,
                     pass_dim: int, key_norm: bool) -> list[TensorSpec]:
        p, dtype = layer.prefix, reader.spec(layer.anchor).dtype
        d_in, h, d, kv = layer.shape.input_dim, layer.shape.num_heads, layer.shape.head_dim, layer.kv_heads
        biased = any(name.endswith(".bias") for name in layer.replaced)
        specs = []
        if self.fused:
            specs.append(TensorSpec(f"{p}.{FUSED_QUERY}.weight", dtype, (h * d, d_in)))
            specs += [TensorSpec(f"{p}.{FUSED_QUERY}.bias", dtype, (h * d,))] if biased else []
        if key_norm:
            specs.append(TensorSpec(f"{p}.{KEY_MIXING}", dtype, (width, kv * d)))
        else:
            specs.append(TensorSpec(f"{p}.{SHARED_KEY}", dtype, (width, d_in)))
            specs += [TensorSpec(f"{p}.{SHARED_KEY_BIAS}", dtype, (width,))] if biased else []
        if self.fused:
            specs.append(TensorSpec(f"{p}.{FUSED_VALUE}.weight", dtype, (kv * d, d_in)))
            specs += [TensorSpec(f"{p}.{FUSED_VALUE}.bias", dtype, (kv * d,))] if biased else []
        specs.append(TensorSpec(f"{p}.{QUERY_CORE}", dtype, (h, 2, slots)))
        if pass_dim:
            specs.append(TensorSpec(f"{p}.{PASS_CORE}", dtype, (h, pass_dim, pass_rank)))
        return specs

    # --- modules in memory -----------------------------------------------------------------------------------
    def _normed(self, module: nn.Module, states: torch.Tensor, norm: str | None, heads: int) -> torch.Tensor:
        """(b, n, heads * d) -> (b, n, heads, d), through the family's QK-norm if the module has one."""
        norm_module = getattr(module, norm, None) if norm else None
        if norm_module is not None and self.norm_over_heads:
            states = norm_module(states)
        states = states.view(*states.shape[:-1], heads, -1)
        if norm_module is not None and not self.norm_over_heads:
            states = norm_module(states)
        return states

    def original_queries_keys(self, module: nn.Module, hidden: torch.Tensor, heads: HeadCounts,
                              key_states: torch.Tensor | None = None):
        """An original module's queries (b, n, N_h, d) and keys (b, n, G, d) after any norm, before RoPE; the keys
        from `key_states` where they differ (encoder-decoder attention: the encoder's output)."""
        if key_states is not None and key_states is not hidden:
            query = getattr(module, self.query)(hidden)  # encoder-decoder families have separate projections
            return (self._normed(module, query, self.query_norm, heads.num_heads),
                    self._normed(module, getattr(module, self.key)(key_states), self.key_norm, heads.kv_heads))
        if self.fused:
            fused = getattr(module, self.fused)(hidden)
            d = fused.shape[-1] // (heads.num_heads + 2 * (heads.num_heads if self.interleaved else heads.kv_heads))
            if self.interleaved:
                per_head = fused.view(*fused.shape[:-1], heads.num_heads, 3, d)
                return per_head[..., 0, :], per_head[..., 1, :]
            query, key, _ = torch.split(fused, [heads.num_heads * d, heads.kv_heads * d, heads.kv_heads * d], -1)
        else:
            query, key = getattr(module, self.query)(hidden), getattr(module, self.key)(hidden)
        return (self._normed(module, query, self.query_norm, heads.num_heads),
                self._normed(module, key, self.key_norm, heads.kv_heads))

    def original_values(self, module: nn.Module, hidden: torch.Tensor, heads: HeadCounts) -> torch.Tensor:
        """An original module's values (b, n, G, d)."""
        if not self.fused:
            values = getattr(module, self.value)(hidden)
            return values.view(*values.shape[:-1], heads.kv_heads, -1)
        fused = getattr(module, self.fused)(hidden)
        if self.interleaved:
            return fused.view(*fused.shape[:-1], heads.num_heads, 3, -1)[..., 2, :]
        d = fused.shape[-1] // (heads.num_heads + 2 * heads.kv_heads)
        return fused[..., (heads.num_heads + heads.kv_heads) * d:].reshape(*fused.shape[:-1], heads.kv_heads, d)

    def queries(self, module: nn.Module, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        projection = getattr(module, FUSED_QUERY if self.fused else self.query)
        return self._normed(module, projection(hidden), self.query_norm, num_heads)

    def values(self, module: nn.Module, hidden: torch.Tensor, kv_heads: int) -> torch.Tensor:
        values = getattr(module, FUSED_VALUE if self.fused else self.value)(hidden)
        return values.view(*values.shape[:-1], kv_heads, -1)

    def shared_key(self, module: nn.Module, hidden: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """(b, n, 2W + P): from the key projection's normalised output where a norm sits between, else directly."""
        if hasattr(module, KEY_MIXING):
            keys = self._normed(module, getattr(module, self.key)(hidden), self.key_norm, kv_heads)
            return nn.functional.linear(keys.flatten(-2), module.key_mixing)
        return module.shared_key(hidden)

    def detach_projections(self, module: nn.Module, heads: HeadCounts, head_dim: int, width: int,
                           key_norm: bool) -> None:
        """Remove what the shared key replaces; add the shared key (or mixing) and the query/value parts."""
        source = getattr(module, self.fused or self.key)
        d_in, bias = source.weight.shape[0 if self.conv1d else 1], source.bias is not None
        factory = {"device": source.weight.device, "dtype": source.weight.dtype}
        if self.fused:
            kv = heads.num_heads if self.interleaved else heads.kv_heads
            delattr(module, self.fused)
            setattr(module, FUSED_QUERY, nn.Linear(d_in, heads.num_heads * head_dim, bias=bias, **factory))
            setattr(module, FUSED_VALUE, nn.Linear(d_in, kv * head_dim, bias=bias, **factory))
        if key_norm:
            module.key_mixing = nn.Parameter(torch.zeros(width, heads.kv_heads * head_dim, **factory))
        else:
            if not self.fused:
                delattr(module, self.key)
            module.shared_key = nn.Linear(d_in, width, bias=bias, **factory)

    def output_projection(self, module: nn.Module, attended: torch.Tensor) -> torch.Tensor:
        """The module's output projection (and the dropout after it, where the family has one)."""
        output = getattr(module, self.output)(attended)
        return getattr(module, self.output_dropout)(output) if self.output_dropout else output

    def output_module(self, module: nn.Module) -> nn.Module:
        """The module's output projection."""
        return getattr(module, self.output)

    def output_weight(self, module: nn.Module) -> torch.Tensor:
        """The output projection's weight in nn.Linear layout (D, N_h d)."""
        weight = getattr(module, self.output).weight
        return weight.T if self.conv1d else weight

    def dropout_probability(self, module: nn.Module) -> float:
        dropout = getattr(module, self.dropout, 0.0)
        return float(dropout.p if isinstance(dropout, nn.Module) else dropout or 0.0)


def rotary_dim_of(config: dict, head_dim: int) -> int:
    """RoPE's rotated dimensions per head: all of them unless the config asks for partial rotary."""
    parameters = config.get("rope_parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    factor = next((value for value in (parameters.get("partial_rotary_factor"), config.get("partial_rotary_factor"),
                                       config.get("rotary_pct")) if value is not None), 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise BadInputError(f"config.json's partial rotary factor {factor!r} is not a number in (0, 1]")
    rotary = int(head_dim * float(factor))
    if rotary <= 0 or rotary % 2 or rotary > head_dim:
        raise BadInputError(f"a rotary width of {rotary} of {head_dim} dimensions per head is not supported")
    return rotary
