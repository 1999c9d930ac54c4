"""The collaborative score path: the attention function collaborative modules dispatch to.

The module's query projection returns the shared query x W~_Q and its key projection the packed shared key
[y W~_K, y r_1 .. y r_N], each zero-padded to whole head_dim chunks, so the module's own forward reshapes them
into "pseudo-heads" without knowing. The module sees a config view whose attention implementation is
"collaborative"; that function unpacks the pseudo-heads, forms per-head queries [x W~_Q diag(m_i), 1] and keys
[y W~_K, y r_i], and calls the model's real implementation (eager or sdpa; flash kernels need equal head
sizes and are refused) with the original 1/sqrt(d_k) scaling, masks and everything else untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from .blocks import BlockWorkers, workspace

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


def bias_heads(module) -> int:
    """Content-bias numbers per key in the packed key: N_h, or 0 where the layer stores no content bias."""
    return module.content_bias.shape[0]


def unpack_pseudo_heads(module, query: torch.Tensor, key: torch.Tensor):
    """(B, P, n, d) pseudo-heads back into per-head queries (B, N_h, n, R+1) and keys (B, N_h, m, R+1) (R wide
    where the layer has no content bias)."""
    heads, rank = module.mixing.shape
    batch = query.shape[0]
    shared_query = query.transpose(1, 2).reshape(batch, query.shape[2], -1)[..., :rank]
    packed_key = key.transpose(1, 2).reshape(batch, key.shape[2], -1)
    shared_key, bias = packed_key[..., :rank], packed_key[..., rank : rank + bias_heads(module)]

    queries = shared_query.unsqueeze(1) * module.mixing[None, :, None, :]
    keys = shared_key.unsqueeze(1).expand(batch, heads, *shared_key.shape[1:])
    if bias.shape[-1]:
        queries = torch.cat([queries, queries.new_ones(*queries.shape[:-1], 1)], dim=-1)
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

    implementation = _implementation(module)
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
    implementation = _implementation(module)
    if implementation in ("eager", "sdpa"):
        # SDPA returns no attention weights; eager does, for output_attentions
        return shared_key_attention(module, query, key, value, attention_mask,
                                    keep_weights=implementation == "eager", **kwargs)
    return _per_head_attention(module, query, key, value, attention_mask, **kwargs)


def is_tracing() -> bool:
    """Whether an exporter (torch.onnx, torch.export, torch.compile, TorchScript) is tracing: it wants one plain
    graph, so inference shortcuts that keep state between calls or loop over blocks step aside."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _implementation(module) -> str:
    config = module.config._base if isinstance(module.config, CollaborativeConfigView) else module.config
    return getattr(config, "_attn_implementation", None) or "eager"


def shared_key_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, keep_weights=True,
                         **kwargs):
    """Scores with the shared key as one operand for every head: a batched product of the N_h per-head queries
    (B, N_h n, R) against the shared key (B, R, m), which is read once, never copied per head; the content bias
    (one number per key and head) joins the mask as a (B, N_h, 1, m) term. Then softmax, dropout and the
    values, as the eager and SDPA functions do.

    Without weights to return (SDPA returns none), gradients or a tracer, CPU inference runs in blocks that stay
    in cache (see _blocked_inference); the result is the same."""
    heads, rank = module.mixing.shape
    batch, n, m = query.shape[0], query.shape[2], key.shape[2]
    scaling = 1.0 if scaling is None else scaling
    shared_query = query.transpose(1, 2).reshape(batch, n, -1)[..., :rank]
    packed_key = key.transpose(1, 2).reshape(batch, m, -1)[..., : rank + bias_heads(module)]
    if value.shape[1] not in (1, heads):  # grouped values: one per query head
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    position_bias = kwargs.get("position_bias")
    training = torch.is_grad_enabled() and (query.requires_grad or module.mixing.requires_grad)
    # the host's own memory only: an accelerator (and the tests' stand-in for one, "cpu:1") takes the batched path.
    # It must: the blocks may run on worker threads, where a CUDA tensor would meet another thread's current
    # device and stream (and the stand-in's modes, which are per thread, do not reach)
    if not keep_weights and not training and not is_tracing() and query.device == torch.device("cpu"):
        return _blocked_inference(module, shared_query, packed_key, value, attention_mask, position_bias, scaling,
                                  dropout, kwargs.get("is_causal")), None
    queries = shared_query.unsqueeze(1) * (module.mixing * scaling).to(query.dtype)[None, :, None, :]
    scores = torch.bmm(queries.view(batch, heads * n, rank), packed_key[..., :rank].transpose(1, 2))
    scores = scores.view(batch, heads, n, m)
    if position_bias is not None:
        scores += position_bias
    if packed_key.shape[-1] > rank:
        per_key = (packed_key[..., rank:] * scaling).transpose(1, 2).unsqueeze(2)  # (B, N_h, 1, m)
        if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.shape[-2] == 1:
            per_key = per_key + attention_mask[..., :m]  # a padding mask is per key too: one small add
            attention_mask = None
        scores += per_key
    _mask_in_place(scores, attention_mask, module, kwargs.get("is_causal"))
    if scores.dtype == torch.float32 and not (torch.is_grad_enabled() and scores.requires_grad):
        # inference: softmax over the scores in place, no second (B, N_h, n, m) tensor to allocate and fill
        weights = torch.softmax(scores, dim=-1, out=scores).to(value.dtype)
    else:
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


# Numbers in one block's per-head queries and scores: about 4 MB of float32, so a block's scores are still in
# cache when softmax and the values read them (measured on MiniLM's shapes: 1M numbers 39 ms a layer, 64K 78 ms,
# the whole batch at once 57 ms).
BLOCK_NUMBERS = 1 << 20


def _blocked_inference(module, shared_query, packed_key, value, attention_mask, position_bias, scaling: float,
                       dropout: float, is_causal) -> torch.Tensor:
    """Inference in blocks of sequences (or of query rows, for long ones): per block, per-head queries
    [x W~_Q diag(m_i) s, s e_i] against the packed key [y W~_K, y r_1 .. y r_N] in ONE product, so the one-hot
    columns pick each head's content bias out of the key and no per-key add follows; then mask, softmax in
    place and values, while the block's scores are in cache. The whole (B, N_h, n, m) score tensor, and the
    per-head query tensor, never exist: at full size they are fresh memory the CPU must fault in.

    Beside a busy neighbour (other processes kept busy half a core or more beyond the cores torch leaves free)
    and with more than one torch thread, the blocks are shared out to that many workers that each run a
    block's operations on one thread, taking the next block when done (blocks.BlockWorkers): a core the neighbour
    slows takes fewer blocks, where torch's own split of every operation waits for its slowest thread. On a
    quiet machine torch's split is faster (measured in docs/how-it-works.md), so it runs there."""
    heads, rank = module.mixing.shape
    (batch, n, _), m = shared_query.shape, packed_key.shape[1]
    width = packed_key.shape[-1]  # rank + N_h, or rank where the layer has no content bias
    mixing = (module.mixing * scaling).to(shared_query.dtype)[None, :, None, :]
    head_picks = (torch.eye(heads, dtype=shared_query.dtype, device=shared_query.device) * scaling)[None, :, None, :]
    key_t = packed_key.transpose(1, 2)  # (B, R + N_h, m): a transposed operand, no copy
    rows = max(1, BLOCK_NUMBERS // (heads * (width + m)))
    sequences, rows = (max(1, rows // n), n) if rows >= n else (1, rows)
    output = value.new_empty(batch, n, heads, value.shape[-1])
    blocks = [(slice(first, min(batch, first + sequences)), slice(row, min(n, row + rows)))
              for first in range(0, batch, sequences) for row in range(0, n, rows)]
    inference = torch.is_inference_mode_enabled()

    def run(block) -> None:
        seqs, span = block
        count, length = seqs.stop - seqs.start, span.stop - span.start
        with torch.inference_mode(inference):
            queries, scores = workspace(shared_query, (count, heads, length, width), (count, heads, length, m))
            if width > rank:
                queries[..., rank:] = head_picks
            torch.mul(shared_query[seqs, span].unsqueeze(1), mixing, out=queries[..., :rank])
            torch.bmm(queries.view(count, heads * length, width), key_t[seqs], out=scores.view(count, heads * length, m))
            if position_bias is not None:
                scores += _block_of(position_bias, seqs, span)
            mask = _block_of(attention_mask, seqs, span) if attention_mask is not None else None
            _mask_in_place(scores, mask, module, is_causal, first_row=span.start, rows=n)
            weights = torch.softmax(scores, dim=-1, out=scores)
            if dropout and module.training:
                weights = nn.functional.dropout(weights, p=dropout, training=True)
            output[seqs, span] = torch.matmul(weights, value[seqs]).transpose(1, 2)

    BlockWorkers.run(run, blocks)
    return output


def _block_of(tensor: torch.Tensor, seqs: slice, span: slice) -> torch.Tensor:
    """The part of a (B or 1, H or 1, n or 1, m) mask or bias that one block of sequences and rows adds."""
    tensor = tensor[seqs] if tensor.shape[0] > 1 else tensor
    return tensor[:, :, span] if tensor.shape[2] > 1 else tensor


def _causal(module, is_causal, n: int) -> bool:
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", False)) and n > 1


def _mask_in_place(scores: torch.Tensor, attention_mask, module, is_causal, first_row: int = 0,
                   rows: int | None = None) -> None:
    """Additive float masks are added; boolean masks (True: attend) fill the rest; no mask on a causal module
    means the causal mask, aligned to the last keys (queries are the newest positions). A block holds rows
    first_row.. of `rows` queries."""
    if attention_mask is not None:
        mask = attention_mask[..., : scores.shape[-1]]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            scores += mask
        return
    length, m = scores.shape[-2:]
    n = length if rows is None else rows
    if _causal(module, is_causal, n):
        future = torch.ones(length, m, dtype=torch.bool, device=scores.device).triu(m - n + first_row + 1)
        scores.masked_fill_(future, torch.finfo(scores.dtype).min)


def _per_head_attention(module, query, key, value, attention_mask, **kwargs):
    """Per-head queries and keys handed to the model's real implementation (any other than eager and sdpa)."""
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


def register_attention_function() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, collaborative_attention)
