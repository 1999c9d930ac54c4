"""Another library's error reaches the user as part of one line: every place that quotes one quotes it alike."""

import pathlib

import pytest

from collab_convert.errors import first_line

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "collab_convert"


def test_the_first_line_of_an_error_is_quoted():
    assert first_line(ValueError("bad shape\n  at layer 3")) == "bad shape"


def test_a_line_that_only_introduces_the_cause_is_quoted_with_it():
    error = ValueError("1 validation error for field 'hidden_size':\n  expected int, got str\n  more")
    assert first_line(error) == "1 validation error for field 'hidden_size': expected int, got str"


@pytest.mark.parametrize("message", ["", "   \n  "])
def test_an_error_that_says_nothing_is_named_by_its_type(message):
    assert first_line(RuntimeError(message)) == "RuntimeError"


def test_a_long_line_is_cut_to_the_limit():
    quoted = first_line(ValueError("x" * 500))
    assert len(quoted) == 200 and quoted.endswith("...")


def test_no_module_takes_an_error_s_first_line_by_hand():
    """`str(error).splitlines()[0]` fails on an error with no message (an IndexError in place of the user's line)."""
    patterns = ("str(error).splitlines()", "str(error).strip().splitlines()")
    by_hand = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if path.name != "errors.py" and any(pattern in path.read_text() for pattern in patterns)]
    assert by_hand == []
