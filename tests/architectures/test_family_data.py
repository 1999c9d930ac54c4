"""Which models are accepted, and the one-line reasons for those that are not."""

import pytest

from collab_convert.architectures.families import family_for
from collab_convert.errors import UnsupportedModelError


def config(**fields):
    return {"num_attention_heads": 4, "hidden_size": 16, **fields}


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta", "electra"])
def test_bert_family_is_recognised(model_type):
    assert family_for(config(model_type=model_type)).name == "bert"


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
