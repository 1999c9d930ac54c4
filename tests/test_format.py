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
    assert record["format_version"] == FORMAT_VERSION
    assert record["layers"] == {"a": {"rank": 4, "num_heads": 2}, "b": {"rank": 4, "num_heads": 4, "kv_heads": 1}}
    read = FormatConfig(**{k: v for k, v in record.items() if k != "quant_method"})
    assert read.layer_shapes() == {"a": (4, HeadCounts(2, 2)), "b": (4, HeadCounts(4, 1))}


def test_a_newer_format_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="upgrade collab-convert"):
        FormatConfig(family="bert", layers={}, format_version=FORMAT_VERSION + 1)
