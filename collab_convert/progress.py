"""The progress callback the jobs report through: (what, done, total). The CLI draws it; the API ignores it.

`what` names a stage ("fitting", "refining", ...) and may carry a detail after " · " that changes as the stage
runs ("refining · layer 3/6, KL 0.031 -> 0.024"); the stage is what comes before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Progress = Callable[[str, int, int], None]

DETAIL = " · "


def no_progress(what: str, done: int, total: int) -> None:
    pass


def stage_of(what: str) -> str:
    return what.split(DETAIL, 1)[0]


class StageClock:
    """A progress callback that also times the stages: the time from one report to the next counts for the
    stage of the first. So the seconds per stage in a report are what the progress display showed."""

    def __init__(self, progress: Progress = no_progress):
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self._stage: str | None = None
        self._since = time.perf_counter()

    def __call__(self, what: str, done: int, total: int) -> None:
        self._switch(stage_of(what))
        self.progress(what, done, total)

    def _switch(self, stage: str | None) -> None:
        now = time.perf_counter()
        if self._stage is not None:
            self.seconds[self._stage] = self.seconds.get(self._stage, 0.0) + now - self._since
        self._stage, self._since = stage, now

    def stop(self) -> dict[str, float]:
        """Close the running stage; the seconds per stage, in the order the stages first ran."""
        self._switch(None)
        return {stage: round(seconds, 2) for stage, seconds in self.seconds.items()}
