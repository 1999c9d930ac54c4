"""The math of collaborative attention, on random and structured head stacks (no models)."""


import pytest
import torch

from collab_convert.decompose.als import fit_collaborative, per_head_truncation
from collab_convert.decompose.products import CollaborativeFactors, HeadProducts, content_bias, relative_error
from collab_convert.decompose.spectra import energy_rank, head_gram, key_side_matrix, query_side_matrix, spectra


def random_products(heads=4, head_dim=6, d_in=20, seed=0, shared=None) -> HeadProducts:
    """Random per-head projections; with `shared`, all heads draw from a common low-dimensional subspace."""
    g = torch.Generator().manual_seed(seed)
    if shared is None:
        q = torch.randn(heads * head_dim, d_in, generator=g)
        k = torch.randn(heads * head_dim, d_in, generator=g)
    else:
        basis_q = torch.randn(shared, d_in, generator=g)
        basis_k = torch.randn(shared, d_in, generator=g)
        q = torch.randn(heads * head_dim, shared, generator=g) @ basis_q
        k = torch.randn(heads * head_dim, shared, generator=g) @ basis_k
    return HeadProducts.from_projections(q, k, heads)


def dense_error(products, factors):
    t = products.dense()
    return float((t - factors.dense()).norm() / t.norm())


def test_products_split_weights_into_heads_like_nn_linear():
    q = torch.arange(2 * 3 * 5, dtype=torch.float64).reshape(6, 5)
    k = torch.ones(6, 5, dtype=torch.float64)
    products = HeadProducts.from_projections(q, k, num_heads=2)
    assert products.query_heads.shape == (2, 3, 5)
    assert torch.equal(products.dense()[1], q[3:].T @ k[3:])


def test_factored_relative_error_matches_dense_computation():
    products = random_products()
    factors = per_head_truncation(products, 10)
    assert relative_error(products, factors) == pytest.approx(dense_error(products, factors), rel=1e-9)


def test_full_rank_is_exact():
    products = random_products(heads=3, head_dim=5, d_in=12)
    fit = fit_collaborative(products, products.full_rank)
    assert fit.relative_error < 1e-10
    assert dense_error(products, fit.factors) < 1e-10


def test_full_rank_is_exact_when_heads_outnumber_input_dimensions():
    # N_h d_k > D_in: every head's block still fits, the shared subspace is all of R^D_in.
    products = random_products(heads=4, head_dim=6, d_in=10)
    fit = fit_collaborative(products, products.full_rank)
    assert dense_error(products, fit.factors) < 1e-9


def test_reduced_rank_never_worse_than_best_per_head_truncation():
    for seed in range(3):
        products = random_products(heads=6, head_dim=8, d_in=32, seed=seed, shared=14)
        for rank in (6, 12, 24):
            truncation = relative_error(products, per_head_truncation(products, rank))
            fit = fit_collaborative(products, rank)
            assert fit.relative_error <= truncation + 1e-12
            assert fit.relative_error == pytest.approx(dense_error(products, fit.factors), abs=1e-9)


def test_heads_that_truly_collaborate_are_recovered_exactly():
    # 6 heads of d_k=8 whose products are Q diag(m_i) K^T with one shared 8-dimensional Q and K: rank 8
    # represents them exactly, while per-head truncation at rank 8 must drop most of five heads.
    g = torch.Generator().manual_seed(3)
    shared_q, shared_k = torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g)
    mixing = torch.randn(6, 8, generator=g)
    query = torch.cat([(shared_q * m).T for m in mixing])  # head i: rows (Q diag(m_i))^T
    key = torch.cat([shared_k.T for _ in mixing])
    products = HeadProducts.from_projections(query, key, num_heads=6)
    truncation = relative_error(products, per_head_truncation(products, 8))
    fit = fit_collaborative(products, 8, max_iterations=3000, tolerance=1e-12)
    assert truncation > 0.3
    assert fit.relative_error < 1e-3


def test_per_head_truncation_reports_the_error_of_the_directions_it_drops():
    from collab_convert.decompose.als import _per_head_truncation

    products = random_products(heads=5, head_dim=6, d_in=24, seed=6)
    for rank in (1, 7, 18, 30):
        factors, error = _per_head_truncation(products, rank)
        assert error == pytest.approx(dense_error(products, factors), abs=1e-9)


def test_identical_heads_start_from_the_shared_subspace_and_are_exact_at_head_width():
    # every head scales one product of rank d_k: per-head truncation at R = d_k keeps one head's directions
    # and leaves the others' scale to the mixing, the shared start holds all of them at once
    g = torch.Generator().manual_seed(7)
    query_one, key_one = torch.randn(6, 30, generator=g), torch.randn(6, 30, generator=g)
    scales = torch.tensor([1.0, -0.5, 2.0, 0.25])
    products = HeadProducts.from_projections(torch.cat([query_one * c for c in scales]), key_one.repeat(4, 1), 4)
    fit = fit_collaborative(products, 6)
    assert fit.initialisation == "shared subspace"
    assert fit.initial_error < 1e-6 and dense_error(products, fit.factors) < 1e-6


def test_spectra_of_the_fit_match_the_unfoldings_to_float32_resolution():
    products = random_products(heads=6, head_dim=8, d_in=32, seed=8)
    fit = fit_collaborative(products, 40)  # above the shared start's ranks: eigenvalues alone
    dense = products.dense()
    query_unfolding = dense.permute(1, 0, 2).reshape(products.input_dim, -1)
    expected = torch.linalg.svdvals(query_unfolding)
    assert torch.allclose(fit.query_spectrum[:32], expected, rtol=1e-4, atol=1e-4 * float(expected[0]))


def test_als_error_history_never_increases():
    products = random_products(heads=5, head_dim=6, d_in=24, seed=4)
    fit = fit_collaborative(products, 12, max_iterations=200)
    assert all(b <= a + 1e-12 for a, b in zip(fit.history, fit.history[1:]))


def test_a_fit_of_its_own_products_holds_no_float64_start_while_it_sweeps(monkeypatch):
    """At rank 768 and D_in = 1024 the start is 12.6 MB of float64 factors: the ALS reads it once, and nothing
    holds it through the sweeps."""
    import gc
    import weakref

    from collab_convert.decompose import als

    starts, alive = [], []
    truncation, iterate = als._per_head_truncation, als._iterate

    def watched_start(products, rank):
        factors, error = truncation(products, rank)
        starts.append(weakref.ref(factors.shared_query))
        return factors, error

    def watched_sweeps(*args, **kwargs):
        gc.collect()
        alive.append(starts[-1]() is not None)
        return iterate(*args, **kwargs)

    monkeypatch.setattr(als, "_per_head_truncation", watched_start)
    monkeypatch.setattr(als, "_iterate", watched_sweeps)
    fit = fit_collaborative(random_products(heads=5, head_dim=6, d_in=24, seed=4), 12, own_products=True)
    assert fit.iterations > 0 and alive == [False]


def test_the_line_searchs_jump_is_made_in_the_previous_states_tensors_and_fits_as_before():
    """Two ALS states are held at a time, not three; the jump is the same extrapolation either way."""
    from collab_convert.decompose.als import ALS_DTYPE, _FactoredALS

    products = random_products(heads=5, head_dim=6, d_in=24, seed=4)
    fitter = _FactoredALS(products, ALS_DTYPE)
    start = per_head_truncation(products, 12)
    previous = fitter.sweep(fitter.start(start.shared_key.float(), start.mixing.float(), 1.0))
    current = fitter.sweep(previous)
    expected = torch.lerp(previous.query_weights, current.query_weights, 1.5)
    storage = previous.query_weights.data_ptr()
    jump = fitter.extrapolate(previous, current, 1.5)
    assert jump.query_weights.data_ptr() == storage
    assert torch.equal(jump.query_weights, expected)


def test_fit_is_deterministic():
    products = random_products(seed=5)
    a = fit_collaborative(products, 9)
    b = fit_collaborative(products, 9)
    assert torch.equal(a.factors.shared_query, b.factors.shared_query)
    assert torch.equal(a.factors.mixing, b.factors.mixing)


def test_beats_the_reference_parafac_at_the_same_rank():
    from collab_convert.decompose.reference import fit_reference_parafac

    products = random_products(heads=6, head_dim=8, d_in=32, seed=6, shared=20)
    ours = fit_collaborative(products, 16)
    reference = fit_reference_parafac(products, 16, seed=0)
    assert ours.relative_error < reference.relative_error


def test_spectra_match_dense_unfoldings():
    products = random_products(heads=3, head_dim=4, d_in=9, seed=7)
    t = products.dense()  # (H, D, D)
    query_unfolding = t.permute(1, 0, 2).reshape(9, -1)
    key_unfolding = t.permute(2, 0, 1).reshape(9, -1)
    assert torch.allclose(
        torch.linalg.svdvals(query_side_matrix(products)), torch.linalg.svdvals(query_unfolding)[:9], atol=1e-9
    )
    assert torch.allclose(
        torch.linalg.svdvals(key_side_matrix(products)), torch.linalg.svdvals(key_unfolding)[:9], atol=1e-9
    )
    assert torch.allclose(head_gram(products), t.reshape(3, -1) @ t.reshape(3, -1).T, atol=1e-9)
    s = spectra(products)
    assert torch.allclose(s.head_unfolding, torch.linalg.svdvals(t.reshape(3, -1)), atol=1e-7)


@pytest.mark.parametrize("heads, head_dim, d_in", [(4, 6, 30), (4, 8, 20)])  # wide and tall projections
def test_every_spectrum_matches_an_svd_to_float32_resolution_and_zeroes_what_it_cannot_resolve(heads, head_dim, d_in):
    products = random_products(heads=heads, head_dim=head_dim, d_in=d_in, seed=9, shared=5)
    s = spectra(products)
    dense = products.dense()
    views = {
        "query_projection": products.query_heads.reshape(heads * head_dim, -1),
        "key_projection": products.key_heads.reshape(heads * head_dim, -1),
        "query_unfolding": dense.permute(1, 0, 2).reshape(d_in, -1),
        "key_unfolding": dense.permute(2, 0, 1).reshape(d_in, -1),
    }
    for name, matrix in views.items():
        exact = torch.linalg.svdvals(matrix)
        found = getattr(s, name)
        assert found.dtype == torch.float64 and len(found) == min(d_in, heads * head_dim), name
        exact = exact[: len(found)]  # an unfolding has no more than N_h d_k nonzero values
        resolved = exact > 1e-2 * exact[0]
        assert torch.allclose(found[resolved], exact[resolved], rtol=1e-4), name
        assert torch.all(found[exact < 1e-6 * exact[0]] == 0), name  # rank 5: the rest is rounding, shown as zero


def test_energy_rank_counts_leading_dimensions():
    values = torch.tensor([3.0, 2.0, 1.0, 0.0])  # energies 9, 4, 1 of 14
    assert energy_rank(values, 0.5) == 1
    assert energy_rank(values, 0.9) == 2
    assert energy_rank(values, 0.95) == 3
    assert energy_rank(values, 1.0) == 3


def test_content_bias_reproduces_query_bias_up_to_a_per_query_constant():
    # softmax over keys ignores terms constant across keys: the key bias and b_Q . b_K vanish, and the
    # query bias survives only as y . (W_K^T b_Q).
    g = torch.Generator().manual_seed(8)
    heads, d_k, d_in = 2, 3, 5
    wq, wk = torch.randn(heads * d_k, d_in, generator=g), torch.randn(heads * d_k, d_in, generator=g)
    bq, bk = torch.randn(heads * d_k, generator=g), torch.randn(heads * d_k, generator=g)
    x, y = torch.randn(4, d_in, generator=g), torch.randn(7, d_in, generator=g)
    r = content_bias(wk, bq, heads).float()
    for i in range(heads):
        rows = slice(i * d_k, (i + 1) * d_k)
        original = (x @ wq[rows].T + bq[rows]) @ (y @ wk[rows].T + bk[rows]).T
        collaborative = x @ wq[rows].T @ wk[rows] @ y.T + (y @ r[i])[None, :]
        difference = original - collaborative
        assert torch.allclose(difference, difference[:, :1].expand_as(difference), atol=1e-4)
        assert torch.allclose(original.softmax(-1), collaborative.softmax(-1), atol=1e-5)


def test_balanced_factors_keep_the_product():
    products = random_products(seed=9)
    factors = per_head_truncation(products, 8)
    scaled = CollaborativeFactors(factors.shared_query * 100, factors.shared_key, factors.mixing / 100)
    balanced = scaled.balanced()
    assert torch.allclose(balanced.dense(), factors.dense(), atol=1e-9)
    norms = [balanced.shared_query.norm(dim=0), balanced.shared_key.norm(dim=0), balanced.mixing.norm(dim=0)]
    assert torch.allclose(norms[0], norms[1]) and torch.allclose(norms[1], norms[2])


def test_rank_below_one_is_refused():
    with pytest.raises(ValueError):
        fit_collaborative(random_products(), 0)
