"""Inputs transformers could not load, or we could not read, end in one line on stderr, exit 3, nothing written and
the input untouched: configs that disagree with their weights (layer and head counts, widths, RoPE settings),
quantised weights, verify against a model of another shape, calibration without a tokenizer."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from collab_convert.cli import main
from fixtures.models import ROTARY_CASES, build_rotary, folder_digest, save_tiny, save_tiny_tokenizer


def run_cli(capsys, *arguments):
    code = main([str(a) for a in arguments])
    return code, capsys.readouterr().err


def assert_refused(capsys, folder, out, fragment, *arguments, command="compress"):
    """The command refuses `folder` in one line naming `fragment`, writes nothing and leaves the input as it was."""
    before = folder_digest(folder)
    extra = ["-o", out] if command == "compress" else []
    code, err = run_cli(capsys, command, folder, *arguments, *extra)
    assert code == 3, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert fragment in err, err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".")]
    assert folder_digest(folder) == before


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), folder)
    return folder


def changed_copy(source, target, **changes):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("changes, fragment", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1,000,000,000, but the weights hold only"),
    ({"num_hidden_layers": 3}, "describes 3 attention layers (num_hidden_layers=3), but the weights hold 2"),
    ({"num_hidden_layers": 1}, "the weights hold 2 attention layers, but config.json describes 1"),
    ({"num_key_value_heads": 4}, "k_proj.weight is [32, 64] in the weights but [64, 64]"),
    ({"num_key_value_heads": 1}, "k_proj.weight is [32, 64] in the weights but [16, 64]"),
    ({"num_attention_heads": 8}, "in the model the config describes"),
    ({"hidden_size": 128}, "config.json disagrees with the weights"),
    ({"head_dim": 8}, "config.json disagrees with the weights"),
    ({"rope_parameters": {"rope_type": "wobbly", "rope_theta": 10000.0}}, "rope_type 'wobbly' is not one"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "ten"}}, "rope_theta is 'ten'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, "rope_theta is -5.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta is 0"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "transformers cannot read"),
    # transformers' first line only introduces the fault ("... for field 'intermediate_size':"): name it too
    ({"intermediate_size": "128"}, "expected int, got str"),
])
@pytest.mark.parametrize("command", ["compress", "analyze"])
def test_a_config_transformers_could_not_load_over_its_weights_is_refused(llama, tmp_path, capsys, changes,
                                                                           fragment, command):
    folder = changed_copy(llama, tmp_path / "in", **changes)
    arguments = ["--weight-only", "--key-cache", "0.5"] if command == "compress" else []
    assert_refused(capsys, folder, tmp_path / "out", fragment, *arguments, command=command)


def test_rope_angles_that_are_not_finite_are_refused(llama, tmp_path, capsys, monkeypatch):
    """What transformers builds from RoPE settings that pass every check of their fields but give NaN angles
    (here made so inside transformers' own initialisation): the angles themselves are checked."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters

    def not_a_number(config, **kwargs):
        inv_freq, scaling = original(config, **kwargs)
        return inv_freq * float("nan"), scaling

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "compute_default_rope_parameters",
                        staticmethod(not_a_number))
    folder = changed_copy(llama, tmp_path / "in")
    assert_refused(capsys, folder, tmp_path / "out", "non-finite rotary angles", "--weight-only", "--key-cache", "0.5")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_quantised_attention_weights_are_refused_naming_the_fix(llama, tmp_path, capsys, dtype):
    folder = changed_copy(llama, tmp_path / "in")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_refused(capsys, folder, tmp_path / "out", f"{name} is stored in {str(dtype).removeprefix('torch.')}",
                   "--weight-only", "--key-cache", "0.5")


def test_a_quantization_config_is_refused_naming_the_fix(llama, tmp_path, capsys):
    folder = changed_copy(llama, tmp_path / "in", quantization_config={"quant_method": "fp8",
                                                                      "weight_block_size": [128, 128]})
    assert_refused(capsys, folder, tmp_path / "out", "quantization_config (fp8) says the weights are quantised",
                   "--weight-only", "--key-cache", "0.5")


def test_verify_against_a_model_of_another_shape_is_one_line(llama, tmp_path, capsys):
    import dataclasses

    case = next(c for c in ROTARY_CASES if c.name == "llama")
    wider = dataclasses.replace(case, settings={**case.settings, "hidden_size": 128})
    build_rotary(wider, tmp_path / "wider")
    model = changed_copy(llama, tmp_path / "in")
    save_tiny_tokenizer(model)
    assert main(["compress", str(model), "--weight-only", "--key-cache", "0.5", "-o", str(tmp_path / "small")]) == 0
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\na dog ran in the park\n")
    capsys.readouterr()
    code, err = run_cli(capsys, "verify", tmp_path / "small", "--against", tmp_path / "wider", "--texts", texts)
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "differ in hidden_size (64 and 128)" in err and "--against the model it came from" in err


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_calibration_on_a_folder_without_a_tokenizer_names_the_fix(llama, tmp_path, capsys, kind):
    if kind == "bert":
        folder = save_tiny(tmp_path / "in")
        for path in folder.glob("tokenizer*"):
            path.unlink()
        for path in folder.glob("vocab*"):
            path.unlink()
        settings = ["--rank", "8"]
    else:
        folder = changed_copy(llama, tmp_path / "in")
        settings = ["--key-cache", "0.5"]
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\na dog ran in the park\nthe sun is hot today\n")
    assert_refused(capsys, folder, tmp_path / "out", "copy the tokenizer files of the model it came from",
                   "--calibration", texts, *settings)
