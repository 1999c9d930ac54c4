"""Bad, hostile and interrupted inputs: one clear line, a non-zero exit, nothing written, input untouched."""

import json
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from collab_convert.cli import main
from fixtures.models import folder_digest


def run_cli(capsys, *arguments):
    code = main([str(a) for a in arguments])
    return code, capsys.readouterr().err


def assert_one_line(err, fragment):
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    assert "Traceback" not in err


def copy_model(source, target, tensors=None):
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    if tensors is not None:
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_truncated_weights(tiny_bert, tmp_path, capsys):
    broken = copy_model(tiny_bert, tmp_path / "broken")
    data = (tiny_bert / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, err = run_cli(capsys, "compress", broken, "--rank", "8", "-o", tmp_path / "out")
    assert code == 3
    assert_one_line(err, "model.safetensors")
    assert not (tmp_path / "out").exists()


def test_garbage_weights(tiny_bert, tmp_path, capsys):
    broken = copy_model(tiny_bert, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a tensor file at all")
    code, err = run_cli(capsys, "analyze", broken)
    assert code == 3
    assert_one_line(err, "not a valid safetensors file")


def test_nan_weights(tiny_bert, tmp_path, capsys):
    tensors = load_file(str(tiny_bert / "model.safetensors"))
    tensors["encoder.layer.1.attention.self.key.weight"][0, 0] = float("nan")
    broken = copy_model(tiny_bert, tmp_path / "nan", tensors)
    code, err = run_cli(capsys, "compress", broken, "--rank", "8", "-o", tmp_path / "out")
    assert code == 3
    assert_one_line(err, "NaN or Inf")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_model_without_attention_weights(tiny_bert, tmp_path, capsys):
    tensors = {k: v for k, v in load_file(str(tiny_bert / "model.safetensors")).items() if "attention" not in k}
    broken = copy_model(tiny_bert, tmp_path / "noattn", tensors)
    code, err = run_cli(capsys, "analyze", broken)
    assert code == 3
    assert_one_line(err, "no bert attention layers found")


def test_unsupported_architecture(tiny_bert, tmp_path, capsys):
    config = json.loads((tiny_bert / "config.json").read_text())
    config["model_type"] = "gptj"
    other = copy_model(tiny_bert, tmp_path / "gptj")
    (other / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, "analyze", other)
    assert code == 3
    assert_one_line(err, "rotary")


def test_invalid_config_json(tiny_bert, tmp_path, capsys):
    other = copy_model(tiny_bert, tmp_path / "badjson")
    (other / "config.json").write_text("{ not json")
    code, err = run_cli(capsys, "analyze", other)
    assert code == 3
    assert_one_line(err, "not valid JSON")


def test_already_collaborative_input_is_refused(tiny_bert, tmp_path, capsys):
    assert run_cli(capsys, "compress", tiny_bert, "--rank", "8", "-o", tmp_path / "once")[0] == 0
    code, err = run_cli(capsys, "compress", tmp_path / "once", "--rank", "8", "-o", tmp_path / "twice")
    assert code == 3
    assert_one_line(err, "already collaborative")


def test_output_that_is_a_file(tiny_bert, tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    code, err = run_cli(capsys, "compress", tiny_bert, "--rank", "8", "-o", target)
    assert code == 3
    assert_one_line(err, "is a file")
    assert target.read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_run_leaves_nothing_behind(minilm_path, tmp_path, signal_number):
    before = folder_digest(minilm_path)
    out = tmp_path / "out"
    process = subprocess.Popen(
        # a tight ALS tolerance keeps the fits busy for seconds: a default run is over within half a second of
        # its staging folder appearing on a fast machine, and the signal would find it finished
        [sys.executable, "-m", "collab_convert", "compress", str(minilm_path), "--rank", "96", "-o", str(out), "-q",
         "--tolerance", "1e-6", "--max-iterations", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not any(p.name.startswith(".out.collab-tmp") for p in tmp_path.iterdir()):
        assert time.time() < deadline and process.poll() is None, "compression never started"
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the decomposition
    process.send_signal(signal_number)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert err.strip() == "error: interrupted; nothing was written"
    assert list(tmp_path.iterdir()) == []
    assert folder_digest(minilm_path) == before
