"""The shared rotary key's math, on random projections: exact under RoPE at full budget for grouped, multi-query
and partial-rotary heads with biases; a budget is spent where the energy is and never exceeded; refinement
never makes the held-out attention worse."""

import pytest
import torch

from collab_convert.decompose.shared_key import (
    KeyRanks,
    KeySpectrum,
    HeadGeometry,
    allocate,
    fit_shared_key,
    key_spectrum,
    shared_scores,
    weight_statistics,
)
from collab_convert.decompose.rotary_ops import rotate_half_dims
from collab_convert.decompose.shared_key_batches import AttentionSetting, SharedKeySample
from collab_convert.decompose.shared_key_refinement import refine_shared_key


def rope_tables(length: int, rotary_dim: int, base: float = 10000.0):
    inverse = 1 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inverse[None]
    table = torch.cat([angles, angles], -1)
    return table.cos(), table.sin()


def random_layer(geometry: HeadGeometry, inputs: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, kv, d = geometry.num_heads, geometry.kv_heads, geometry.head_dim
    return (torch.randn(h * d, inputs, generator=g, dtype=torch.float64),
            torch.randn(h * d, generator=g, dtype=torch.float64),
            torch.randn(kv * d, inputs, generator=g, dtype=torch.float64),
            torch.randn(kv * d, generator=g, dtype=torch.float64))


def original_scores(x, layer, geometry, cos, sin):
    query_weight, query_bias, key_weight, key_bias = layer
    n = x.shape[0]
    queries = (x @ query_weight.T + query_bias).view(n, geometry.num_heads, -1).transpose(0, 1)
    keys = (x @ key_weight.T + key_bias).view(n, geometry.kv_heads, -1).transpose(0, 1)
    rotated_q = rotate_half_dims(queries, cos, sin, geometry.rotary_dim)
    rotated_k = rotate_half_dims(keys, cos, sin, geometry.rotary_dim)[geometry.group_of_head]
    return rotated_q @ rotated_k.transpose(1, 2)


@pytest.mark.parametrize("geometry", [
    HeadGeometry(6, 2, 16, 16),  # grouped queries
    HeadGeometry(4, 1, 8, 8),  # multi-query
    HeadGeometry(4, 4, 16, 4),  # partial rotary: most dimensions pass through
], ids=["grouped", "multi-query", "partial-rotary"])
def test_full_budget_reproduces_rotary_scores_at_every_offset(geometry):
    layer = random_layer(geometry)
    x = torch.randn(11, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_tables(11, geometry.rotary_dim)
    factors = fit_shared_key(weight_statistics(*layer, geometry), geometry, KeyRanks.full(geometry))
    n = x.shape[0]
    queries = (x @ layer[0].T + layer[1]).view(n, geometry.num_heads, -1)
    keys = (x @ layer[2].T + layer[3]).view(n, geometry.kv_heads, -1)
    expected = original_scores(x, layer, geometry, cos, sin)
    assert torch.allclose(shared_scores(queries, keys, factors, geometry, cos, sin), expected, atol=1e-9 * float(expected.abs().max()))
    assert factors.ranks.width == geometry.full_width and factors.lost_energy == pytest.approx(0, abs=1e-12)


def test_a_smaller_budget_loses_energy_in_order():
    geometry = HeadGeometry(6, 3, 16, 16)
    statistics = weight_statistics(*random_layer(geometry), geometry)
    losses = [fit_shared_key(statistics, geometry, KeyRanks((r,) * 8, 0)).lost_energy for r in (3, 2, 1)]
    assert losses[0] == pytest.approx(0, abs=1e-12) and 0 < losses[1] < losses[2] < 1


def spectrum(frequency_losses, pass_losses=()):
    return KeySpectrum(torch.tensor(frequency_losses, dtype=torch.float32), torch.tensor(pass_losses, dtype=torch.float32))


def test_allocation_spends_the_budget_where_the_energy_is_and_never_more():
    strong = spectrum([[9.0, 5.0], [4.0, 0.5]])
    weak = spectrum([[1.0, 0.1], [0.2, 0.1]], [3.0, 0.01])
    ranks = allocate([strong, weak], budget=9)
    assert sum(r.width for r in ranks) <= 9
    assert ranks[0] == KeyRanks((2, 1), 0)  # 9, 5, 4 (per number 4.5, 2.5, 2)
    assert ranks[1].frequency_ranks[0] >= 1 and ranks[1].pass_rank == 1  # its strongest, and 3.0 per number
    assert allocate([strong, weak], budget=100) == [KeyRanks((2, 2), 0), KeyRanks((2, 2), 2)]


def test_every_layer_keeps_one_complex_dimension_however_small_the_budget():
    ranks = allocate([spectrum([[9.0, 5.0]]), spectrum([[1e-9, 0.0]])], budget=4)
    assert [r.frequency_ranks for r in ranks] == [(1,), (1,)]


def calibration_samples(layer, geometry: HeadGeometry, generator, count: int = 12, length: int = 10,
                        scale: float = 1.0) -> list[SharedKeySample]:
    """Queries and keys of `layer` on random inputs, as calibration records them."""
    samples = []
    for _ in range(count):
        x = torch.randn(length, 24, generator=generator, dtype=torch.float64) * scale
        samples.append(SharedKeySample((x @ layer[0].T + layer[1]).view(length, geometry.num_heads, -1).float(),
                                    (x @ layer[2].T + layer[3]).view(length, geometry.kv_heads, -1).float()))
    return samples


def test_spectrum_losses_are_sorted_and_sum_to_the_energy():
    geometry = HeadGeometry(4, 2, 8, 8)
    found = key_spectrum(weight_statistics(*random_layer(geometry), geometry), geometry)
    assert found.frequency_losses.shape == (4, 2)
    assert (found.frequency_losses[:, :-1] >= found.frequency_losses[:, 1:]).all()


def test_refinement_never_worsens_the_held_out_attention():
    geometry = HeadGeometry(4, 2, 8, 8)
    layer = random_layer(geometry, seed=5)
    samples = calibration_samples(layer, geometry, torch.Generator().manual_seed(7), scale=0.3)
    cos, sin = rope_tables(10, 8)
    factors = fit_shared_key(weight_statistics(*layer, geometry), geometry, KeyRanks((1, 1, 1, 1), 0))
    refined = refine_shared_key(samples, factors, geometry, AttentionSetting(8**-0.5, cos.float(), sin.float()),
                                steps=60)
    assert refined.kl_after <= refined.kl_before
    assert refined.factors.key_mixing.shape == factors.key_mixing.shape


@pytest.mark.parametrize("rotary_dim, pass_rank", [(8, 0), (4, 3)], ids=["full-rotary", "partial-rotary"])
def test_query_into_the_shared_basis_before_rope_equals_after(rotary_dim, pass_rank):
    # The model applies each head's core as one matrix and then rotates in the shared basis, like the key;
    # a complex scalar per frequency commutes with RoPE, so this equals rotating the query and then the core.
    from collab_convert.decompose.rotary_ops import query_basis_matrix, query_in_shared_basis, rotate_slots

    g = torch.Generator().manual_seed(3)
    heads, head_dim, length = 3, 8, 6
    slots = torch.tensor([0, 0, 1, rotary_dim // 2 - 1])  # a frequency may hold several slots, or none
    core = torch.randn(heads, 2, len(slots), generator=g, dtype=torch.float64)
    pass_core = torch.randn(heads, head_dim - rotary_dim, pass_rank, generator=g, dtype=torch.float64)
    query = torch.randn(2, heads, length, head_dim, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(length, rotary_dim)
    after = query_in_shared_basis(rotate_half_dims(query, cos, sin, rotary_dim), core, pass_core, slots, rotary_dim)
    matrix = query_basis_matrix(core, pass_core, slots, rotary_dim, head_dim)
    before = rotate_slots(query @ matrix, cos[..., slots], sin[..., slots])
    assert torch.allclose(before, after, atol=1e-12)


def test_with_no_rotated_dimension_the_shared_key_is_one_weighted_subspace_exact_at_full_width():
    # Absolute positions (GPT-2, OPT, BART, T5 in the shared-key form): every key dimension is pass-through.
    geometry = HeadGeometry(4, 4, 8, 0)
    layer = random_layer(geometry, seed=2)
    statistics = weight_statistics(*layer, geometry)
    spectrum = key_spectrum(statistics, geometry)
    assert spectrum.frequency_losses.shape == (0, 4) and spectrum.pass_losses.shape == (32,)
    (ranks,) = allocate([spectrum], 5)
    assert ranks == KeyRanks((), 5) and ranks.width == 5  # at least one real direction, never over budget
    factors = fit_shared_key(statistics, geometry, KeyRanks.full(geometry))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 24, generator=g, dtype=torch.float64)
    queries, keys = (x @ layer[0].T + layer[1]).view(7, 4, 8), (x @ layer[2].T + layer[3]).view(7, 4, 8)
    empty = torch.ones(7, 0, dtype=torch.float64)
    scores = shared_scores(queries, keys, factors, geometry, empty, empty)
    original = torch.einsum("nhd,mhd->hnm", queries, keys)
    # exact up to a shift per query (the key mean is dropped: it cancels in the softmax)
    assert torch.allclose(torch.softmax(scores, -1), torch.softmax(original, -1), atol=1e-8)


def test_refinement_reads_bidirectional_attention_with_a_position_bias():
    # Encoders and encoder-decoder attention see every key; T5 adds a position bias to the scores. The
    # refinement's starting KL must be the one of exactly that attention, and refining must not worsen it.
    from collab_convert.decompose.shared_key_batches import StackedSequences

    geometry = HeadGeometry(4, 4, 8, 0)
    layer = random_layer(geometry, seed=6)
    g = torch.Generator().manual_seed(8)
    samples = calibration_samples(layer, geometry, g)
    bias = torch.randn(4, 10, 10, generator=g)
    empty = torch.ones(10, 0)
    setting = AttentionSetting(1.0, empty, empty, causal=False, position_bias=bias)
    factors = fit_shared_key(weight_statistics(*layer, geometry), geometry, KeyRanks((), 6))
    problem = StackedSequences(samples[:1], geometry, setting, torch.zeros(0, dtype=torch.long)).problems()[0]
    expected = torch.log_softmax(torch.einsum("nhd,mhd->hnm", samples[0].queries, samples[0].keys) + bias, -1)
    assert torch.allclose(problem.target[0], expected, atol=1e-5)  # no causal mask, the bias where it belongs
    refined = refine_shared_key(samples, factors, geometry, setting, steps=40)
    assert refined.kl_after <= refined.kl_before and refined.kl_before > 0


@pytest.mark.parametrize("geometry", [HeadGeometry(6, 2, 16, 16), HeadGeometry(4, 4, 16, 4)], ids=["grouped", "partial"])
def test_statistics_are_the_complex_moments_of_each_frequency(geometry):
    # computed in real arithmetic for speed; by definition, frequency j of a head is the complex number
    # (dim j) + i (dim j + rotary_dim/2), and the key moment is sum_tokens k_j k_j^H over the groups
    from collab_convert.decompose.shared_key import statistics_of

    def complex_pairs(vectors, rotary_dim):  # (..., head_dim) -> (..., rotary_dim/2): dim j + i dim (j + half)
        half = rotary_dim // 2
        return torch.complex(vectors[..., :half].double(), vectors[..., half:rotary_dim].double())

    g = torch.Generator().manual_seed(11)
    queries = torch.randn(40, geometry.num_heads, geometry.head_dim, generator=g)
    keys = torch.randn(40, geometry.kv_heads, geometry.head_dim, generator=g)
    statistics = statistics_of(queries, keys, geometry)
    key_pairs = complex_pairs(keys, geometry.rotary_dim)  # (n, G, F)
    expected_moment = torch.einsum("ngf,nhf->fgh", key_pairs, key_pairs.conj())
    query_pairs = complex_pairs(queries, geometry.rotary_dim)  # (n, N_h, F)
    per_head = (query_pairs.abs() ** 2).sum(0)  # (N_h, F)
    expected_energy = torch.stack([per_head[geometry.group_of_head == group].sum(0)
                                   for group in range(geometry.kv_heads)], 1)
    assert torch.allclose(statistics.key_moment, expected_moment, rtol=1e-12, atol=1e-10)
    assert torch.allclose(statistics.query_energy, expected_energy, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("geometry", [HeadGeometry(6, 2, 16, 16), HeadGeometry(4, 4, 16, 4)], ids=["grouped", "partial"])
def test_statistics_of_sequences_laid_end_to_end_are_the_sum_of_each_ones(geometry):
    # the calibration pass computes a batch's statistics in one call; the pass-through keys' covariance still
    # centres each sequence on its own mean
    from collab_convert.decompose.shared_key import statistics_of

    g = torch.Generator().manual_seed(12)
    lengths = [7, 19, 1, 12]
    queries = [torch.randn(n, geometry.num_heads, geometry.head_dim, generator=g) + 3 for n in lengths]
    keys = [torch.randn(n, geometry.kv_heads, geometry.head_dim, generator=g) * (i + 1) - i
            for i, n in enumerate(lengths)]
    each = [statistics_of(q, k, geometry) for q, k in zip(queries, keys)]
    summed = sum(each[1:], each[0])
    joined = statistics_of(torch.cat(queries), torch.cat(keys), geometry, lengths)
    for part, expected in zip(joined._parts(), summed._parts(), strict=True):
        assert torch.allclose(part, expected, rtol=1e-12, atol=1e-10)
    if geometry.pass_dim:  # centred on the batch's mean instead, the covariance would differ
        pooled = statistics_of(torch.cat(queries), torch.cat(keys), geometry)
        assert not torch.allclose(pooled.pass_key_covariance, summed.pass_key_covariance, rtol=1e-3)


def test_the_pass_through_subspace_weighs_block_by_block_as_the_whole_weight_would():
    """The pass-through fit's weight is block-diagonal (one block per key group): its root and inverse root taken
    block by block give the subspace the dense root and its pseudo-inverse give, without (G p)^2 work matrices."""
    from collab_convert.decompose.shared_key import (_matrix_root, _regularised, pass_subspace,
                                                     weighted_subspace)

    geometry = HeadGeometry(6, 3, 8, 0)
    statistics = weight_statistics(*random_layer(geometry, seed=5), geometry)
    statistics.pass_query_moment[1] *= 1e-3  # a weak group: the floor must stay the whole weight's
    for rank in (0, 5, 24):
        blocks = pass_subspace(statistics, rank)
        dense = weighted_subspace(statistics.pass_key_covariance,
                                  _matrix_root(_regularised(torch.block_diag(*statistics.pass_query_moment))), rank)
        assert torch.allclose(blocks.losses, dense.losses, rtol=1e-9, atol=1e-12)
        assert torch.allclose(blocks.from_shared @ blocks.to_shared, dense.from_shared @ dense.to_shared, atol=1e-8)
