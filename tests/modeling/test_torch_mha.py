"""Plain PyTorch: nn.MultiheadAttention inside any module becomes collaborative."""

import pytest
import torch
from torch import nn

from collab_convert import collaborate_multihead_attention
from collab_convert.modeling.torch_mha import CollaborativeMultiheadAttention


class TinyEncoder(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.layers = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(24, 4, 48, dropout=0.0, batch_first=batch_first), num_layers=2,
            enable_nested_tensor=False,
        )
        self.cross = nn.MultiheadAttention(24, 6, batch_first=batch_first)

    def forward(self, x, memory, padding):
        h = self.layers(x, src_key_padding_mask=padding)
        return self.cross(h, memory, memory, key_padding_mask=padding)[0] + h


def with_biases(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.5)
    return model.eval()


@pytest.mark.parametrize("batch_first", [True, False])
def test_full_rank_is_exact_inside_a_model(batch_first):
    model = with_biases(TinyEncoder(batch_first))
    x = torch.randn(3, 7, 24) if batch_first else torch.randn(7, 3, 24)
    memory = torch.randn_like(x)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = True
    with torch.no_grad():
        expected = model(x, memory, padding)
    replaced = collaborate_multihead_attention(model)
    assert [r.name for r in replaced] == ["layers.layers.0.self_attn", "layers.layers.1.self_attn", "cross"]
    assert isinstance(model.cross, CollaborativeMultiheadAttention)
    with torch.no_grad():
        got = model(x, memory, padding)
    assert (got - expected).abs().max() / expected.abs().max() < 1e-5


def test_weights_masks_and_unbatched_inputs_match():
    torch.manual_seed(1)
    original = with_biases(nn.MultiheadAttention(16, 4))
    holder = nn.Module()
    holder.attention = original
    q, k = torch.randn(5, 16), torch.randn(6, 16)
    causal = torch.ones(5, 6, dtype=torch.bool).triu(1)
    with torch.no_grad():
        out_a, weights_a = original(q, k, k, attn_mask=causal, average_attn_weights=False)
        collaborate_multihead_attention(holder)
        out_b, weights_b = holder.attention(q, k, k, attn_mask=causal, average_attn_weights=False)
    assert torch.allclose(out_a, out_b, atol=1e-5)
    assert torch.allclose(weights_a, weights_b, atol=1e-5)


def test_reduced_rank_runs_and_reports_its_error():
    model = with_biases(TinyEncoder(True))
    replaced = collaborate_multihead_attention(model, rank=8)
    assert all(0 < r.relative_error < 1 and r.rank == 8 for r in replaced)
    x = torch.randn(2, 5, 24)
    assert torch.isfinite(model(x, x, torch.zeros(2, 5, dtype=torch.bool))).all()


def test_extra_bias_key_is_refused():
    holder = nn.Module()
    holder.attention = nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        collaborate_multihead_attention(holder)
