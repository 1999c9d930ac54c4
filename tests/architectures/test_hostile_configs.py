"""Hostile or broken configs (zero or negative heads, widths that do not split, wrong types, missing keys,
fields that disagree with the tensors) end in a clear error, never another exception: fuzzed with hypothesis
over a tiny BERT and a tiny grouped-query Llama."""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collab_convert.architectures.source import open_model
from collab_convert.errors import CollabError
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    save_tiny(root / "bert")
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), root / "llama")
    return root


values = st.one_of(st.none(), st.integers(-3, 70), st.text(max_size=4), st.floats(allow_nan=True),
                   st.lists(st.integers(0, 4), max_size=2), st.booleans())
KEYS = ["model_type", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "rope_parameters",
        "partial_rotary_factor", "rotary_pct", "qk_layernorm", "position_embedding_type", "num_hidden_layers"]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["bert", "llama"]), changes=st.dictionaries(st.sampled_from(KEYS), values, max_size=4),
       model_type=st.sampled_from(["bert", "llama", "qwen2", "phi3", "gpt_neox", "phi", None]))
def test_fuzzed_configs_open_or_fail_clearly(models, tmp_path_factory, which, changes, model_type):
    folder = tmp_path_factory.mktemp("case") / which
    shutil.copytree(models / which, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    if model_type is not None:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    try:
        open_model(str(folder)).close()
    except CollabError:
        pass


@pytest.mark.parametrize("changes, fragment", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": -4}, "num_attention_heads"),
    ({"num_attention_heads": "four"}, "num_attention_heads"),
    ({"num_attention_heads": 3}, "does not split"),
    ({"partial_rotary_factor": "half"}, "rotary"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}}, "rotary width"),
])
def test_broken_rotary_configs_say_what_is_wrong(models, tmp_path, changes, fragment):
    folder = tmp_path / "llama"
    shutil.copytree(models / "llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CollabError, match=fragment):
        open_model(str(folder))
