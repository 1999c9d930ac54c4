"""A calibrated run's fidelity figure, and the gates on it (--min-cosine, ...), judge lines the fit never saw."""

import pytest

from collab_convert import compress
from collab_convert.errors import BadInputError
from collab_convert.options import CompressOptions
from collab_convert.stages import calibration_texts


def _options(tmp_path, **fields) -> CompressOptions:
    return CompressOptions(output=tmp_path / "out", **fields)


def _file(tmp_path, count: int):
    path = tmp_path / "texts.txt"
    path.write_text("".join(f"line number {i} of the calibration text\n" for i in range(count)), encoding="utf-8")
    return path


def test_lines_past_the_fitted_samples_are_the_held_out_ones(tmp_path):
    fitted, probe = calibration_texts(_options(tmp_path, calibration=_file(tmp_path, 100), calibration_samples=60))
    assert len(fitted) == 60 and len(probe.texts) == 32 and not set(fitted) & set(probe.texts)
    assert probe.description == f"32 held-out lines of {tmp_path / 'texts.txt'}"


def test_a_file_with_none_to_spare_holds_out_its_last_tenth_from_the_fit(tmp_path):
    fitted, probe = calibration_texts(_options(tmp_path, calibration=_file(tmp_path, 300)))  # 512 samples by default
    assert len(fitted) == 270 and len(probe.texts) == 30 and not set(fitted) & set(probe.texts)
    assert probe.texts[-1] == "line number 299 of the calibration text"
    assert "30 held-out lines" in probe.description and "the fit used the 270 before them" in probe.description
    fitted, probe = calibration_texts(_options(tmp_path, calibration=_file(tmp_path, 500)))
    assert (len(fitted), len(probe.texts)) == (468, 32)  # 32 at most: as many as a figure needs


def test_a_line_repeated_in_the_file_is_read_once_so_no_held_out_line_is_also_fitted(tmp_path):
    """Boilerplate repeated through a file (a signature, a header) would otherwise sit in the fit and in the lines
    held out from it, and in the refinement's training sequences and its held-out checks alike."""
    path = tmp_path / "texts.txt"
    lines = [f"line number {i} of the calibration text" for i in range(100)]
    repeated = [line for i, line in enumerate(lines) for _ in range(3 if i % 10 == 0 else 1)]  # 20 repeats
    path.write_text("\n".join(repeated + lines[:5]) + "\n", encoding="utf-8")  # and 5 more at the end
    fitted, probe = calibration_texts(_options(tmp_path, calibration=path, calibration_samples=60))
    assert fitted == lines[:60] and probe.texts == lines[60:92]
    assert probe.repeats_dropped == 20  # the file is read only as far as the texts asked for: 92 distinct lines


def test_a_compress_run_reports_the_repeats_it_dropped(tiny_bert, tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("".join(f"line number {i % 20} of the calibration text\n" for i in range(50)), encoding="utf-8")
    result = compress(str(tiny_bert), _options(tmp_path, rank=8, calibration=path, refine_steps=2))
    assert result.calibration["repeated_lines_dropped"] == 30
    assert result.calibration["examples"] == 18  # the 20 distinct lines less the 2 held out
    assert "(30 repeated lines read once)" in (tmp_path / "out" / "report.md").read_text()


def test_a_file_of_fewer_than_ten_lines_lends_them_and_says_the_figure_is_not_held_out(tmp_path):
    fitted, probe = calibration_texts(_options(tmp_path, calibration=_file(tmp_path, 6)))
    assert len(fitted) == 6 and probe.texts == fitted
    assert "also used for the fit" in probe.description and probe.seen_by_the_fit


def test_a_compress_run_on_such_a_file_warns_that_its_figures_overstate(tiny_bert, tmp_path):
    result = compress(str(tiny_bert), _options(tmp_path, rank=8, calibration=_file(tmp_path, 6), refine_steps=2))
    assert result.fidelity is not None
    assert any("overstates" in warning and "ten distinct lines or more" in warning for warning in result.warnings)


def test_distillation_on_a_single_line_is_refused_before_the_calibration_pass(tmp_path):
    """Refused as the texts are read (the late check in the distillation itself came after every costly stage)."""
    with pytest.raises(BadInputError, match="holds one"):
        calibration_texts(_options(tmp_path, calibration=_file(tmp_path, 1), distill_steps=5))
    fitted, _ = calibration_texts(_options(tmp_path, calibration=_file(tmp_path, 2), distill_steps=5))
    assert len(fitted) == 2
    (tmp_path / "same.txt").write_text("one line, said twice\none line, said twice\n", encoding="utf-8")
    with pytest.raises(BadInputError, match="holds one distinct line \\(1 repeats of it read once\\)"):
        calibration_texts(_options(tmp_path, calibration=tmp_path / "same.txt", distill_steps=5))
