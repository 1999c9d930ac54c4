"""The calibrated CP fit whitens the key side with the keys' spread as the original attention sees it: per head and
query row, the covariance of the key inputs under that row's attention. Written out row by row here, and checked
for what makes it the right metric: keys nobody attends to, and shifts softmax ignores, cost nothing."""

import torch

from collab_convert.decompose.refinement import attention_key_covariance

HEADS, HEAD_DIM, WIDTH = 3, 4, 10


def layer(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query_weight = torch.randn(HEADS * HEAD_DIM, WIDTH, generator=generator)
    key_weight = torch.randn(HEADS * HEAD_DIM, WIDTH, generator=generator)
    query_bias = torch.randn(HEADS * HEAD_DIM, generator=generator)
    sequences = [torch.randn(n, WIDTH, generator=generator) for n in (7, 12, 5)]
    return sequences, query_weight, query_bias, key_weight


def written_out(queries, keys, query_weight, query_bias, key_weight, scaling, causal=False):
    """sum over sequences, heads and query rows of Cov_p(y), over the number of (row, head) pairs."""
    total, rows = torch.zeros(WIDTH, WIDTH, dtype=torch.float64), 0
    for x, y in zip(queries, keys):
        q = (x @ query_weight.T + query_bias).view(len(x), HEADS, HEAD_DIM)
        k = (y @ key_weight.T).view(len(y), HEADS, HEAD_DIM)
        for head in range(HEADS):
            scores = q[:, head] @ k[:, head].T * scaling
            if causal:
                scores = scores.masked_fill(torch.ones(len(x), len(y), dtype=torch.bool).triu(1), float("-inf"))
            for p in torch.softmax(scores, -1).double():
                mean = p @ y.double()
                total += (y.double().T * p) @ y.double() - torch.outer(mean, mean)
                rows += 1
    return total / rows


def test_the_metric_is_the_keys_covariance_under_each_rows_attention_averaged_over_heads_and_rows():
    sequences, query_weight, query_bias, key_weight = layer()
    for causal in (False, True):
        found = attention_key_covariance(sequences, sequences, query_weight, query_bias, key_weight, HEADS, 0.5,
                                         causal=causal)
        expected = written_out(sequences, sequences, query_weight, query_bias, key_weight, 0.5, causal)
        assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5)


def test_a_shift_of_every_key_of_a_sequence_costs_nothing():
    # softmax ignores a change that is the same for every key of a row, and so does its spread
    sequences, query_weight, query_bias, key_weight = layer(seed=1)
    shifted = [y + torch.randn(WIDTH) * 3 for y in sequences]
    plain = attention_key_covariance(sequences, sequences, query_weight, query_bias, key_weight, HEADS, 0.5)
    moved = attention_key_covariance(sequences, shifted, query_weight, query_bias, key_weight, HEADS, 0.5)
    assert torch.allclose(plain, moved, rtol=1e-3, atol=1e-4)


def test_a_direction_only_ignored_keys_vary_in_weighs_nothing():
    # one key per sequence gets all the attention (a sink): the others may vary as they like, unseen
    sequences, query_weight, query_bias, key_weight = layer(seed=2)
    sink = torch.zeros(WIDTH)
    sink[0] = 1.0
    keys = [torch.cat([sink[None] * 40, torch.randn(len(x) - 1, WIDTH) * torch.tensor([0.0] + [1.0] * 9)])
            for x in sequences]
    attends_to_the_sink = torch.zeros(HEADS * HEAD_DIM, WIDTH)
    attends_to_the_sink[:, 0] = 1.0
    found = attention_key_covariance(sequences, keys, torch.zeros_like(query_weight), torch.ones(HEADS * HEAD_DIM),
                                     attends_to_the_sink, HEADS, 1.0)
    assert float(found.abs().max()) < 1e-6


def test_a_rank_search_weighs_each_layers_keys_once_and_the_final_fit_once_more(tiny_bert, calibration_file,
                                                                                 tmp_path, monkeypatch):
    from collab_convert import CompressOptions, compress
    from collab_convert.decompose import refinement

    computed = []

    def counted(*args, **kwargs):
        computed.append(args[0])
        return attention_key_covariance(*args, **kwargs)

    monkeypatch.setattr(refinement, "attention_key_covariance", counted)
    result = compress(str(tiny_bert), CompressOptions(rank="auto", target_cosine=0.995, output=tmp_path / "out",
                                                      calibration=calibration_file, refine_steps=5))
    layers = len(result.layers)
    assert result.rank_choice["mode"] == "fidelity target"
    # the search tried several ranks, each layer's metric computed at the first; the refined fit once more
    assert len(computed) == 2 * layers


def test_a_full_rank_fit_skips_the_metric_it_does_not_need(tiny_bert, calibration_file, tmp_path, monkeypatch):
    from collab_convert import CompressOptions, compress
    from collab_convert.decompose import refinement

    computed = []
    monkeypatch.setattr(refinement, "attention_key_covariance", lambda *args, **kwargs: computed.append(args))
    result = compress(str(tiny_bert), CompressOptions(rank=48, output=tmp_path / "out", calibration=calibration_file,
                                                      refine_steps=5))
    assert {layer.rank for layer in result.layers} == {48}  # the tiny BERT's full rank: exact whatever the metric
    assert computed == []
    assert result.fidelity["cosine_mean"] > 0.9999
