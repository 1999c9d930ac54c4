"""Collaborative attention inside loaded PyTorch models.

An attention module is turned into its collaborative form in place. Its query and key projections are
removed and four tensors take their place (names as in the checkpoint):

    shared_query.weight  (R, D_in)    x -> x W~_Q, shared by every head
    shared_key.weight    (R, D_in)    y -> y W~_K, shared by every head
    mixing               (N_h, R)     head i scores with x W~_Q diag(mixing[i]) W~_K^T y^T
    content_bias         (N_h, D_in)  head i adds y . content_bias[i] (what the query bias did)

The module keeps its own forward. transformers 5 attention modules all follow one shape:
`q = self.<query>(h).view(..., -1, head_dim).transpose(1, 2)`, likewise for keys, then
`ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation](self, q, k, v, mask, scaling=...)`. So:

- `self.<query>` now returns the shared query x W~_Q, zero-padded to whole `head_dim` chunks, and
  `self.<key>` the shared key [y W~_K, y r_1 .. y r_N], likewise padded. The forward reshapes them into
  "pseudo-heads" without knowing; a KV cache stores the shared key: R + N_h numbers per token, not N_h d_k.
- the module sees a config view whose attention implementation is "collaborative"; that function unpacks
  the pseudo-heads, forms per-head queries [x W~_Q diag(m_i), 1] and keys [y W~_K, y r_i], and calls the
  model's real implementation (eager or sdpa; flash kernels need equal head sizes and are refused) with the
  original 1/sqrt(d_k) scaling, masks and everything else untouched.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

COLLABORATIVE_TENSORS = ("shared_query.weight", "shared_key.weight", "mixing", "content_bias")
FUSED_VALUE = "value_projection"  # what is left of a fused query/key/value projection: the values
ATTENTION_NAME = "collaborative"


class CollaborativeConfigView:
    """The attention module's config: the model's own, except that attention dispatches collaboratively.

    It reads through to the live model config, so set_attn_implementation() on the model still decides
    which real implementation runs underneath.
    """

    def __init__(self, base):
        object.__setattr__(self, "_base", base)

    def __getattr__(self, name: str):
        if name == "_base":  # during unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._base, name, value)

    @property
    def _attn_implementation(self) -> str:
        return ATTENTION_NAME


def _padded(width: int, chunk: int) -> int:
    return chunk * math.ceil(width / chunk)


class CollaborativeMixin:
    """Methods shared by every collaborative attention class (mixed into a subclass of the original)."""

    is_collaborative = True

    def collaborative_query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_query(hidden_states)
        return nn.functional.pad(shared, (0, self._query_width - shared.shape[-1]))

    def collaborative_key(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_key(hidden_states)
        bias = torch.matmul(hidden_states, self.content_bias.T)  # (..., N_h)
        packed = torch.cat([shared, bias], dim=-1)
        return nn.functional.pad(packed, (0, self._key_width - packed.shape[-1]))

    def pseudo_heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared query and packed shared key as (B, pseudo-heads, n, head_dim), for forwards of our own."""
        shape = (*hidden_states.shape[:-1], -1, self.collaborative_head_dim)
        return (
            self.collaborative_query(hidden_states).view(shape).transpose(1, 2),
            self.collaborative_key(hidden_states).view(shape).transpose(1, 2),
        )

    def collaborative_fused(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Stands in for a fused query/key/value projection: [shared query | packed shared key | values].

        The module splits the result with self.split_size, which make_collaborative set to the three widths.
        """
        return torch.cat(
            [
                self.collaborative_query(hidden_states),
                self.collaborative_key(hidden_states),
                self.value_projection(hidden_states),
            ],
            dim=-1,
        )

    @property
    def _query_width(self) -> int:
        return _padded(self.mixing.shape[1], self.collaborative_head_dim)

    @property
    def _key_width(self) -> int:
        return _padded(self.mixing.shape[1] + self.mixing.shape[0], self.collaborative_head_dim)


def unpack_pseudo_heads(module, query: torch.Tensor, key: torch.Tensor):
    """(B, P, n, d) pseudo-heads back into per-head queries (B, N_h, n, R+1) and keys (B, N_h, m, R+1)."""
    heads, rank = module.mixing.shape
    batch = query.shape[0]
    shared_query = query.transpose(1, 2).reshape(batch, query.shape[2], -1)[..., :rank]
    packed_key = key.transpose(1, 2).reshape(batch, key.shape[2], -1)
    shared_key, bias = packed_key[..., :rank], packed_key[..., rank : rank + heads]

    queries = shared_query.unsqueeze(1) * module.mixing[None, :, None, :]
    queries = torch.cat([queries, queries.new_ones(*queries.shape[:-1], 1)], dim=-1)
    keys = shared_key.unsqueeze(1).expand(batch, heads, *shared_key.shape[1:])
    keys = torch.cat([keys, bias.transpose(1, 2).unsqueeze(-1)], dim=-1)
    return queries, keys


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain attention with the transformers attention-function signature, for modules without their own."""
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _real_attention_function(module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = module.config._base if isinstance(module.config, CollaborativeConfigView) else module.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "eager":
        # The family's own eager function, where its modeling file has one (some add position biases).
        own = getattr(sys.modules.get(module.collaborative_origin.__module__), "eager_attention_forward", None)
        return own or eager_attention
    if "flash" in implementation:
        raise RuntimeError(
            f"collaborative attention cannot run with {implementation}: its query/key heads (R+1) differ in size "
            "from the value heads; load the model with attn_implementation='sdpa' or 'eager'"
        )
    return ALL_ATTENTION_FUNCTIONS[implementation]


def collaborative_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function collaborative modules dispatch to; plain modules pass straight through."""
    if not getattr(module, "is_collaborative", False):
        return _real_attention_function(module)(module, query, key, value, attention_mask, **kwargs)
    queries, keys = unpack_pseudo_heads(module, query, key)
    attend = _real_attention_function(module)
    if value.shape[1] != queries.shape[1]:  # grouped values: the keys are per head already
        value = value.repeat_interleave(queries.shape[1] // value.shape[1], dim=1)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1:
        return attend(module, queries, keys, value, attention_mask, **kwargs)
    # Keys and values now have one head per query head; the real function must not group them again.
    module.num_key_value_groups = 1
    try:
        return attend(module, queries, keys, value, attention_mask, **kwargs)
    finally:
        module.num_key_value_groups = groups


def mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """MPNetSelfAttention.forward (transformers 5), which scores inline, with collaborative queries and keys."""
    input_shape = hidden_states.shape[:-1]
    queries, keys = unpack_pseudo_heads(self, *self.pseudo_heads(hidden_states))
    values = self.v(hidden_states).view(*input_shape, -1, self.attention_head_size).transpose(1, 2)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    probabilities = self.dropout(nn.functional.softmax(scores, dim=-1))
    context = torch.matmul(probabilities, values).permute(0, 2, 1, 3).contiguous()
    output = self.o(context.view(*context.shape[:-2], self.all_head_size))
    return (output, probabilities) if output_attentions else (output,)


def opt_forward(self, hidden_states, cache=None, attention_mask=None, output_attentions=False, **kwargs):
    """OPTAttention.forward (transformers 5), whose views name the head count, with collaborative queries
    and keys. The cache stores the packed shared key, not per-head keys."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    batch, length, _ = hidden_states.size()
    queries, keys = self.pseudo_heads(hidden_states)
    values = self.v_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
    if cache is not None:
        keys, values = cache.update(keys, values, self.layer_idx, kwargs=kwargs)
    output, weights = collaborative_attention(
        self,
        queries,
        keys,
        values,
        attention_mask,
        dropout=0.0 if not self.training else self.dropout,
        scaling=self.scaling,  # OPT scales its queries before the call; the product is the same
        **kwargs,
    )
    return self.out_proj(output.reshape(batch, length, -1).contiguous()), weights


def gpt_bigcode_forward(self, hidden_states, layer_past=None, attention_mask=None, **kwargs):
    """GPTBigCodeAttention.forward (transformers 5, multi-query self-attention), whose c_attn split names
    its widths, with collaborative queries and keys. Values keep their single shared head."""
    if layer_past is None:
        layer_past = kwargs.pop("past_key_values", None) or kwargs.pop("cache", None)
    for unused in ("encoder_hidden_states", "encoder_attention_mask", "use_cache", "output_attentions"):
        kwargs.pop(unused, None)
    input_shape = hidden_states.shape[:-1]
    queries, keys = self.pseudo_heads(hidden_states)
    values = self.value_projection(hidden_states).unsqueeze(1)  # (B, 1, n, d): one value head
    if layer_past is not None:
        from transformers.cache_utils import EncoderDecoderCache

        cache = layer_past.self_attention_cache if isinstance(layer_past, EncoderDecoderCache) else layer_past
        keys, values = cache.update(keys, values, self.layer_idx, kwargs=kwargs)
    output, weights = collaborative_attention(
        self,
        queries,
        keys,
        values,
        attention_mask,
        dropout=0.0 if not self.training else self.attn_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    output = self.c_proj(output.reshape(*input_shape, -1).contiguous())
    return self.resid_dropout(output), weights


FORWARDS: dict[str, Callable] = {"mpnet": mpnet_forward, "opt": opt_forward, "gpt_bigcode": gpt_bigcode_forward}


def register_attention_function() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, collaborative_attention)


_CLASS_CACHE: dict[tuple[type, str], type] = {}


def _collaborative_class(original: type, family) -> type:
    cache_key = (original, family.name)
    if cache_key not in _CLASS_CACHE:
        # The original forward calls self.<query>(h): hand it the shared query instead (and so on).
        if family.fused:
            members = {family.fused: property(lambda self: self.collaborative_fused)}
        else:
            members = {
                family.query: property(lambda self: self.collaborative_query),
                family.key: property(lambda self: self.collaborative_key),
            }
        if family.forward:
            members["forward"] = FORWARDS[family.forward]
        _CLASS_CACHE[cache_key] = type(
            f"Collaborative{original.__name__}",
            (CollaborativeMixin, original),
            {**members, "collaborative_origin": original, "__module__": __name__},
        )
    return _CLASS_CACHE[cache_key]


def _projection_shape(module: nn.Module, family, num_heads: int, kv_heads: int) -> tuple[int, int, torch.Tensor]:
    """(D_in, head size, a weight for device and dtype) of the projections about to be replaced."""
    if family.fused:  # [queries (N_h d) | keys (N_kv d) | values (N_kv d)]
        fused = getattr(module, family.fused)
        d_in, width = fused.weight.shape if family.fused_layout == "conv1d" else fused.weight.shape[::-1]
        return d_in, width // (num_heads + 2 * kv_heads), fused.weight
    query = getattr(module, family.query)
    return query.in_features, query.out_features // num_heads, query.weight


def make_collaborative(module: nn.Module, family, rank: int, num_heads: int, kv_heads: int | None = None) -> nn.Module:
    """Turn one attention module into its collaborative form, in place, with uninitialised parameters."""
    kv_heads = kv_heads or num_heads
    d_in, head_dim, weight = _projection_shape(module, family, num_heads, kv_heads)
    device, dtype = weight.device, weight.dtype
    if family.fused:
        value_width = kv_heads * head_dim
        if family.fused_layout == "conv1d":
            from transformers.pytorch_utils import Conv1D

            value = Conv1D(value_width, d_in).to(device=device, dtype=dtype)
        else:
            value = nn.Linear(d_in, value_width, device=device, dtype=dtype)
        delattr(module, family.fused)
        module.value_projection = value
    else:
        delattr(module, family.query)
        delattr(module, family.key)
    module.shared_query = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
    module.shared_key = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
    module.mixing = nn.Parameter(torch.zeros(num_heads, rank, device=device, dtype=dtype))
    module.content_bias = nn.Parameter(torch.zeros(num_heads, d_in, device=device, dtype=dtype))
    module.collaborative_head_dim = head_dim
    # transformers' weight initialisation would reach for the removed projections (T5 initialises
    # module.q.weight); the collaborative tensors come from the checkpoint, and start at zero otherwise.
    module._is_hf_initialized = True
    if hasattr(module, "config"):
        module.config = CollaborativeConfigView(module.config)
    module.__class__ = _collaborative_class(type(module), family)
    if family.fused:
        module.split_size = [module._query_width, module._key_width, value_width]
    return module


def strip_prefix(name: str, prefix: str | None) -> str:
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name


def collaborate_model(model: nn.Module, family, layers: dict[str, dict[str, Any]], base_prefix: str | None):
    """Swap every attention module recorded in `layers` (keyed by checkpoint prefix) for its collaborative form.

    Checkpoint prefixes and module names may differ by the base-model prefix (a BertModel checkpoint loaded
    into BertForSequenceClassification gains "bert."), so both sides are compared without it.
    """
    register_attention_function()
    wanted = {strip_prefix(name, base_prefix): spec for name, spec in layers.items()}
    converted = []
    for name, module in list(model.named_modules()):
        spec = wanted.get(strip_prefix(name, base_prefix))
        if spec is None or getattr(module, "is_collaborative", False):
            continue
        make_collaborative(module, family, int(spec["rank"]), int(spec["num_heads"]), spec.get("kv_heads"))
        converted.append(name)
    if len(converted) != len(wanted):
        missing = sorted(set(wanted) - {strip_prefix(n, base_prefix) for n in converted})
        raise ValueError(f"attention modules recorded in the checkpoint were not found in the model: {missing[:3]}")
    return converted
