"""Rotary attention modules with one shared rotary key (the Tucker form; decompose/shared_key.py has the math).

Each head keeps its query projection (and QK-norm); one shared key of 2W + P numbers per token replaces the
key heads; head i reads it through its core. The module gets a forward of our own, one for every rotary
family, because the cache must hold the shared key itself: the family's forward would view and rotate keys
head by head. Everything else is the module's: its projections, norms, scaling (1/sqrt(d_k), or Gemma's
query_pre_attn_scalar), logit soft-capping, the model's masks (sliding windows included) and its RoPE tables
(cos/sin from transformers' own rope code, so linear, dynamic, yarn, llama3 and longrope scaling carry over).

Scores: all heads' shared-basis queries against the cached shared key in one matrix product, the key read
once for every head; values stay grouped as in the original. Each head's query enters the shared basis through
one kept matrix before RoPE and is rotated there with the key's tables (query_basis_matrix): fewer small
operations per decode step than rotating it per head and applying its core slot by slot.

The same modules serve the shared-key form of models with absolute or relative positions (GPT-2, OPT,
GPTBigCode; BART and T5 with forwards of their own below, for encoder-decoder attention, its cache and T5's
position bias): no RoPE tables arrive and no dimension rotates, the whole shared key is pass-through.
"""

from __future__ import annotations

import torch
from torch import nn

from ..decompose.rotary_ops import query_basis_matrix, rotate_slots
from ..format import HeadCounts
from .attention import is_tracing
from .forwards import encoder_decoder_keys, given_cache, past_seen_tokens, self_attention_cache, t5_position_bias


class SharedKeyMixin:
    is_collaborative = True

    def slot_frequencies(self, device: torch.device) -> torch.Tensor:
        cached = self._slot_frequencies.get(device)
        if cached is None:
            ranks = torch.tensor(self.frequency_ranks, dtype=torch.long)  # long even when empty (absolute)
            cached = torch.repeat_interleave(torch.arange(len(self.frequency_ranks)), ranks).to(device)
            self._slot_frequencies[device] = cached
        return cached

    def query_basis(self) -> torch.Tensor:
        """(N_h, d, 2W + P): each head's query into the shared basis. Kept between inference calls while the
        cores are unchanged (a decode step is many small operations; this saves a dozen per layer)."""
        cores = [core for core in (self.query_core, getattr(self, "pass_core", None)) if core is not None]
        if is_tracing() or (torch.is_grad_enabled() and any(core.requires_grad for core in cores)):
            return self._query_basis_matrix()
        stamp = tuple((core.data_ptr(), core._version, core.device, core.dtype) for core in cores)
        cached = self.__dict__.get("_query_basis")
        if cached is None or cached[0] != stamp:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor: usable in and out of inference mode
                cached = self.__dict__["_query_basis"] = (stamp, self._query_basis_matrix())
        return cached[1]

    def _query_basis_matrix(self) -> torch.Tensor:
        pass_core = getattr(self, "pass_core", None)
        if pass_core is None:
            pass_core = self.query_core.new_zeros(self.shared_key_heads.num_heads, 0, 0)
        return query_basis_matrix(self.query_core, pass_core, self.slot_frequencies(self.query_core.device),
                                  self.rotary_dim, self.rotary_dim + pass_core.shape[1])

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        cache = self_attention_cache(kwargs.pop("cache", None), kwargs, "past_key_values", "layer_past")
        layout, heads = self.shared_key_layout, self.shared_key_heads
        batch, length = hidden_states.shape[:2]
        query = layout.queries(self, hidden_states, heads.num_heads).transpose(1, 2)  # (b, N_h, n, d)
        value = layout.values(self, hidden_states, heads.kv_heads).transpose(1, 2)  # (b, G, n, d)
        key = layout.shared_key(self, hidden_states, heads.kv_heads).unsqueeze(1)  # (b, 1, n, 2W + P)
        query = torch.matmul(query, self.query_basis())  # each head's query into the shared basis
        if position_embeddings is not None:  # rotated there like the key (query_basis_matrix); absolute: nothing to do
            cos, sin = (table.unsqueeze(1) for table in position_embeddings)
            slots = self.slot_frequencies(hidden_states.device)
            slot_cos, slot_sin = cos[..., slots], sin[..., slots]
            query, key = rotate_slots(query, slot_cos, slot_sin), rotate_slots(key, slot_cos, slot_sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        output, weights = shared_key_attention(self, query, key, value, attention_mask,
                                               layout.dropout_probability(self))
        output = output.reshape(batch, length, -1).contiguous()
        return layout.output_projection(self, output), weights


def _shared_query(module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Each head's query (b, N_h, n, K) in the shared basis (no rotation: the encoder-decoder families have
    absolute or relative positions)."""
    query = module.shared_key_layout.queries(module, hidden_states, module.shared_key_heads.num_heads).transpose(1, 2)
    return torch.matmul(query, module.query_basis())


def _shared_keys_and_values(module):
    layout, kv_heads = module.shared_key_layout, module.shared_key_heads.kv_heads

    def keys_and_values(states: torch.Tensor):
        return (layout.shared_key(module, states, kv_heads).unsqueeze(1),
                layout.values(module, states, kv_heads).transpose(1, 2))

    return keys_and_values


def bart_shared_key_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    """BartAttention.forward (transformers 5; mBART's, Marian's and Pegasus' are copies) in the shared-key form:
    self-attention caches exactly the shared key; encoder-decoder attention caches the encoder's once."""
    cache = given_cache(cache, kwargs)
    batch, length = hidden_states.shape[:2]
    query = _shared_query(self, hidden_states)
    key, value = encoder_decoder_keys(self, hidden_states, key_value_states, cache, _shared_keys_and_values(self),
                                      kwargs)
    output, weights = shared_key_attention(self, query, key, value, attention_mask,
                                           self.shared_key_layout.dropout_probability(self))
    return self.shared_key_layout.output_projection(self, output.reshape(batch, length, -1).contiguous()), weights


def t5_shared_key_forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None,
                          **kwargs):
    """T5Attention.forward (transformers 5) in the shared-key form: the relative position bias and the unscaled
    scores stay as they are; caches as in bart_shared_key_forward."""
    cache = given_cache(cache, kwargs)
    batch, length = hidden_states.shape[:2]
    seen = past_seen_tokens(self, cache)
    query = _shared_query(self, hidden_states)
    key, value = encoder_decoder_keys(self, hidden_states, key_value_states, cache, _shared_keys_and_values(self),
                                      kwargs)
    position_bias = t5_position_bias(self, position_bias, length, key.shape[-2], seen, query)
    output, weights = shared_key_attention(self, query, key, value, mask, self.shared_key_layout.dropout_probability(self),
                                           position_bias=position_bias)
    output = self.shared_key_layout.output_projection(self, output.reshape(batch, length, -1).contiguous())
    return output, position_bias, weights


def _additive(mask: torch.Tensor | None, module, queries: int, keys: int, dtype, device) -> torch.Tensor | None:
    """The model's mask (float, bool, or None for plain causal attention) as an additive (…, n, m) tensor."""
    if mask is not None:
        mask = mask[..., -keys:] if mask.shape[-1] > keys else mask
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
        return mask.to(dtype)
    if queries == 1 or not getattr(module, "is_causal", True):
        return None
    # Queries are the last `queries` positions of the keys (a cache may hold earlier ones).
    position = torch.arange(keys - queries, keys, device=device)[:, None]
    key_position = torch.arange(keys, device=device)[None, :]
    allowed = key_position <= position
    window = getattr(module, "sliding_window", None)
    if window:
        allowed &= key_position > position - window
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def shared_key_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                         dropout: float = 0.0, position_bias: torch.Tensor | None = None):
    """query (b, N_h, n, K), key (b, 1, m, K), value (b, G, m, d) -> output (b, n, N_h, d), probabilities. A
    position bias (T5's, (1 or b, N_h, n, m)) is added to the scaled scores, before the mask."""
    batch, heads, length, width = query.shape
    groups, keys = value.shape[1], key.shape[2]
    scores = torch.matmul(query.reshape(batch, heads * length, width), key[:, 0].transpose(1, 2))
    scores = scores.view(batch, heads, length, keys) * module.scaling
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    mask = _additive(attention_mask, module, length, keys, scores.dtype, scores.device)
    if mask is not None:
        scores = scores + mask
    probabilities = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probabilities = nn.functional.dropout(probabilities, p=dropout if module.training else 0.0,
                                          training=module.training)
    grouped = probabilities.view(batch, groups, (heads // groups) * length, keys)
    output = torch.matmul(grouped, value).view(batch, heads, length, -1)
    return output.transpose(1, 2), probabilities


_CLASS_CACHE: dict[tuple[type, object], type] = {}


def _shared_key_class(original: type, offer) -> type:
    cache_key = (original, offer)
    if cache_key not in _CLASS_CACHE:
        _CLASS_CACHE[cache_key] = type(
            f"SharedKey{original.__name__}", (SharedKeyMixin, original),
            {"shared_key_layout": offer.layout, "collaborative_origin": original, "__module__": __name__,
             **({"forward": offer.forward} if offer.forward else {})},  # encoder-decoder families: their own
        )
    return _CLASS_CACHE[cache_key]


def make_shared_key(module: nn.Module, offer, entry: dict) -> nn.Module:
    """Turn one attention module into its shared-key form, in place, from its config.json record; `offer` (a
    family's shared-key form) brings the layout and the forward, where the family needs its own."""
    heads = HeadCounts(int(entry["num_heads"]), int(entry["kv_heads"]))
    head_dim, rotary_dim = int(entry["head_dim"]), int(entry["rotary_dim"])
    frequency_ranks = [int(r) for r in entry["frequency_ranks"]]
    pass_rank, slots = int(entry.get("pass_rank", 0)), sum(frequency_ranks)
    width = 2 * slots + pass_rank
    offer.layout.detach_projections(module, heads, head_dim, width, bool(entry.get("key_norm")))
    weight = next(module.parameters())
    factory = {"device": weight.device, "dtype": weight.dtype}
    module.query_core = nn.Parameter(torch.zeros(heads.num_heads, 2, slots, **factory))
    if head_dim > rotary_dim:
        module.pass_core = nn.Parameter(torch.zeros(heads.num_heads, head_dim - rotary_dim, pass_rank, **factory))
    module.shared_key_heads, module.rotary_dim, module.frequency_ranks = heads, rotary_dim, frequency_ranks
    module._slot_frequencies = {}
    module._is_hf_initialized = True
    module.__class__ = _shared_key_class(type(module), offer)
    return module
