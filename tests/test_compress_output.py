"""The output folder: complete, loadable, recorded, and the input left alone."""

import json

import pytest
from safetensors import safe_open

from collab_convert import CompressOptions, compress
from collab_convert.format import original_config
from collab_convert.io.reader import TensorReader
from collab_convert.errors import BadInputError, OutputExistsError
from fixtures.models import folder_digest


def test_output_is_a_complete_hugging_face_folder(tiny_bert, tmp_path):
    out = tmp_path / "out"
    before = folder_digest(tiny_bert)
    result = compress(str(tiny_bert), CompressOptions(rank=20, output=out))
    assert folder_digest(tiny_bert) == before  # the input is never modified

    original = json.loads((tiny_bert / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == original["architectures"]
    # its own model_type, so that transformers alone refuses it; read through the record, the original's
    assert config["model_type"] == "collaborative_" + original["model_type"]
    assert original_config(config)["model_type"] == original["model_type"] and "auto_map" not in original_config(config)
    recorded = config["quantization_config"]
    assert recorded["quant_method"] == "collaborative"
    assert recorded["method"] == "tucker-cp-als"
    assert recorded["tool_version"]
    assert recorded["layers"] == {
        "encoder.layer.0.attention.self": {"rank": 20, "num_heads": 4},
        "encoder.layer.1.attention.self": {"rank": 20, "num_heads": 4},
    }

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        # the query weight's name holds only the load guard: nothing, so that transformers alone refuses the file
        assert all(f.get_slice(n).get_shape() == [0] for n in names if n.endswith("self.query.weight"))
    assert "encoder.layer.0.attention.self.mixing" in names
    assert not any(n.endswith(("self.query.bias", "self.key.weight", "self.key.bias")) for n in names)

    # every non-weight file is carried over
    assert (out / "modules.json").is_file() and (out / "1_Pooling" / "config.json").is_file()

    report = json.loads((out / "report.json").read_text())
    assert [layer["rank"] for layer in report["layers"]] == [20, 20]
    assert all(0 < layer["relative_error"] < 1 for layer in report["layers"])
    assert report["layers"][0]["parameters_before"] > report["layers"][0]["parameters_after"]
    markdown = (out / "report.md").read_text()
    assert "encoder.layer.1.attention.self" in markdown and "relative error" in markdown
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "base_model_relation: quantized" in card
    # an encoder runs once over its input: no key cache in its report, card or costs
    assert "cache" not in markdown.replace("cached", "") and "key cache" not in card
    assert all(layer["cost_before"]["key_cache_per_token"] == 0 for layer in report["layers"])
    assert sorted(result.files) == result.files and "model.safetensors" in result.files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_sharded_output_has_an_index(tiny_bert, tmp_path):
    out = tmp_path / "out"
    compress(str(tiny_bert), CompressOptions(rank=20, output=out, max_shard_size="40KB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    reader = TensorReader(out)
    assert set(reader.names()) == set(index["weight_map"])


def test_same_input_gives_byte_identical_weights(tiny_bert, tmp_path):
    compress(str(tiny_bert), CompressOptions(rank=20, output=tmp_path / "a"))
    compress(str(tiny_bert), CompressOptions(rank=20, output=tmp_path / "b"))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_existing_output_is_refused_unless_overwrite(tiny_bert, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        compress(str(tiny_bert), CompressOptions(rank=20, output=out))
    assert (out / "keep.txt").read_text() == "mine"
    compress(str(tiny_bert), CompressOptions(rank=20, output=out, overwrite=True))
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_output_inside_the_input_is_refused(tiny_bert):
    with pytest.raises(BadInputError, match="overlaps"):
        compress(str(tiny_bert), CompressOptions(rank=20, output=tiny_bert / "out"))


def test_rank_above_full_rank_is_refused_before_any_write(tiny_bert, tmp_path):
    with pytest.raises(BadInputError, match="exceeds the full rank"):
        compress(str(tiny_bert), CompressOptions(rank=49, output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_legacy_pickle_weights_load_only_as_plain_tensors(tiny_bert, tmp_path):
    import torch
    from safetensors.torch import load_file

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((tiny_bert / "config.json").read_text())
    torch.save(load_file(str(tiny_bert / "model.safetensors")), legacy / "pytorch_model.bin")
    compress(str(legacy), CompressOptions(rank=48, output=tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").is_file()

    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "config.json").write_text((tiny_bert / "config.json").read_text())
    torch.save({"weight": Payload()}, hostile / "pytorch_model.bin")
    with pytest.raises(BadInputError, match="could not be loaded safely"):
        compress(str(hostile), CompressOptions(rank=8, output=tmp_path / "out2"))


def test_hub_id_resolves_from_the_local_cache_offline(tiny_bert, tmp_path, monkeypatch):
    import shutil

    from collab_convert.io.folders import resolve_model

    # The layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/REVISION/...}
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--acme--tiny-bert"
    shutil.copytree(tiny_bert, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("acme/tiny-bert") == repo / "snapshots" / revision
    result = compress("acme/tiny-bert", CompressOptions(rank=20, output=tmp_path / "out"))
    assert result.model == "acme/tiny-bert"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: acme/tiny-bert" in card


@pytest.mark.slow
def test_output_bytes_do_not_depend_on_how_many_layers_are_fitted_side_by_side(minilm_path, tmp_path):
    # Weight-only fits run in one worker per math thread, each torch operation on one thread: a product
    # summed by two threads would round differently from one summed by one, and the bytes would follow.
    compress(str(minilm_path), CompressOptions(rank=96, output=tmp_path / "one", threads=1, plots=False))
    compress(str(minilm_path), CompressOptions(rank=96, output=tmp_path / "two", threads=2, plots=False))
    one, two = (tmp_path / name / "model.safetensors" for name in ("one", "two"))
    assert one.read_bytes() == two.read_bytes()


@pytest.mark.parametrize("form", ["collaborative", "shared-key"])
def test_layers_are_reported_in_numeric_order(tmp_path, form):
    """Tensor names sort as text (layer 10 before layer 2); reports, config and report.md read as the model does."""
    from fixtures.models import ROTARY_CASES, RotaryCase, build_rotary, save_tiny

    if form == "collaborative":
        save_tiny(tmp_path / "in", num_hidden_layers=12)
        options, site = {"rank": 8}, "encoder.layer."
    else:
        llama = next(case for case in ROTARY_CASES if case.name == "llama")
        build_rotary(RotaryCase("llama", llama.config_class, llama.model_class,
                                {**llama.settings, "num_hidden_layers": 12}), tmp_path / "in")
        options, site = {"key_cache": 0.5}, "model.layers."
    result = compress(str(tmp_path / "in"), CompressOptions(output=tmp_path / "out", **options))
    numbers = [int(layer.name[len(site):].split(".")[0]) for layer in result.layers]
    assert numbers == list(range(12))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [int(name[len(site):].split(".")[0]) for name in config["quantization_config"]["layers"]] == numbers
    table = [line.split("|")[1].strip() for line in (tmp_path / "out" / "report.md").read_text().splitlines()
             if line.startswith(f"| {site}")]
    assert [int(name[len(site):].split(".")[0]) for name in table] == numbers * (len(table) // 12)  # every table


def test_the_summary_gives_the_weights_on_disk_before_and_after(tiny_bert, tmp_path):
    from collab_convert.report.summary import disk_line

    result = compress(str(tiny_bert), CompressOptions(rank=8, output=tmp_path / "out"))
    on_disk = sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    assert result.disk["output_bytes"] == on_disk < result.disk["input_bytes"]
    assert disk_line(result.disk) in (tmp_path / "out" / "report.md").read_text()
    gguf = disk_line({"input_bytes": 532_000_000, "output_bytes": 520_000_000, "input_gguf_bytes": 94_000_000})
    assert gguf.startswith("- weights on disk: 532.0 MB -> 520.0 MB (the input was a 94.0 MB GGUF file, dequantised")


def test_analyze_is_called_as_compress_is_and_predicts_the_fit_compress_writes(tiny_bert, tmp_path):
    from collab_convert import analyze
    from collab_convert.options import AnalyzeOptions

    predicted = analyze(str(tiny_bert), AnalyzeOptions(ranks=[8]))
    written = compress(str(tiny_bert), CompressOptions(rank=8, output=tmp_path / "out"))
    assert [layer.candidates[0]["relative_error"] for layer in predicted.layers] == \
        [round(layer.relative_error, 6) for layer in written.layers]
    # one HOSVD serves analyze's spectra and its fits, computed as compress computes the spectra it reports
    assert [layer.spectra["query_unfolding"] for layer in predicted.layers] == \
        [layer.query_spectrum for layer in written.layers]
