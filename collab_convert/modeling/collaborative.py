"""Turning an attention module into its collaborative form, in place.

Its query and key projections are removed and the four tensors of the format (format.py) take their place:
shared_query, shared_key, mixing, content_bias. The module keeps its own forward: transformers 5 attention
modules all follow `q = self.<query>(h).view(..., -1, head_dim).transpose(1, 2)`, likewise for keys, then
`ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation](self, q, k, v, mask, scaling=...)`, so handing them
the shared query and the packed shared key and dispatching to the collaborative attention function (see
attention.py) is enough. A KV cache stores the shared key: R + N_h numbers per token, not N_h d_k (exactly
that where the family has a forward of our own, modeling/forwards.py; padded to whole head_dim chunks where
the module's own forward views keys head by head).

Which projections to take off, and how, is the family's layout (architectures/layouts.py), handed in.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..format import HeadCounts
from .attention import CollaborativeConfigView


def _padded(width: int, chunk: int) -> int:
    return chunk * math.ceil(width / chunk)


def _zero_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return weight if weight.shape[0] == rows else nn.functional.pad(weight, (0, 0, 0, rows - weight.shape[0]))


class CollaborativeMixin:
    """Methods shared by every collaborative attention class (mixed into a subclass of the original)."""

    is_collaborative = True

    def collaborative_query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """x W~_Q, zero-padded to whole head_dim chunks: one GEMM with zero rows, no copy afterwards."""
        weight = self.shared_query.weight
        return nn.functional.linear(hidden_states, _zero_rows(weight, self._query_width))

    def collaborative_key(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The packed shared key [y W~_K, y.r_1 .. y.r_N], zero-padded to whole head_dim chunks: one GEMM."""
        weight = torch.cat([self.shared_key.weight, self.content_bias])
        return nn.functional.linear(hidden_states, _zero_rows(weight, self._key_width))

    def shared_heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared query (B, 1, n, R) and packed shared key (B, 1, n, R + N_h), unpadded: one pseudo-head each,
        for forwards of our own. A cache then stores exactly R + N_h numbers per token, with no head-size
        chunks, and the score path reads it as one (B, m, R + N_h) matrix without a copy."""
        return (nn.functional.linear(hidden_states, self.shared_query.weight).unsqueeze(1),
                self._packed_key(hidden_states).unsqueeze(1))

    def _packed_key(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[y W~_K, y.r_1 .. y.r_N] (…, R + N_h), joining whichever is smaller: the two weights (many tokens: one
        GEMM) or the two outputs (a few tokens, as in a decode step, where copying the weights would cost more
        than the product)."""
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        if tokens >= hidden_states.shape[-1]:
            return nn.functional.linear(hidden_states, torch.cat([self.shared_key.weight, self.content_bias]))
        return torch.cat([nn.functional.linear(hidden_states, self.shared_key.weight),
                          nn.functional.linear(hidden_states, self.content_bias)], dim=-1)

    @property
    def _query_width(self) -> int:
        return _padded(self.mixing.shape[1], self.collaborative_head_dim)

    @property
    def _key_width(self) -> int:
        return _padded(self.mixing.shape[1] + self.content_bias.shape[0], self.collaborative_head_dim)


_CLASS_CACHE: dict[tuple[type, object], type] = {}


def _collaborative_class(original: type, offer) -> type:
    """A subclass of the original module class whose projections hand out the collaborative ones."""
    cache_key = (original, offer)
    if cache_key not in _CLASS_CACHE:
        members = offer.layout.members()
        if offer.forward:
            members["forward"] = offer.forward
        _CLASS_CACHE[cache_key] = type(
            f"Collaborative{original.__name__}",
            (CollaborativeMixin, original),
            {**members, "collaborative_origin": original, "__module__": __name__},
        )
    return _CLASS_CACHE[cache_key]


def make_collaborative(module: nn.Module, offer, entry: dict) -> nn.Module:
    """Turn one attention module into its collaborative form, in place, with uninitialised parameters, from its
    config.json record (rank, heads; "content_bias": false where the checkpoint stores none).

    `offer` (a family's CP form) brings the layout (which projections to take off) and the forward, if the module
    needs ours. Without a content bias (it would be all zeros) the module holds an empty one, and its packed key is
    the shared key alone.
    """
    num_heads = int(entry["num_heads"])
    heads = HeadCounts(num_heads, int(entry.get("kv_heads") or num_heads))
    rank, content_bias = int(entry["rank"]), bool(entry.get("content_bias", True))
    layout = offer.layout
    d_in, head_dim, weight = layout.module_dims(module, heads)
    factory = {"device": weight.device, "dtype": weight.dtype}
    layout.detach_projections(module, heads)
    module.shared_query = nn.Linear(d_in, rank, bias=False, **factory)
    module.shared_key = nn.Linear(d_in, rank, bias=False, **factory)
    module.mixing = nn.Parameter(torch.zeros(heads.num_heads, rank, **factory))
    if content_bias:
        module.content_bias = nn.Parameter(torch.zeros(heads.num_heads, d_in, **factory))
    else:  # not in the checkpoint: a buffer that is not saved, so loading expects nothing
        module.register_buffer("content_bias", torch.zeros(0, d_in, **factory), persistent=False)
    module.collaborative_head_dim = head_dim
    # transformers' weight initialisation would reach for the removed projections (T5 initialises
    # module.q.weight); the collaborative tensors come from the checkpoint, and start at zero otherwise.
    module._is_hf_initialized = True
    if hasattr(module, "config"):
        module.config = CollaborativeConfigView(module.config)
    module.__class__ = _collaborative_class(type(module), offer)
    layout.finish(module, heads)
    return module


def strip_prefix(name: str, prefix: str | None) -> str:
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
