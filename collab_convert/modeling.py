"""Collaborative attention modules for loaded PyTorch models.

An original attention module is turned into its collaborative form in place: its query and key projections
are removed and four tensors take their place (names as in the checkpoint):

    shared_query.weight  (R, D_in)    x -> x W~_Q, shared by every head
    shared_key.weight    (R, D_in)    y -> y W~_K, shared by every head
    mixing               (N_h, R)     head i scores with x W~_Q diag(mixing[i]) W~_K^T y^T
    content_bias         (N_h, D_in)  head i adds y . content_bias[i] (what the query bias did)

Everything else (value and output projections, dropout, scaling, layer index) stays, and the module's class
becomes a subclass of its own with a collaborative forward, so it still is what the model expects.

The per-head queries are [x W~_Q diag(m_i), 1] and the keys [y W~_K, y r_i]: one dot product gives the
bilinear score and the content bias together, so any attention function that takes a query/key head size
different from the value head size (eager, sdpa) computes the collaborative scores, masks included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

COLLABORATIVE_TENSORS = ("shared_query.weight", "shared_key.weight", "mixing", "content_bias")


def collaborative_query_key(module: nn.Module, query_input: torch.Tensor, key_input: torch.Tensor):
    """Per-head queries (B, N_h, n, R+1) and keys (B, N_h, m, R+1) whose dot products are the scores."""
    queries = module.shared_query(query_input)  # (B, n, R)
    queries = queries.unsqueeze(-3) * module.mixing[:, None, :]  # (B, N_h, n, R)
    queries = torch.cat([queries, queries.new_ones(*queries.shape[:-1], 1)], dim=-1)

    keys = module.shared_key(key_input)  # (B, m, R): one key for all heads
    bias = torch.matmul(key_input, module.content_bias.T)  # (B, m, N_h)
    heads = module.mixing.shape[0]
    keys = keys.unsqueeze(-3).expand(*keys.shape[:-2], heads, *keys.shape[-2:])
    keys = torch.cat([keys, bias.transpose(-1, -2).unsqueeze(-1)], dim=-1)
    return queries, keys


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain attention with the transformers attention-function signature."""
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attention_function(config) -> Callable:
    """The model's configured attention function, where it can take query/key heads unlike the values'."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "eager":
        return eager_attention
    if "flash" in implementation:
        # Flash kernels need equal query/key/value head sizes; collaborative heads have R+1 vs d_v.
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention)


# ----------------------------------------------------------------------------------------------------------
# Forwards, one per attention-module signature


def bert_self_attention(self, hidden_states, attention_mask=None, cache=None, **kwargs):
    """BertSelfAttention.forward (transformers 5) with collaborative queries and keys."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    kwargs.pop("encoder_hidden_states", None)
    input_shape = hidden_states.shape[:-1]
    query_layer, key_layer = collaborative_query_key(self, hidden_states, hidden_states)
    value_layer = self.value(hidden_states).view(*input_shape, -1, self.attention_head_size).transpose(1, 2)

    if cache is not None:
        from transformers.cache_utils import EncoderDecoderCache

        current = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        key_layer, value_layer = current.update(key_layer, value_layer, self.layer_idx, kwargs=kwargs)

    attn_output, attn_weights = attention_function(self.config)(
        self,
        query_layer,
        key_layer,
        value_layer,
        attention_mask,
        dropout=0.0 if not self.training else self.dropout.p,
        scaling=self.scaling,  # the original 1/sqrt(d_k): the scores approximate the original scores
        **kwargs,
    )
    return attn_output.reshape(*input_shape, -1).contiguous(), attn_weights


FORWARDS: dict[str, Callable] = {"bert_self_attention": bert_self_attention}

_CLASS_CACHE: dict[tuple[type, str], type] = {}


def _collaborative_class(original: type, forward_name: str) -> type:
    key = (original, forward_name)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(
            f"Collaborative{original.__name__}",
            (original,),
            {"forward": FORWARDS[forward_name], "is_collaborative": True, "__module__": __name__},
        )
    return _CLASS_CACHE[key]


def make_collaborative(module: nn.Module, family, rank: int, num_heads: int) -> nn.Module:
    """Turn one attention module into its collaborative form, in place, with uninitialised parameters."""
    query = getattr(module, family.query)
    d_in = query.in_features
    device = query.weight.device
    dtype = query.weight.dtype
    delattr(module, family.query)
    delattr(module, family.key)
    module.shared_query = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
    module.shared_key = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
    module.mixing = nn.Parameter(torch.empty(num_heads, rank, device=device, dtype=dtype))
    module.content_bias = nn.Parameter(torch.zeros(num_heads, d_in, device=device, dtype=dtype))
    module.__class__ = _collaborative_class(type(module), family.forward)
    return module


def strip_prefix(name: str, prefix: str | None) -> str:
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name


def collaborate_model(model: nn.Module, family, layers: dict[str, dict[str, Any]], base_prefix: str | None):
    """Swap every attention module recorded in `layers` (keyed by checkpoint prefix) for its collaborative form.

    Checkpoint prefixes and module names may differ by the base-model prefix (a BertModel checkpoint loaded
    into BertForSequenceClassification gains "bert."), so both sides are compared without it.
    """
    wanted = {strip_prefix(name, base_prefix): spec for name, spec in layers.items()}
    converted = []
    for name, module in list(model.named_modules()):
        spec = wanted.get(strip_prefix(name, base_prefix))
        if spec is None or getattr(module, "is_collaborative", False):
            continue
        make_collaborative(module, family, int(spec["rank"]), int(spec["num_heads"]))
        converted.append(name)
    if len(converted) != len(wanted):
        missing = sorted(set(wanted) - {strip_prefix(n, base_prefix) for n in converted})
        raise ValueError(f"attention modules recorded in the checkpoint were not found in the model: {missing[:3]}")
    return converted
