"""Collaborative attention for plain PyTorch: every torch.nn.MultiheadAttention inside any nn.Module.

    import collab_convert
    replaced = collab_convert.collaborate_multihead_attention(model, rank=128)

Each nn.MultiheadAttention is replaced in place by a CollaborativeMultiheadAttention with the same call
signature (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal),
the same batch_first convention and the same outputs. At full rank (embed_dim) the outputs are equal to
float precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..decompose.als import fit_collaborative
from ..decompose.products import HeadProducts, content_bias


class CollaborativeMultiheadAttention(nn.Module):
    # nn.TransformerEncoderLayer inspects these to pick its fused fast path; None sends it down the plain path,
    # which calls this module like any nn.MultiheadAttention.
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        rank: int,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        batch_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.rank = embed_dim, num_heads, rank
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first = dropout, batch_first
        self.shared_query = nn.Linear(embed_dim, rank, bias=False, **factory)
        self.shared_key = nn.Linear(self.kdim, rank, bias=False, **factory)
        self.mixing = nn.Parameter(torch.empty(num_heads, rank, **factory))
        self.content_bias = nn.Parameter(torch.zeros(num_heads, self.kdim, **factory))
        self.value = nn.Linear(self.vdim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # From here: (sequence, batch, features), as nn.MultiheadAttention computes internally.
        target, batch, _ = query.shape
        source = key.shape[0]
        heads = self.num_heads

        shared_q = self.shared_query(query).permute(1, 0, 2)  # (B, L, R)
        shared_k = self.shared_key(key).permute(1, 0, 2)  # (B, S, R)
        bias = (key @ self.content_bias.T).permute(1, 2, 0)  # (B, H, S)
        per_head_q = shared_q.unsqueeze(1) * self.mixing[None, :, None, :]  # (B, H, L, R)
        scores = torch.matmul(per_head_q, shared_k.unsqueeze(1).transpose(-1, -2)) + bias.unsqueeze(2)
        scores = scores / math.sqrt(self.head_dim)  # the original 1/sqrt(d_k)

        if is_causal and attn_mask is None:
            attn_mask = torch.ones(target, source, dtype=torch.bool, device=query.device).triu(1)
        if attn_mask is not None:
            mask = attn_mask.view(batch, heads, target, source) if attn_mask.dim() == 3 else attn_mask
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if key_padding_mask is not None:
            padding = key_padding_mask[:, None, None, :]
            if padding.dtype == torch.bool:
                scores = scores.masked_fill(padding, float("-inf"))
            else:
                scores = scores + padding

        weights = torch.softmax(scores, dim=-1)
        if self.training and self.dropout > 0:
            weights = nn.functional.dropout(weights, p=self.dropout)
        values = self.value(value).view(source, batch, heads, self.head_dim).permute(1, 2, 0, 3)  # (B, H, S, d)
        context = torch.matmul(weights, values)  # (B, H, L, d)
        output = self.out_proj(context.permute(2, 0, 1, 3).reshape(target, batch, self.embed_dim))

        if unbatched:
            output = output.squeeze(1)
        elif self.batch_first:
            output = output.transpose(0, 1)
        if not need_weights:
            return output, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return output, (weights.squeeze(0) if unbatched else weights)


@dataclass
class ReplacedAttention:
    name: str
    rank: int
    relative_error: float


def _split_projections(mha: nn.MultiheadAttention):
    e = mha.embed_dim
    if mha._qkv_same_embed_dim:
        weight = mha.in_proj_weight
        query_w, key_w, value_w = weight[:e], weight[e : 2 * e], weight[2 * e :]
    else:
        query_w, key_w, value_w = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bias = mha.in_proj_bias
    if bias is None:
        return query_w, key_w, value_w, None, None
    return query_w, key_w, value_w, bias[:e], bias[2 * e :]


def collaborative_from(mha: nn.MultiheadAttention, rank: int | None = None) -> tuple[nn.Module, float]:
    """The collaborative equivalent of one nn.MultiheadAttention, fitted from its weights."""
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(
            "nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported: their extra key is not a "
            "projection of the input, so no shared key projection can reproduce it"
        )
    rank = rank or mha.embed_dim
    if not 1 <= rank <= mha.embed_dim:
        raise ValueError(f"rank must be between 1 and embed_dim={mha.embed_dim}, got {rank}")
    query_w, key_w, value_w, query_b, value_b = _split_projections(mha)
    products = HeadProducts.from_projections(query_w, key_w, mha.num_heads)
    fit = fit_collaborative(products, rank)
    new = CollaborativeMultiheadAttention(
        mha.embed_dim,
        mha.num_heads,
        rank,
        kdim=mha.kdim,
        vdim=mha.vdim,
        dropout=mha.dropout,
        batch_first=mha.batch_first,
        bias=query_b is not None,
        device=query_w.device,
        dtype=query_w.dtype,
    )
    with torch.no_grad():
        new.shared_query.weight.copy_(fit.factors.shared_query.T)
        new.shared_key.weight.copy_(fit.factors.shared_key.T)
        new.mixing.copy_(fit.factors.mixing)
        new.content_bias.copy_(content_bias(key_w, query_b, mha.num_heads))
        new.value.weight.copy_(value_w)
        if value_b is not None:
            new.value.bias.copy_(value_b)
        new.out_proj.load_state_dict(mha.out_proj.state_dict())
    new.train(mha.training)
    return new, fit.relative_error


def collaborate_multihead_attention(model: nn.Module, rank: int | None = None) -> list[ReplacedAttention]:
    """Replace every nn.MultiheadAttention inside `model` (in place) by its collaborative form at `rank`.

    rank=None keeps full rank (embed_dim): exact. Returns what was replaced, with each fit's relative error.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    if isinstance(model, nn.MultiheadAttention):
        raise ValueError("pass the module that contains the nn.MultiheadAttention, or use collaborative_from()")
    replaced = []
    for name, module in targets:
        new, error = collaborative_from(module, rank)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced.append(ReplacedAttention(name, new.rank, error))
    return replaced
