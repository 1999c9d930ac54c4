"""Every head's collaborative scores for a training step, a few heads at a time (pure torch).

score_i = q diag(m_i) k^T for the shared query side q (B, n, R), the shared key side k (B, m, R) and head i's
mixing m_i. Autograd on the plain expression keeps the per-head queries (B, H, n, R) for the backward pass and
makes their gradient in float32 and in the products' dtype beside them: 12.6 MB each at rank 768 with 16 heads,
4 sequences of 64 query rows, which set the peak of a CP layer's refining stage (benchmarks/memory.py). Here
only q, m and k are kept, and the per-head queries are made again in the backward pass, a chunk of heads at a
time, as the forward pass made them. Where every head fits in one chunk, autograd's own graph is used.
"""

from __future__ import annotations

import torch

# The float32 per-head queries of one chunk of heads: several times this is alive at once in the backward pass
CHUNK_BYTES = 4 << 20


def head_chunks(heads: int, bytes_per_head: int, limit: int | None = None) -> list[slice]:
    """Even slices of `heads` whose per-head queries stay under `limit` bytes each (CHUNK_BYTES; at least one
    head a chunk)."""
    limit = limit or CHUNK_BYTES
    most = max(1, limit // max(bytes_per_head, 1))  # heads a chunk may hold
    size = -(-heads // -(-heads // most))  # as many chunks as that needs, evened out
    return [slice(start, min(start + size, heads)) for start in range(0, heads, size)]


def _chunks(queries: torch.Tensor, mixing: torch.Tensor) -> list[slice]:
    """The chunks of mixing's heads: a head's per-head queries are as many float32 numbers as `queries` holds."""
    return head_chunks(mixing.shape[0], queries.numel() * 4)


def _per_head(queries: torch.Tensor, mixing: torch.Tensor, heads: slice, dtype: torch.dtype) -> torch.Tensor:
    """(B, h n, R) in `dtype`: the chunk's heads' queries q diag(m_i), one after another."""
    size, _, rank = queries.shape
    return (queries.unsqueeze(1) * mixing[None, heads, None, :]).reshape(size, -1, rank).to(dtype)


class _MixedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, mixing, keys, dtype):
        ctx.save_for_backward(queries, mixing, keys)
        ctx.dtype = dtype
        (size, n, _), heads, m = queries.shape, mixing.shape[0], keys.shape[1]
        keys_t = keys.transpose(1, 2).to(dtype)
        scores = queries.new_empty(size, heads, n, m)
        for chunk in _chunks(queries, mixing):
            scores[:, chunk] = (_per_head(queries, mixing, chunk, dtype) @ keys_t).view(size, -1, n, m)
        return scores

    @staticmethod
    def backward(ctx, grad):
        queries, mixing, keys = ctx.saved_tensors
        dtype, (size, n, rank), m = ctx.dtype, queries.shape, keys.shape[1]
        keys_in = keys.to(dtype)
        grad_queries, grad_mixing = None, torch.empty_like(mixing)
        grad_keys_t = None
        for chunk in _chunks(queries, mixing):
            flat = grad[:, chunk].reshape(size, -1, m).to(dtype)  # (B, h n, m)
            part = (_per_head(queries, mixing, chunk, dtype).transpose(1, 2) @ flat).float()  # (B, R, m)
            grad_keys_t = part if grad_keys_t is None else grad_keys_t.add_(part)
            per_head = (flat @ keys_in).float().view(size, -1, n, rank)  # d score / d (per-head queries)
            part = (per_head * mixing[None, chunk, None, :]).sum(1)
            grad_queries = part if grad_queries is None else grad_queries.add_(part)
            grad_mixing[chunk] = (per_head * queries.unsqueeze(1)).sum((0, 2))
        return grad_queries, grad_mixing, grad_keys_t.transpose(1, 2), None


def mixed_scores(queries: torch.Tensor, mixing: torch.Tensor, keys: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, H, n, m) float32: queries (B, n, R) diag(mixing[i]) keys (B, m, R)^T for every head i of mixing (H, R),
    the products in `dtype` (their inputs rounded to it), forward and backward."""
    (size, n, _), heads, m = queries.shape, mixing.shape[0], keys.shape[1]
    if len(_chunks(queries, mixing)) > 1:
        return _MixedScores.apply(queries, mixing, keys, dtype)
    # one chunk: autograd's own graph, the same arithmetic without the custom function's Python in every step
    # (MiniLM's refining stage 6.0-6.2 s so, 6.5-6.6 s through the function)
    flat = _per_head(queries, mixing, slice(None), dtype) @ keys.transpose(1, 2).to(dtype)
    return flat.float().view(size, heads, n, m)
