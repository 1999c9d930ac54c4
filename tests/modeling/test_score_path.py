"""The shared-key score path gives what per-head attention gives: masks, content bias, causal, grouped values,
eager and SDPA alike."""

import pytest
import torch
from torch import nn

from collab_convert import CompressOptions, compress
from collab_convert.modeling.attention import _per_head_attention, shared_key_attention


class FakeModule(nn.Module):
    """What the score path reads from a collaborative module: mixing, its origin, config, causality."""

    collaborative_origin = nn.Module
    is_collaborative = True

    def __init__(self, heads, rank, causal=False):
        super().__init__()
        self.mixing = nn.Parameter(torch.randn(heads, rank))
        self.is_causal = causal
        self.config = type("Config", (), {"_attn_implementation": "eager"})()


def pseudo_heads(batch, n, m, heads, rank, head_dim):
    """Shared query and packed key [shared key, per-head bias], padded to head_dim chunks, as (B, P, len, d)."""
    def padded(width, length):
        tensor = torch.zeros(batch, length, -(-width // head_dim) * head_dim)
        tensor[..., :width] = torch.randn(batch, length, width)
        return tensor.view(batch, length, -1, head_dim).transpose(1, 2)
    return padded(rank, n), padded(rank + heads, m)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "causal-none", "full-float"])
@pytest.mark.parametrize("value_heads", [4, 1, 2])
def test_shared_key_path_matches_per_head_attention(mask_kind, value_heads):
    torch.manual_seed(0)
    batch, n, heads, rank, head_dim = 2, 5, 4, 6, 8
    module = FakeModule(heads, rank, causal=mask_kind == "causal-none")
    query, key = pseudo_heads(batch, n, n, heads, rank, head_dim)
    value = torch.randn(batch, value_heads, n, head_dim)
    mask = None
    if mask_kind == "padding":
        mask = torch.zeros(batch, 1, 1, n)
        mask[1, ..., 3:] = torch.finfo(torch.float32).min
    elif mask_kind == "bool":
        mask = torch.ones(batch, 1, n, n, dtype=torch.bool).tril()
    elif mask_kind == "full-float":
        mask = torch.randn(batch, 1, n, n)
    fast, fast_weights = shared_key_attention(module, query, key, value, mask, scaling=0.3)
    if mask_kind == "bool":
        mask = torch.zeros(batch, 1, n, n).masked_fill(~mask, torch.finfo(torch.float32).min)
    if mask_kind == "causal-none":
        mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    slow, slow_weights = _per_head_attention(module, query, key, value, mask, scaling=0.3)
    assert torch.allclose(fast, slow, atol=1e-5) and torch.allclose(fast_weights, slow_weights, atol=1e-6)
    assert fast.shape == (batch, n, heads, head_dim)


def test_eager_and_sdpa_give_the_same_collaborative_model(tiny_bert, tmp_path, token_batch):
    from transformers import AutoModel

    compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out"))
    outputs = {}
    for implementation in ("eager", "sdpa"):
        model = AutoModel.from_pretrained(tmp_path / "out", attn_implementation=implementation).eval()
        with torch.no_grad():
            outputs[implementation] = model(**token_batch).last_hidden_state
    assert torch.allclose(outputs["eager"], outputs["sdpa"], atol=1e-5)
