"""The checkpoint format's one owner: tensor names and shapes, and the record in quantization_config."""

import json

import pytest
import torch

from collab_convert.format import (
    COLLABORATIVE_TENSORS,
    FORMAT_VERSION,
    FormatConfig,
    HeadCounts,
    LayerFormat,
    collaborative_tensors,
    is_collaborative,
    layer_form,
    original_config,
    write_config,
)


def test_layer_tensors_have_the_shapes_the_specs_announce():
    layer = LayerFormat(rank=6, num_heads=3, query_input_dim=10, key_input_dim=10)
    specs = layer.specs("blocks.0.attn", torch.float16)
    tensors = collaborative_tensors(
        "blocks.0.attn", torch.randn(10, 6), torch.randn(10, 6), torch.randn(3, 6), torch.randn(3, 10), torch.float16
    )
    assert [s.name for s in specs] == [f"blocks.0.attn.{suffix}" for suffix in COLLABORATIVE_TENSORS]
    assert [s.name for s in specs] == list(tensors)
    assert all(tensors[s.name].shape == s.shape and tensors[s.name].dtype == torch.float16 for s in specs)


def test_config_records_the_transform_next_to_untouched_architecture(tmp_path):
    original = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 10}
    layers = {
        "a": FormatConfig.layer_entry(4, HeadCounts(2, 2)),
        "b": FormatConfig.layer_entry(4, HeadCounts(4, 1)),
    }
    write_config(original, "bert", "tucker-cp-als", layers, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["BertModel"] and written["model_type"] == "bert"
    assert is_collaborative(written) and not is_collaborative(original)
    record = written["quantization_config"]
    assert record["format_version"] == 1  # the CP form's record is unchanged since format 1
    assert record["layers"] == {"a": {"rank": 4, "num_heads": 2}, "b": {"rank": 4, "num_heads": 4, "kv_heads": 1}}
    read = FormatConfig(**{k: v for k, v in record.items() if k != "quant_method"})
    assert read.layer_shapes() == {"a": (4, HeadCounts(2, 2)), "b": (4, HeadCounts(4, 1))}


def test_a_guarded_checkpoint_declares_its_own_model_type_and_records_the_original(tmp_path):
    """transformers alone refuses a model_type it does not know; read through the record, the config is the
    original's again, without the auto_map that names the carried code."""
    original = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 10}
    layers = {"a": FormatConfig.layer_entry(4, HeadCounts(2, 2))}
    write_config(original, "bert", "tucker-cp-als", layers, tmp_path, guarded=True,
                 auto_map={"AutoConfig": "collaborative_modeling.CollaborativeBertConfig"})
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "collaborative_bert" and written["architectures"] == ["BertModel"]
    assert written["quantization_config"]["original_model_type"] == "bert"
    read = original_config(written)
    assert read["model_type"] == "bert" and "auto_map" not in read and is_collaborative(read)
    assert original_config(original) is original  # any other config is read as it is


def test_a_newer_format_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="upgrade collab-convert"):
        FormatConfig(family="bert", layers={}, format_version=FORMAT_VERSION + 1)


def test_a_shared_key_record_states_the_version_that_names_its_form(tmp_path):
    entry = FormatConfig.shared_key_entry(HeadCounts(4, 2), 8, 8, [1, 1, 0, 0], 0)
    write_config({"model_type": "llama"}, "llama", None, {"a": entry}, tmp_path, format_version=2)
    record = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert record["format_version"] == 2 == FORMAT_VERSION and "method" not in record  # no decomposition method
    assert layer_form(record["layers"]["a"]) == "shared-key"


def test_records_of_older_versions_still_read():
    from collab_convert.architectures.lookup import family_named

    assert layer_form({"form": "rotary-shared-key", "rank": 8}) == "shared-key"  # format 1's name of the form
    assert layer_form({"rank": 8, "num_heads": 2}) == "collaborative"
    assert family_named("gpt2-shared-key").name == "gpt2"  # format 1 named the family in its form


def test_every_form_can_be_asked_for_by_name():
    from typing import get_args

    from collab_convert.format import FORMS
    from collab_convert.forms import FORMS as REGISTERED
    from collab_convert.options import CompressOptions

    assert set(get_args(CompressOptions.model_fields["form"].annotation)) == {"auto", *FORMS} == {"auto", *REGISTERED}
