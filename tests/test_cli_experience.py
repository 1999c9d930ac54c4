"""What a user meets at the command line: instant help, tables that fit, advice that predicts fidelity,
refusals that match, honest reports, progress only on a terminal, a README whose first command leaves the
checkout clean."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from collab_convert.cli import app, main

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_help_and_usage_errors_never_import_torch_or_transformers():
    # The cost of --help is the cost of what it imports: torch and transformers take seconds. (The wall time
    # is measured in benchmarks/cli_startup.py, not here.)
    probe = (
        "import sys\n"
        "from collab_convert.cli import main\n"
        "for argv in (['--help'], ['compress', '--help'], ['analyze', '--help'], ['--version'],\n"
        "             ['compress', '--rank', 'nope', '-o', 'x']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_forgotten_rank_is_refused_before_transformers_or_the_weights_load(tiny_bert, tmp_path):
    """The CP form needs --rank: the config says which form, so the refusal needs neither the modeling code nor
    the weights (it used to come after both, ~6 s on all-MiniLM-L6-v2)."""
    (tiny_bert / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")  # no weights to read at all
    probe = (
        "import sys\n"
        "from collab_convert.cli import main\n"
        f"print('exit', main(['compress', {str(tiny_bert)!r}, '-o', {str(tmp_path / 'out')!r}]))\n"
        "print('transformers' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert "give --rank R" in run.stderr + run.stdout
    assert run.stdout.strip().splitlines()[-2:] == ["exit 3", "False"]
    assert not (tmp_path / "out").exists()


def test_importing_the_package_registers_with_transformers_when_it_loads():
    probe = (
        "import sys, collab_convert\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "print('collaborative' in AUTO_QUANTIZATION_CONFIG_MAPPING)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_analyze_fits_80_columns_without_cutting_numbers(tiny_bert, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    import collab_convert.cli.render as cli
    from rich.console import Console

    monkeypatch.setattr(cli, "stdout", Console(soft_wrap=True, width=80))
    result = runner.invoke(app, ["analyze", str(tiny_bert)])
    assert result.exit_code == 0, result.output
    tables = [line for line in result.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert tables and all(len(line) <= 80 for line in tables)
    assert "…" not in result.stdout


def test_analyze_refuses_an_impossible_rank_like_compress(tiny_bert, tmp_path, capsys):
    from collab_convert.cli import main

    assert main(["analyze", str(tiny_bert), "--ranks", "1000"]) == 3
    analyze_error = capsys.readouterr().err
    assert main(["compress", str(tiny_bert), "--rank", "1000", "-o", str(tmp_path / "out")]) == 3
    compress_error = capsys.readouterr().err
    assert "rank 1000 exceeds the full rank of encoder.layer.0.attention.self (4 heads x 12 = 48)" in analyze_error
    assert analyze_error == compress_error


def test_analyze_predicts_error_per_rank_and_names_the_rank_for_a_target(tiny_bert, calibration_file):
    result = runner.invoke(app, ["analyze", str(tiny_bert), "--ranks", "12,24,48", "--calibration",
                                 str(calibration_file), "--target-cosine", "0.999", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    predictions = {p["rank"]: p for p in data["predictions"]}
    assert predictions[48]["mean_relative_error"] < 1e-6 and predictions[48]["cosine_mean"] > 0.99999
    assert predictions[12]["mean_relative_error"] > predictions[24]["mean_relative_error"]
    assert predictions[12]["cosine_mean"] <= predictions[24]["cosine_mean"] + 1e-6
    assert all(0 <= p["mean_logit_error"] <= 1 for p in predictions.values())
    # fewer lines than the 512 fit samples: the last tenth is held out, never fitted
    assert "held-out lines" in data["probe"] and "the fit used" in data["probe"]
    target = data["target"]
    assert target["rank"] % 4 == 0 and target["cosine_mean"] >= 0.999
    assert data["layers"][0]["candidates"][0]["relative_error"] is not None


def test_rank_auto_aims_at_a_fidelity_target_and_reports_it(tiny_bert, calibration_file, tmp_path):
    from collab_convert import CompressOptions, compress

    result = compress(str(tiny_bert), CompressOptions(rank="auto", target_cosine=0.995, output=tmp_path / "out",
                                                      calibration=calibration_file, refine_steps=5))
    choice = result.rank_choice
    assert choice["mode"] == "fidelity target" and choice["estimated_cosine_mean"] >= 0.995
    assert {layer.rank for layer in result.layers} == {min(48, max(layer.rank for layer in result.layers))}
    assert result.fidelity["cosine_mean"] >= 0.99  # measured after refinement, on the probe lines
    card = (tmp_path / "out" / "README.md").read_text()
    assert "the smallest reaching an embedding cosine of 0.995" in card
    assert f"embedding cosine mean {result.fidelity['cosine_mean']:.4f}" in card
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rank_choice"]["target_cosine"] == 0.995


def test_verify_has_quiet_like_every_command(tiny_bert, calibration_file, tmp_path):
    runner.invoke(app, ["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "out")])
    result = runner.invoke(app, ["verify", str(tmp_path / "out"), "--against", str(tiny_bert), "--texts",
                                 str(calibration_file), "-q"])
    assert result.exit_code == 0, result.output
    assert "cosine mean" in result.stdout


def test_the_readmes_first_command_writes_where_git_ignores_it():
    readme = (ROOT / "README.md").read_text()
    first = next(line for line in readme.splitlines() if "collab-convert compress" in line)
    output = re.search(r"-o (\S+)", first).group(1)
    ignored = subprocess.run(["git", "check-ignore", "-q", output], cwd=ROOT, check=False)
    assert ignored.returncode == 0, f"{output} would show up in git status"


@pytest.mark.slow
def test_analyze_of_minilm_fits_80_columns(monkeypatch):
    import collab_convert.cli.render as cli
    from rich.console import Console

    monkeypatch.setattr(cli, "stdout", Console(soft_wrap=True, width=80))
    result = runner.invoke(app, ["analyze"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout and "layer 5" in result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines() if line[:1] in "┏┃┡│└")


def test_verify_defaults_to_the_base_the_checkpoint_records(tiny_bert, calibration_file, tmp_path):
    runner.invoke(app, ["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "out")])
    result = runner.invoke(app, ["verify", str(tmp_path / "out"), "--texts", str(calibration_file), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["against"] == str(tiny_bert)


def test_verify_without_a_recorded_base_asks_for_one(tiny_bert, calibration_file, capsys):
    assert main(["verify", str(tiny_bert), "--texts", str(calibration_file)]) == 3
    error = capsys.readouterr().err
    assert "records no base model" in error and "--against" in error


@pytest.mark.parametrize("command", ["analyze", "compress", "export", "verify"])
def test_help_groups_the_options_and_shows_examples(command):
    shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"}).output
    assert "Examples:" in shown and shown.count(f"collab-convert {command} ") >= 2
    assert "Essentials" in shown


def test_compress_help_puts_the_essentials_before_the_rest():
    shown = runner.invoke(app, ["compress", "--help"], env={"COLUMNS": "120"}).output
    panels = [shown.index(name) for name in ("Essentials", "Calibration and fitting", "Fidelity gates", "More options")]
    assert panels == sorted(panels)
    essentials = shown[panels[0]:panels[1]]
    assert "--output" in essentials and "--kv-cache" in essentials and "--seed" not in essentials


def test_shell_completion_is_offered():
    shown = runner.invoke(app, ["--help"]).output
    assert "--install-completion" in shown and "--show-completion" in shown


def test_on_a_narrow_terminal_prose_wraps_between_words(tiny_bert):
    """On a terminal rich wraps each line between words; numbers such as 90/95/99% are never cut."""
    import os
    import pty

    chunks = []

    def read(fd):
        data = os.read(fd, 65536)
        chunks.append(data)
        return data

    environment = dict(os.environ, COLUMNS="60", LINES="40", NO_COLOR="1")
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment)
    try:
        pty.spawn([sys.executable, "-m", "collab_convert", "analyze", str(tiny_bert), "-q"], read)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace")).replace("\r", "")
    lines = [line for line in shown.splitlines() if line.strip()]
    assert "90/95/99%" in shown and all(len(line) <= 60 for line in lines)
    assert any(line.startswith("Next: ") for line in lines)


def test_analyze_piped_says_which_stage_it_is_in(tiny_bert, capsys, monkeypatch):
    """No terminal, no bar: a stage that runs a while gets a line on stderr, so a CI log is not silent."""
    import collab_convert.cli.render as render

    monkeypatch.setattr(render, "STAGE_LINE_AFTER", 0.0)
    assert main(["analyze", str(tiny_bert)]) == 0
    stages = capsys.readouterr().err.splitlines()
    assert "opening the model ..." in stages and "analyzing ..." in stages


def test_compress_piped_says_which_stage_it_is_in_and_json_stays_clean(tiny_bert, tmp_path, capsys, monkeypatch):
    import collab_convert.cli.render as render

    monkeypatch.setattr(render, "STAGE_LINE_AFTER", 0.0)
    assert main(["compress", str(tiny_bert), "--rank", "8", "-o", str(tmp_path / "out")]) == 0
    stages = capsys.readouterr().err.splitlines()
    assert "opening the model ..." in stages and any(line.startswith("writing") for line in stages), stages
    assert main(["compress", str(tiny_bert), "--rank", "8", "-o", str(tmp_path / "json"), "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_analyze_piped_and_quiet_prints_no_stage_lines(tiny_bert, capsys, monkeypatch):
    import collab_convert.cli.render as render

    monkeypatch.setattr(render, "STAGE_LINE_AFTER", 0.0)
    assert main(["analyze", str(tiny_bert), "-q"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("arguments, flag, says", [
    (["compress", "--rank", "8", "--kv-cache", "nan"], "--kv-cache", "finite number"),
    (["compress", "--rank", "auto", "--target-cosine", "inf"], "--target-cosine", "finite number"),
    (["compress", "--rank", "8", "--min-cosine", "nan", "--calibration", "x.txt"], "--min-cosine", "finite number"),
    (["compress", "--rank", "8", "-o", ""], "--output", "give a name"),
    (["export", "-o", " "], "--output", "give a name"),
])
def test_a_value_no_run_could_mean_is_a_usage_error_naming_its_flag(tiny_bert, tmp_path, monkeypatch, capsys,
                                                                   arguments, flag, says):
    monkeypatch.chdir(tmp_path)  # an empty -o must not become this folder
    command, rest = arguments[0], arguments[1:]
    if "-o" not in rest:
        rest += ["-o", "out"]
    capsys.readouterr()
    assert main([command, str(tiny_bert), *rest]) == 2
    err = capsys.readouterr().err
    assert flag in err and says in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-bert"]
