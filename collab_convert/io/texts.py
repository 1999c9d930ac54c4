"""Text inputs (calibration, verify): one example per line, from a file or a folder of .txt files."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInputError


def read_texts(path: Path, limit: int | None = None) -> list[str]:
    """One example per line, from a text file or every .txt file in a folder (sorted); blank lines skipped."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise BadInputError(f"{path} holds no .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise BadInputError(f"calibration text {path} does not exist")
    texts = []
    for file in files:
        try:
            content = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise BadInputError(f"{file} is not readable UTF-8 text: {error}") from None
        texts += [line.strip() for line in content.splitlines() if line.strip()]
    if not texts:
        raise BadInputError(f"{path} holds no text")
    return texts[:limit] if limit else texts
