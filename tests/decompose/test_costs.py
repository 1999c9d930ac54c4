"""Parameter and FLOP accounting, checked against hand-computed BERT-base figures."""

from collab_convert.decompose.costs import LayerShape, candidate_ranks, collaborative_cost, original_cost

BERT_BASE = LayerShape(input_dim=768, num_heads=12, head_dim=64)


def test_standard_parameters_do_not_depend_on_the_number_of_heads():
    twelve = original_cost(BERT_BASE).parameters
    one = original_cost(LayerShape(768, 1, 768)).parameters
    ninety_six = original_cost(LayerShape(768, 96, 8)).parameters
    assert twelve == one == ninety_six == 2 * 768 * 768 + 2 * 768 == 1_181_184


def test_collaborative_parameters_for_bert_base():
    assert collaborative_cost(BERT_BASE, 384).parameters == 603_648
    assert collaborative_cost(BERT_BASE, 256).parameters == 405_504
    assert collaborative_cost(BERT_BASE, 128).parameters == 207_360


def test_score_flops_grow_with_heads_times_rank():
    before, after = original_cost(BERT_BASE), collaborative_cost(BERT_BASE, 384)
    assert before.score_flops[512] == 512 * 512 * 768
    assert after.score_flops[512] == 512 * 512 * 12 * 385  # R plus the content-bias column, per head
    assert after.score_flops[2048] > before.score_flops[2048]  # the honest trade-off at long sequences


def test_key_cache_shrinks_to_the_shared_key():
    assert original_cost(BERT_BASE).key_cache_per_token == 768
    assert collaborative_cost(BERT_BASE, 256).key_cache_per_token == 256 + 12


def test_candidate_ranks_halve_from_full_rank():
    assert candidate_ranks(LayerShape(384, 12, 32)) == [384, 192, 96, 48]
