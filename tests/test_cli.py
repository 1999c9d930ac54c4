"""The command line, through Typer's CliRunner and, for the one-line error contract, a real process."""

import json
import subprocess
import sys
from xml.etree import ElementTree

import pytest
from typer.testing import CliRunner

from collab_convert.cli import app, main
from fixtures.models import folder_digest

runner = CliRunner()


def test_analyze_json_is_one_object_with_a_layer_per_attention_layer(tiny_bert):
    result = runner.invoke(app, ["analyze", str(tiny_bert), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["layers"]) == 2
    layer = data["layers"][0]
    assert layer["num_heads"] == 4 and layer["head_dim"] == 12
    assert set(layer["spectra"]) >= {"query_projection", "key_projection", "query_unfolding", "key_unfolding"}
    energy = layer["energy_ranks"]["query_unfolding"]
    assert 1 <= energy["0.90"] <= energy["0.95"] <= energy["0.99"] <= 48
    assert layer["original"]["parameters"] == 2 * 48 * 48 + 2 * 48
    assert [c["rank"] for c in layer["candidates"]] == [48, 24, 12, 6]


def test_analyze_table_names_every_layer_and_says_what_next(tiny_bert):
    result = runner.invoke(app, ["analyze", str(tiny_bert), "--ranks", "8,16"])
    assert result.exit_code == 0, result.output
    assert "layer 0" in result.stdout and "layer 1" in result.stdout
    rows = [line.strip("│ ").split("│")[0].strip() for line in result.stdout.splitlines() if line.startswith("│")]
    assert {"original", "8", "16"} <= set(rows)
    assert "collab-convert compress" in result.stdout


def test_compress_json_reports_rank_and_error_per_layer(tiny_bert, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["compress", str(tiny_bert), "--rank", "24", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [layer["rank"] for layer in data["layers"]] == [24, 24]
    assert all(0 < layer["relative_error"] < 1 for layer in data["layers"])
    assert (out / "model.safetensors").is_file()


def test_compress_table_output(tiny_bert, tmp_path):
    result = runner.invoke(app, ["compress", str(tiny_bert), "--rank", "48", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "0.0000" in result.stdout and "load_model" in result.stdout
    assert "layer 0" in result.stdout and "layer 1" in result.stdout  # the labels analyze uses


def test_max_error_gate_exits_one(tiny_bert, tmp_path, capsys):
    code = main(["compress", str(tiny_bert), "--rank", "6", "-o", str(tmp_path / "o"), "--max-error", "0.01", "-q"])
    assert code == 1
    assert "exceed --max-error" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, code, message",
    [
        (["analyze", "/no/such/folder"], 3, "no such folder"),
        (["compress", "{model}", "--rank", "0", "-o", "{out}"], 2, "rank must be a positive integer"),
        (["compress", "{model}", "--rank", "two", "-o", "{out}"], 2, "--rank"),
        (["compress", "{model}", "--rank", "49", "-o", "{out}"], 3, "exceeds the full rank"),
        (["compress", "{model}", "--rank", "8"], 2, "--output"),
        (["compress", "{empty}", "--rank", "8", "-o", "{out}"], 3, "has no config.json"),
        # an unset variable in a script ("$MODEL"): not the embedded default, nor the working directory
        (["compress", "", "--rank", "8", "-o", "{out}"], 3, "the model is empty"),
        (["analyze", " "], 3, "the model is empty"),
        # a gate no result can pass is a typo, refused before any work
        (["compress", "{model}", "--rank", "8", "--min-cosine", "2", "-o", "{out}"], 2, "--min-cosine"),
        (["compress", "{model}", "--rank", "8", "--max-kl", "-0.1", "-o", "{out}"], 2, "--max-kl"),
    ],
)
def test_bad_input_gets_one_line_and_an_exit_code(tiny_bert, tmp_path, capsys, arguments, code, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    filled = [a.format(model=tiny_bert, out=tmp_path / "out", empty=empty) for a in arguments]
    before = folder_digest(tiny_bert)
    assert main(filled) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert folder_digest(tiny_bert) == before


def test_installed_command_prints_one_line_without_traceback(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "collab_convert", "compress", str(tmp_path / "missing"), "--rank", "8", "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert process.returncode == 3
    assert process.stdout == ""
    assert process.stderr.strip().count("\n") == 0 and "Traceback" not in process.stderr


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("collab-convert ")


def test_help_lists_exit_codes():
    result = runner.invoke(app, ["--help"])
    assert "Exit codes" in result.stdout


def test_dry_run_checks_without_writing(tiny_bert, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["compress", str(tiny_bert), "--rank", "24", "-o", str(out), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert len(plan["layers"]) == 2 and plan["parameters_after"] < plan["parameters_before"]
    assert not out.exists()


def test_dry_run_still_refuses_bad_ranks(tiny_bert, tmp_path, capsys):
    assert main(["compress", str(tiny_bert), "--rank", "100", "-o", str(tmp_path / "o"), "--dry-run"]) == 3
    assert "exceeds the full rank" in capsys.readouterr().err


def test_analyze_draws_spectra(tiny_bert, tmp_path):
    plot = tmp_path / "spectra.svg"
    result = runner.invoke(app, ["analyze", str(tiny_bert), "--plot", str(plot), "--json"])
    assert result.exit_code == 0, result.output
    svg = ElementTree.fromstring(plot.read_text())  # well-formed XML
    lines = [e for e in svg.iter("{http://www.w3.org/2000/svg}polyline")]
    assert len(lines) == 2 * 2  # one line per layer, on the query side and on the key side
    json.loads(result.stdout)  # the plot does not disturb the JSON on stdout


def test_analyze_makes_the_plots_folders_and_refuses_an_unwritable_one_before_any_work(tiny_bert, tmp_path,
                                                                                       capsys, monkeypatch):
    plot = tmp_path / "reports" / "today" / "spectra.svg"
    assert main(["analyze", str(tiny_bert), "--plot", str(plot), "--json"]) == 0 and plot.is_file()
    (tmp_path / "taken").write_text("a file where a folder should be")
    from collab_convert import analysis

    monkeypatch.setattr(analysis, "open_model", lambda *a, **k: pytest.fail("the model was opened"))
    capsys.readouterr()
    assert main(["analyze", str(tiny_bert), "--plot", str(tmp_path / "taken" / "spectra.svg")]) == 3
    error = capsys.readouterr().err
    assert error.startswith("error: cannot write the plot to") and error.count("\n") == 1
    assert "taken is a file, not a folder" in error  # mkdir says only "File exists"


def test_analyze_refuses_a_plot_that_is_not_svg(tiny_bert, tmp_path, capsys):
    assert main(["analyze", str(tiny_bert), "--plot", str(tmp_path / "spectra.png")]) != 0
    error = capsys.readouterr().err
    assert "plots are SVG" in error and "Traceback" not in error


def test_compress_writes_plots(tiny_bert, tmp_path):
    result = runner.invoke(app, ["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 0, result.output
    spectra = ElementTree.parse(tmp_path / "o" / "spectra.svg").getroot()
    assert "chosen rank 24" in "".join(spectra.itertext())
    errors = ElementTree.parse(tmp_path / "o" / "errors.svg").getroot()
    bars = [e for e in errors.iter("{http://www.w3.org/2000/svg}rect") if e.get("fill") not in ("white", "none")]
    assert len(bars) >= 2  # one bar per layer at least


def test_device_cpu_is_the_same_code_path_and_missing_cuda_is_a_clear_error(tiny_bert, tmp_path, capsys):
    import torch

    assert main(["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "cpu"), "--device", "cpu", "-q"]) == 0
    if not torch.cuda.is_available():
        assert main(["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "gpu"), "--device", "cuda"]) == 3
        assert "no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "gpu").exists()
        assert main(["analyze", str(tiny_bert), "--device", "cuda:1"]) == 3
        assert "--device cuda:1 was asked for" in capsys.readouterr().err
        verify = ["verify", str(tmp_path / "cpu"), "--against", str(tiny_bert), "--texts", str(tmp_path / "texts")]
        (tmp_path / "texts").write_text("one text\n")
        assert main(verify + ["--device", "cuda"]) == 3
        assert capsys.readouterr().err.count("\n") == 1
        assert main(verify + ["--device", "tpu"]) == 2
    assert main(["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "x"), "--device", "tpu"]) == 2
