"""A compressed checkpoint that was altered after writing never loads silently wrong: ranks in config.json that
disagree with the tensors, a missing collaborative tensor, NaN in the factors, or a format from the future each
raise a clear error in from_pretrained."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from collab_convert import CompressOptions, compress
from collab_convert.integration.loading import load_model
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tamper")
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), root / "llama")
    compress(str(root / "llama"), CompressOptions(key_cache=0.5, output=root / "rotary"))
    save_tiny(root / "bert")
    compress(str(root / "bert"), CompressOptions(rank=8, output=root / "collaborative"))
    return root


def altered(root, source, tmp_path, config=None, tensors=None):
    folder = tmp_path / source
    shutil.copytree(root / source, folder)
    if config:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))
    if tensors:
        data = load_file(folder / "model.safetensors")
        tensors(data)
        save_file(data, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def first_layer(config):
    return next(iter(config["quantization_config"]["layers"].values()))


def wider_rank(config):
    entry = first_layer(config)
    if "frequency_ranks" in entry:
        entry["frequency_ranks"] = [2] * len(entry["frequency_ranks"])
    entry["rank"] = 12


def drop(suffix):
    def edit(tensors):
        del tensors[next(name for name in tensors if name.endswith(suffix))]
    return edit


def poison(suffix):
    def edit(tensors):
        tensors[next(name for name in tensors if name.endswith(suffix))].view(-1)[0] = float("nan")
    return edit


def future(config):
    config["quantization_config"]["format_version"] = 99


@pytest.mark.parametrize("source, config, tensors, fragment", [
    ("rotary", wider_rank, None, "mismatch|size"),
    ("collaborative", wider_rank, None, "mismatch|size"),
    ("rotary", None, drop("query_core"), "has no .*query_core"),
    ("collaborative", None, drop("mixing"), "has no .*mixing"),
    ("rotary", None, poison("shared_key.weight"), "NaN"),
    ("collaborative", None, poison("mixing"), "NaN"),
    ("rotary", future, None, "upgrade collab-convert"),
])
def test_altered_checkpoints_refuse_to_load(checkpoints, tmp_path, source, config, tensors, fragment):
    folder = altered(checkpoints, source, tmp_path, config, tensors)
    with pytest.raises((ValueError, RuntimeError), match=fragment):
        load_model(folder)


def test_the_unaltered_checkpoints_load(checkpoints):
    assert load_model(checkpoints / "rotary") is not None
    assert load_model(checkpoints / "collaborative") is not None
