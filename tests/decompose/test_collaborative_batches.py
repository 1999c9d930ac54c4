"""A CP refinement step gathers its minibatch from sequences stacked once per layer: what it gathers must be each
sequence's own attention at the rows it draws, whatever their lengths, with causal masks and position biases,
and the stacked queries and keys must hold what half precision cannot."""

import pytest
import torch

from collab_convert.decompose.refinement import AttentionTarget, _projected, _Packed

HEADS, D_IN, HEAD_DIM, SCALING = 3, 12, 4, 0.5
LENGTHS = [9, 4, 12, 7, 12, 5]


def layer_and_sequences(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # scaled as trained layers are: scores of a few units, not a one-hot attention
    wq, wk = (torch.randn(HEADS * HEAD_DIM, D_IN, generator=g) * D_IN**-0.5 * 2 for _ in range(2))
    bq = torch.randn(HEADS * HEAD_DIM, generator=g)
    sequences = [torch.randn(n, D_IN, generator=g).half() for n in LENGTHS]  # samples wait in float16
    return wq, bq, wk, sequences


def own_attention(x, wq, bq, wk, causal, position_bias=None):
    """(H, n, n): one sequence's attention written out head by head."""
    x = x.float()
    q = (x @ wq.T + bq).view(len(x), HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ wk.T).view(len(x), HEADS, HEAD_DIM).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * SCALING
    if position_bias is not None:
        scores = scores + position_bias[:, : len(x), : len(x)]
    if causal:
        scores = scores.masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1)


def drawn_positions(batch_x, sequence) -> list[int]:
    """Which positions of `sequence` the gathered query rows are (random inputs: every row is unique)."""
    return [int((sequence.float() == row).all(-1).nonzero()[0]) for row in batch_x]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("biased", [False, True])
def test_a_gathered_minibatch_is_each_sequences_own_attention_at_the_drawn_rows(causal, biased):
    wq, bq, wk, sequences = layer_and_sequences()
    bias = torch.randn(HEADS, 12, 12, generator=torch.Generator().manual_seed(1)) if biased else None
    stacked = _Packed(sequences, sequences, wq, bq, wk, HEADS, "cpu")
    chosen = torch.tensor([1, 2, 3, 5])  # lengths 4, 12, 7, 5: two shorter than the rows drawn
    batch = stacked.batch(chosen, 6, SCALING, causal, torch.Generator().manual_seed(2), bias)
    assert batch.rows == HEADS * (4 + 6 + 6 + 5)
    for row, index in enumerate(chosen.tolist()):
        sequence = sequences[index]
        real = min(6, len(sequence))
        positions = drawn_positions(batch.x[row, :real], sequence)
        assert positions == sorted(set(positions))  # drawn without replacement, in order
        expected = own_attention(sequence, wq, bq, wk, causal, bias)[:, positions]
        got = batch.target_p[row, :, :real, : len(sequence)]
        assert (got - expected).abs().max() < 1e-3  # queries and keys stored in float16
        assert batch.target_p[row, :, real:].abs().sum() == 0  # padding rows count for nothing
        assert batch.target_p[row, :, :, len(sequence):].abs().sum() == 0  # nor do padding keys


def test_a_training_minibatch_leaves_out_only_the_kls_constant_part():
    """Steps need the gradient alone: the entropy of the original attention is not computed for them (and their
    probabilities come from one softmax, not the exponential of the log-probabilities: the same to rounding)."""
    wq, bq, wk, sequences = layer_and_sequences()
    stacked = _Packed(sequences, sequences, wq, bq, wk, HEADS, "cpu")
    chosen = torch.tensor([0, 2, 4])
    full = stacked.batch(chosen, 5, SCALING, False, torch.Generator().manual_seed(0))
    lean = stacked.batch(chosen, 5, SCALING, False, torch.Generator().manual_seed(0), entropy=False)
    assert torch.allclose(full.target_p, lean.target_p, rtol=1e-5, atol=1e-7)
    assert lean.entropy == 0.0 and full.entropy < 0


def test_sequences_are_packed_without_padding():
    """A mix of short and long calibration texts costs what its rows do, not the longest's length each."""
    wq, bq, wk, sequences = layer_and_sequences()
    stacked = _Packed(sequences, sequences, wq, bq, wk, HEADS, "cpu")
    assert stacked.x.shape[0] == stacked.queries.shape[0] == sum(LENGTHS) and stacked.y is stacked.x


def test_queries_that_half_precision_cannot_hold_are_stored_in_float32():
    inputs = torch.ones(5000, 8, dtype=torch.float16)  # several chunks of rows
    inputs[-1] *= 10
    small = _projected(inputs[:-1], torch.full((4, 8), 1e3), 0.0, 2)  # 8,000 in every row: float16 holds it
    large = _projected(inputs, torch.full((4, 8), 1e3), 0.0, 2)  # the last row, in the second chunk: 80,000
    assert small.dtype == torch.float16 and large.dtype == torch.float32 and large.shape == (5000, 2, 2)
    assert float(large[0, 0, 0]) == 8e3 and float(large[-1, 1, 1]) == 8e4  # the first chunk kept through the switch


def test_the_projection_a_chunk_of_rows_at_a_time_is_the_whole_product():
    from collab_convert.decompose.refinement import PROJECTED_ROWS

    g = torch.Generator().manual_seed(3)
    inputs = torch.randn(2 * PROJECTED_ROWS + 7, 16, generator=g).half()  # three chunks, the last one short
    weight, bias = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    whole = (inputs.float() @ weight.T + bias).half().view(-1, 2, 4)
    assert torch.allclose(_projected(inputs, weight, bias, 2).float(), whole.float(), rtol=1e-3, atol=1e-3)


def test_held_out_checks_in_small_batches_judge_as_one_batch_would():
    """The checks run a step's number of sequences at a time (their temporaries stay on the reused heap); the mean
    KL over all held-out rows is the same as in one batch."""
    wq, bq, wk, sequences = layer_and_sequences()
    many = [s for _ in range(10) for s in sequences]  # 60 sequences: 6 held out, checked 4 and 2 at a time
    target = AttentionTarget(many, many, wq, bq, wk, HEADS, SCALING)
    g = torch.Generator().manual_seed(3)
    parameters = [torch.randn(D_IN, 5, generator=g), torch.randn(D_IN, 5, generator=g),
                  torch.randn(HEADS, 5, generator=g), torch.randn(HEADS, D_IN, generator=g)]
    assert [b.x.shape[0] for b in target.check_batches] == [4, 2]
    from collab_convert.decompose import refinement

    one = list(refinement._original_attention(many[-6:], many[-6:], wq, bq, wk, HEADS, SCALING, False, rows=64,
                                              sequences=32))  # every row of every sequence: the draws do not matter
    together = sum(float(refinement._collaborative_kl(parameters, b, SCALING)) * b.rows for b in one)
    assert target.held_out_kl(parameters) == pytest.approx(together / sum(b.rows for b in one), rel=1e-5)
