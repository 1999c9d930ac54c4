"""--timing: time per token of the original and the result, measured side by side and written into the reports;
decoders are timed per decode step, encoders per token of a forward pass, encoder-decoders say why not."""

import json

import pytest

from collab_convert import CompressOptions, compress
from fixtures.models import FAMILY_CASES, ROTARY_CASES, build_family, build_rotary


def case(name):
    return next(c for c in FAMILY_CASES if c.name == name)


def build(name, folder):
    if name == "llama":
        return build_rotary(next(c for c in ROTARY_CASES if c.name == name), folder)
    return build_family(case(name), folder)


@pytest.mark.parametrize("name, measure", [("bert", "forward pass"), ("opt", "decode step"), ("llama", "decode step")])
def test_timing_measures_both_models_per_token_and_reports_it(name, measure, tmp_path):
    build(name, tmp_path / "model")
    options = CompressOptions(output=tmp_path / "out", timing=True, plots=False)
    options = options.model_copy(update={"key_cache": 0.5} if name == "llama" else {"rank": 8})
    result = compress(str(tmp_path / "model"), options)
    runtime = result.runtime
    assert measure in runtime["measure"] and runtime["lengths"]
    for row in runtime["lengths"]:
        assert row["original_ms"] > 0 and row["collaborative_ms"] > 0
        assert row["ratio"] == pytest.approx(row["collaborative_ms"] / row["original_ms"], rel=0.01)
    report = (tmp_path / "out" / "report.md").read_text()
    card = (tmp_path / "out" / "README.md").read_text()
    first = runtime["lengths"][0]
    shown = f"n={first['tokens']}: {first['original_ms']:.3g} -> {first['collaborative_ms']:.3g} ms"
    assert shown in report and shown in card
    assert json.loads((tmp_path / "out" / "report.json").read_text())["runtime"] == runtime


def test_without_timing_the_report_says_how_to_measure(tmp_path):
    build_family(case("bert"), tmp_path / "model")
    result = compress(str(tmp_path / "model"), CompressOptions(rank=8, output=tmp_path / "out", plots=False))
    assert result.runtime is None
    assert "compress with --timing" in (tmp_path / "out" / "report.md").read_text()


def test_encoder_decoders_say_why_they_are_not_timed(tmp_path):
    build_family(case("t5"), tmp_path / "model")
    result = compress(str(tmp_path / "model"), CompressOptions(rank=8, output=tmp_path / "out", timing=True,
                                                                plots=False))
    assert "encoder-decoder" in result.runtime["skipped"]
    assert "time per token: not measured (encoder-decoder" in (tmp_path / "out" / "report.md").read_text()


def test_a_timing_that_cannot_run_is_reported_and_the_checkpoint_still_written(tmp_path, monkeypatch):
    from collab_convert.integration import runtime

    def broken(*args, **kwargs):
        raise RuntimeError("this model needs inputs the timer does not make")

    monkeypatch.setattr(runtime, "time_per_token", broken)
    build_family(case("bert"), tmp_path / "model")
    result = compress(str(tmp_path / "model"), CompressOptions(rank=8, output=tmp_path / "out", timing=True,
                                                                plots=False))
    assert result.runtime == {"skipped": "timing failed: this model needs inputs the timer does not make"}
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "time per token: not measured (timing failed" in (tmp_path / "out" / "report.md").read_text()
