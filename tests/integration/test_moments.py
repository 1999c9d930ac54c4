"""Calibration's running moments (integration/capture.Moments): in self-attention the key side's per-sequence-
centred covariance comes from the query side's Gram matrix, and must equal centring every sequence itself."""

import torch

from collab_convert.integration.capture import Moments


def test_self_attention_key_moments_reuse_the_query_sides_gram_and_equal_the_direct_centring():
    g = torch.Generator().manual_seed(0)
    # sequences with their own large offsets (what per-sequence centring removes), one a single token
    sequences = [torch.randn(n, 24, generator=g) * 3 + torch.randn(24, generator=g) * 20 for n in (5, 9, 1, 12)]
    shared, direct = Moments(), Moments()
    for batch in (sequences[:2], sequences[2:]):
        shared.add_query(batch)
        shared.add_key(batch)  # the very tensors the query side saw: self-attention
        direct.add_query(batch)
        direct.add_key([s.clone() for s in batch])  # other tensors: each sequence centred on its own
    expected = sum((s - s.mean(0)).double().T @ (s - s.mean(0)).double() for s in sequences)
    assert shared.key_count == direct.key_count == sum(len(s) - 1 for s in sequences)
    for moments in (shared, direct):
        assert (moments.key_outer - expected).abs().max() < 1e-5 * expected.abs().max()
