"""Forwards of our own: for families whose attention scores inline or names its head count in views, and for
decoders, whose caches then hold the packed shared key as one unpadded pseudo-head (exactly R + N_h numbers
per token; the module's own forward would view it in head-size chunks). Each mirrors the transformers 5
original with collaborative queries and keys; the family entry in architectures/families.py points at it."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..format import FUSED_VALUE
from .attention import collaborative_attention, unpack_pseudo_heads


def mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """MPNetSelfAttention.forward (transformers 5), which scores inline, with collaborative queries and keys. Its
    twin is integration/checkpoint_code._mpnet_forward, which the checkpoint carries and which may import nothing of
    ours (nor may this import it: modeling sits below integration): change both alike (test_plain_loading compares
    them)."""
    input_shape = hidden_states.shape[:-1]
    queries, keys = unpack_pseudo_heads(self, *self.shared_heads(hidden_states))
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
    cache = given_cache(cache, kwargs)
    batch, length, _ = hidden_states.size()
    queries, keys = self.shared_heads(hidden_states)
    values = self.v_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
    # OPT scales its queries before the call; passing the scaling instead gives the same product
    output, weights = _attend(self, queries, keys, values, cache, attention_mask, self.dropout, kwargs)
    return self.out_proj(output.reshape(batch, length, -1).contiguous()), weights


def gpt_bigcode_forward(self, hidden_states, layer_past=None, attention_mask=None, **kwargs):
    """GPTBigCodeAttention.forward (transformers 5, multi-query self-attention), whose c_attn split names
    its widths, with collaborative queries and keys. Values keep their single shared head."""
    layer_past = self_attention_cache(layer_past, kwargs, "past_key_values", "cache")
    input_shape = hidden_states.shape[:-1]
    queries, keys = self.shared_heads(hidden_states)
    values = getattr(self, FUSED_VALUE)(hidden_states).unsqueeze(1)  # (B, 1, n, d): one value head
    output, weights = _attend(self, queries, keys, values, layer_past, attention_mask, self.attn_dropout, kwargs)
    output = self.c_proj(output.reshape(*input_shape, -1).contiguous())
    return self.resid_dropout(output), weights


def gpt2_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """GPT2Attention.forward (transformers 5, self-attention: the family refuses cross-attention and the upcast
    path), with collaborative queries and keys, so its cache stores exactly the packed shared key."""
    cache = self_attention_cache(cache, kwargs, "past_key_values", "layer_past")
    input_shape = hidden_states.shape[:-1]
    queries, keys = self.shared_heads(hidden_states)
    values = getattr(self, FUSED_VALUE)(hidden_states)
    values = values.view(*input_shape, -1, self.head_dim).transpose(1, 2)
    output, weights = _attend(self, queries, keys, values, cache, attention_mask, self.attn_dropout.p, kwargs)
    output = self.c_proj(output.reshape(*input_shape, -1).contiguous())
    return self.resid_dropout(output), weights


def bart_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    """BartAttention.forward (transformers 5; mBART's, Marian's and Pegasus' are copies of it) with
    collaborative queries and keys. Self-attention caches exactly the packed shared key; encoder-decoder
    attention caches the encoder's packed key once, as the original caches its keys."""
    cache = given_cache(cache, kwargs)
    input_shape = hidden_states.shape[:-1]
    queries = nn.functional.linear(hidden_states, self.shared_query.weight).unsqueeze(1)
    keys, values = encoder_decoder_keys(self, hidden_states, key_value_states, cache,
                                        _packed_keys_and_values(self, self.v_proj, self.head_dim), kwargs)
    output, weights = collaborative_attention(
        self, queries, keys, values, attention_mask,
        dropout=self.dropout if self.training else 0.0, scaling=self.scaling, **kwargs,
    )
    return self.out_proj(output.reshape(*input_shape, -1).contiguous()), weights


def t5_forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
    """T5Attention.forward (transformers 5) with collaborative queries and keys: the relative position bias and
    the unscaled scores stay as they are; the caches hold exactly the packed shared key, as in bart_forward."""
    cache = given_cache(cache, kwargs)
    input_shape = hidden_states.shape[:-1]
    seen = past_seen_tokens(self, cache)
    queries = nn.functional.linear(hidden_states, self.shared_query.weight).unsqueeze(1)
    keys, values = encoder_decoder_keys(self, hidden_states, key_value_states, cache,
                                        _packed_keys_and_values(self, self.v, self.key_value_proj_dim), kwargs)
    position_bias = t5_position_bias(self, position_bias, input_shape[1], keys.shape[-2], seen, queries)
    output, weights = collaborative_attention(
        self, queries, keys, values, mask,
        dropout=self.dropout if self.training else 0.0, scaling=self.scaling, position_bias=position_bias, **kwargs,
    )
    return self.o(output.reshape(*input_shape, -1).contiguous()), position_bias, weights


def t5_position_bias(self, position_bias, length: int, key_length: int, past_seen_tokens, like: torch.Tensor):
    """The bias T5Attention adds to its scores: the one handed on by the stack's first layer, else its own
    relative position bias (or zeros, in a layer without one), as the original computes it."""
    if position_bias is not None:
        return position_bias
    if not self.has_relative_attention_bias:
        position_bias = torch.zeros((1, self.n_heads, length, key_length), device=like.device, dtype=like.dtype)
        if self.gradient_checkpointing and self.training:
            position_bias.requires_grad = True
        return position_bias
    return self.compute_bias(length, key_length, device=like.device, past_seen_tokens=past_seen_tokens)


def past_seen_tokens(self, cache):
    """Tokens the cache already holds for this layer (cloned for StaticCache, whose length tensor the update
    changes in place, as the original does)."""
    seen = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    return seen.clone() if isinstance(seen, torch.Tensor) else seen


def _packed_keys_and_values(self, value_projection, head_dim: int):
    def keys_and_values(current):
        values = value_projection(current).view(*current.shape[:-1], -1, head_dim).transpose(1, 2)
        return self._packed_key(current).unsqueeze(1), values

    return keys_and_values


def encoder_decoder_keys(self, hidden_states, key_value_states, cache, keys_and_values, kwargs):
    """(keys, values) of self-attention or, with key_value_states, encoder-decoder attention, through an
    encoder-decoder cache as the originals use it: self-attention appends token by token, and encoder-decoder
    attention computes the encoder's once and reuses it at every later step. `keys_and_values(states)` gives
    what the form caches: the packed shared key (CP form) or the shared key (shared-key form), and values."""
    from transformers.cache_utils import EncoderDecoderCache

    cross = key_value_states is not None
    current = key_value_states if cross else hidden_states
    layer_cache, reuse = cache, False
    if isinstance(cache, EncoderDecoderCache):
        reuse = cross and bool(cache.is_updated.get(self.layer_idx))
        layer_cache = cache.cross_attention_cache if cross else cache.self_attention_cache
    if reuse:
        return layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
    keys, values = keys_and_values(current)
    if cache is not None:
        keys, values = layer_cache.update(keys, values, self.layer_idx, kwargs=kwargs)
        if cross and isinstance(cache, EncoderDecoderCache):
            cache.is_updated[self.layer_idx] = True
    return keys, values


def given_cache(cache, kwargs: dict):
    """The cache passed as `cache`, or under the name transformers 5 deprecated for it (`past_key_values`); the
    old name is taken out of `kwargs` either way, so it never reaches the attention function."""
    old = kwargs.pop("past_key_values", None)
    return cache if cache is not None else old


def self_attention_cache(cache, kwargs: dict, *other_names: str):
    """The cache a self-attention-only family's forward uses: the one passed, else one under the original's
    other argument names; the self-attention part of an EncoderDecoderCache. Arguments the original forward
    takes but a self-attention-only family does not use leave `kwargs`, so they do not reach the attention
    function."""
    for name in other_names:
        found = kwargs.pop(name, None)
        if cache is None:
            cache = found
    for unused in ("encoder_hidden_states", "encoder_attention_mask", "use_cache", "output_attentions"):
        kwargs.pop(unused, None)
    from transformers.cache_utils import EncoderDecoderCache

    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def _attend(self, queries, keys, values, cache, attention_mask, dropout: float, kwargs):
    """Cache the packed shared key and the values (not per-head keys), then attend collaboratively."""
    if cache is not None:
        keys, values = cache.update(keys, values, self.layer_idx, kwargs=kwargs)
    return collaborative_attention(
        self, queries, keys, values, attention_mask,
        dropout=dropout if self.training else 0.0, scaling=self.scaling, **kwargs,
    )
