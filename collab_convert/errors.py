"""Errors a user can act on. The CLI prints their message as one line; nothing else reaches the terminal."""

from __future__ import annotations


class CollabError(Exception):
    """Base class: a problem with the user's input or environment, not a bug in the tool."""

    exit_code = 3


class BadInputError(CollabError):
    """The model, its files or an option cannot be used."""


class UnsupportedModelError(BadInputError):
    """The architecture is not one the collaborative form can represent (yet)."""


class OutputExistsError(BadInputError):
    """The output folder exists and is not empty, and --overwrite was not given."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """What of another library's error fits in our one-line message: its first line, with the next one where the
    first only introduces it ("Validation error for field 'x':"), the exception's type where it says nothing, and
    at most `limit` characters."""
    text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    line = text[0] if text else type(error).__name__
    if line.endswith(":") and len(text) > 1:
        line = f"{line} {text[1]}"
    return line if len(line) <= limit else line[: limit - 3] + "..."
