"""A CP refinement step scores every head against the one shared key, making the per-head queries a few heads at
a time: its scores and gradients must be those of the plain expression, and a chunk must hold only its heads."""

import pytest
import torch

from collab_convert.decompose import mixed_scores as module
from collab_convert.decompose.mixed_scores import head_chunks, mixed_scores

SIZE, HEADS, QUERIES, KEYS, RANK = 3, 5, 7, 9, 6


def operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(SIZE, QUERIES, RANK), (HEADS, RANK), (SIZE, KEYS, RANK)]
    return [torch.randn(*shape, generator=g).requires_grad_(True)
            for shape in shapes]


def plain(queries, mixing, keys, dtype):
    """Autograd on the expression written out: every head's queries at once."""
    per_head = queries.unsqueeze(1) * mixing[None, :, None, :]  # (B, H, n, R)
    flat = per_head.reshape(SIZE, HEADS * QUERIES, RANK).to(dtype) @ keys.transpose(1, 2).to(dtype)
    return flat.float().view(SIZE, HEADS, QUERIES, KEYS)


def scores_and_gradients(score, dtype):
    tensors = operands()
    weights = torch.randn(SIZE, HEADS, QUERIES, KEYS, generator=torch.Generator().manual_seed(1))
    scores = score(*tensors, dtype)
    (scores * weights).sum().backward()
    return [scores.detach()] + [t.grad for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_one_chunk_the_scores_and_gradients_are_autograds_to_the_bit(dtype):
    ours, theirs = scores_and_gradients(mixed_scores, dtype), scores_and_gradients(plain, dtype)
    for got, expected in zip(ours, theirs, strict=True):
        assert torch.equal(got, expected)


def test_in_chunks_of_heads_the_scores_and_gradients_agree_with_autograds_to_rounding(monkeypatch):
    per_head = SIZE * QUERIES * RANK * 4
    monkeypatch.setattr(module, "CHUNK_BYTES", 2 * per_head)  # chunks of 2, 2 and 1 heads
    assert head_chunks(HEADS, per_head) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    ours, theirs = scores_and_gradients(mixed_scores, torch.float32), scores_and_gradients(plain, torch.float32)
    for got, expected in zip(ours, theirs, strict=True):  # products of other shapes, sums in another order
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_chunks_per_head_queries_stay_under_the_limit_with_at_least_one_head_each():
    assert head_chunks(16, 786_432, limit=4 << 20) == [slice(s, s + 4) for s in range(0, 16, 4)]  # rank 768
    assert head_chunks(12, 196_608, limit=4 << 20) == [slice(0, 12)]  # MiniLM at rank 192: one chunk
    assert head_chunks(4, 10 << 20, limit=4 << 20) == [slice(h, h + 1) for h in range(4)]  # one head over it


def test_a_step_in_chunks_holds_no_per_head_queries_of_every_head(monkeypatch):
    """The largest tensor made while scoring and differentiating in chunks is one chunk's per-head queries."""
    largest = [0]
    per_head = SIZE * QUERIES * RANK * 4
    monkeypatch.setattr(module, "CHUNK_BYTES", per_head)  # one head a chunk
    made = module._per_head

    def watched(queries, mixing, heads, dtype):
        out = made(queries, mixing, heads, dtype)
        largest[0] = max(largest[0], out.shape[1])
        return out

    monkeypatch.setattr(module, "_per_head", watched)
    queries, mixing, keys = operands()
    mixed_scores(queries, mixing, keys).sum().backward()
    assert largest[0] == QUERIES  # rows of one head, never HEADS x QUERIES
