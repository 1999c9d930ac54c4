"""Text inputs (calibration, verify): one example per line, from a file or a folder of .txt files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..errors import BadInputError


MAX_LINE_CHARACTERS = 100_000  # far beyond any token budget; a 10 MB line is cut, not tokenised whole


class Lines(list):
    """The examples read, and how many lines were skipped as repeats of an earlier one (`distinct`)."""

    repeats: int = 0


def read_texts(path: Path, limit: int | None = None, distinct: bool = False) -> Lines:
    """One example per line, from a text file or every .txt file in a folder (sorted); blank lines skipped, and with
    `distinct` every line that repeats an earlier one (counted in `repeats`): a calibration text that appears twice
    would sit both in a fit's training sequences and in its held-out checks.

    Read line by line and only up to `limit` examples, so a huge file or a folder of thousands of files costs
    what is used. Binary files and invalid UTF-8 are refused in one line."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise BadInputError(f"{path} holds no .txt files")
    elif path.is_file():
        files = [path]
    elif path.exists():  # a device, a pipe: nothing to read line by line to an end
        raise BadInputError(f"text {path} is not a file or a folder of .txt files")
    else:
        raise BadInputError(f"text file {path} does not exist")  # read for --calibration and --texts alike
    texts, seen = Lines(), set()
    for file in files:
        for text in _lines(file):
            if distinct:
                if text in seen:
                    texts.repeats += 1
                    continue
                seen.add(text)
            texts.append(text)
            if limit is not None and len(texts) >= limit:
                return texts
    if not texts:
        raise BadInputError(f"{path} holds no text")
    return texts


def _lines(file: Path) -> Iterator[str]:
    """The file's lines, stripped and cut at MAX_LINE_CHARACTERS, blank ones skipped; read as they are asked for."""
    try:
        with open(file, encoding="utf-8", newline=None) as handle:
            for line in handle:
                if "\x00" in line:
                    raise BadInputError(f"{file} looks binary (it holds NUL bytes); give plain UTF-8 text")
                text = line.strip()[:MAX_LINE_CHARACTERS]
                if text:
                    yield text
    except UnicodeDecodeError as error:
        raise BadInputError(f"{file} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    except OSError as error:
        raise BadInputError(f"{file} could not be read: {error.strerror or error}") from None
