"""Which models are accepted, and the one-line reasons for those that are not."""

import pytest

from collab_convert.architectures.lookup import family_for
from collab_convert.errors import UnsupportedModelError


def config(**fields):
    return {"num_attention_heads": 4, "hidden_size": 16, **fields}


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta", "electra"])
def test_bert_family_is_recognised(model_type):
    assert family_for(config(model_type=model_type))[0].name == "bert"


@pytest.mark.parametrize(
    "model_type, reason",
    [("gptj", "rotary"), ("cohere", "rotary"), ("deberta-v2", "disentangled"), ("whisper-x", "not supported")],
)
def test_unsupported_models_are_refused_with_a_reason(model_type, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        family_for(config(model_type=model_type))


def test_relative_position_bert_is_refused():
    with pytest.raises(UnsupportedModelError, match="relative_key"):
        family_for(config(model_type="bert", position_embedding_type="relative_key"))


def test_missing_model_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="no model_type"):
        family_for(config())


def test_inputs_are_cut_where_the_position_embeddings_end():
    from collab_convert.architectures.lookup import position_limit

    assert position_limit({"model_type": "bert", "max_position_embeddings": 512}) == 512
    # RoBERTa's positions start after the padding index: 514 embeddings hold 512 tokens
    assert position_limit({"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}) == 512
    assert position_limit({"model_type": "gpt2", "n_positions": 1024}) == 1024
    assert position_limit({"model_type": "t5"}) is None  # relative positions: no limit stated

    from collab_convert.architectures.lookup import within_positions

    assert within_positions({"model_type": "bert", "max_position_embeddings": 64}, 128) == 64
    assert within_positions({"model_type": "bert", "max_position_embeddings": 512}, 128) == 128
    assert within_positions({"model_type": "t5"}, 128) == 128
