"""The progress callback the jobs report through: (what, done, total). The CLI draws it; the API ignores it."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    pass
