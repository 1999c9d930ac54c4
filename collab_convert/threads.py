"""The math's threads for a run: the cores idle when it starts (math_threads, cpu.choose_threads), then the cores
idle as it goes (governed).

Counted only at the start, a run that a job joins later shares its cores with both of its threads, and every
parallel region waits on the thread the scheduler parked: on 2 cores beside one busy job, a SmolLM2 layer's
multi-query refinement took 8.3 s on 2 threads and 4.75 s on 1. A job that stops leaves a core idle for the rest of
the run. So a long run counts the idle cores again as it goes.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .cpu import NeighbourGauge, bound_primitive_cache, choose_threads, most_threads
from .progress import Progress

RECOUNT = 1.0  # seconds of /proc/stat each count reads: shorter ones follow a bursty neighbour back and forth
_ceiling: int | None = None  # inside math_threads with no count asked for: the most threads `governed` may set


@contextlib.contextmanager
def math_threads(requested: int | None):
    """Run the block with the chosen number of torch threads; torch's setting is restored afterwards. Yields
    (threads, why). oneDNN's kernel cache is bounded first (bound_primitive_cache)."""
    import torch

    global _ceiling
    bound_primitive_cache()
    default = torch.get_num_threads()
    threads, why = choose_threads(requested, default)
    torch.set_num_threads(threads)
    outer, _ceiling = _ceiling, None if requested is not None else most_threads(default)
    try:
        yield threads, why
    finally:
        torch.set_num_threads(default)
        _ceiling = outer


class ThreadGovernor:
    """Sets torch's threads to the cores others leave idle (at least one, at most `ceiling`: cpu.most_threads), when
    called between pieces of work. Only from the main thread, and only while the count is still the one it set:
    layer fits side by side pin the count to one thread each (streaming.py), and that is theirs to give back.
    `record` (report.json's threads) keeps the counts used and how often the count changed."""

    def __init__(self, threads: int, ceiling: int, record: dict, gauge=None, cores: int | None = None):
        self.ceiling, self.set_to, self.record = max(1, ceiling), threads, record
        self.cores = cores or os.cpu_count() or 1
        self.gauge = gauge or NeighbourGauge(RECOUNT)
        self.gauge.busy_elsewhere()  # the first reading: the counts measure from here
        record.setdefault("counts_used", [threads])

    def __call__(self) -> None:
        import torch

        if threading.current_thread() is not threading.main_thread() or torch.get_num_threads() != self.set_to:
            return
        busy = self.gauge.busy_elsewhere()  # None until RECOUNT seconds have passed, or where /proc/stat is not
        if busy is None:
            return
        wanted = max(1, min(self.ceiling, round(self.cores - busy)))
        if wanted != self.set_to:
            torch.set_num_threads(wanted)
            self.set_to = wanted
            self.record["counts_used"] = sorted({*self.record["counts_used"], wanted})
            self.record["changes"] = self.record.get("changes", 0) + 1


def governed(progress: Progress, record: dict) -> Progress:
    """`progress`, with the idle cores counted again (at most every RECOUNT seconds) before each report: the
    stages report every second or so, so the count follows the machine without a clock of its own. Unchanged
    where a count was asked for (--threads) or outside math_threads."""
    if _ceiling is None or _ceiling <= 1:
        return progress
    governor = ThreadGovernor(record["threads"], _ceiling, record)

    def report(what: str, done: int, total: int) -> None:
        governor()
        progress(what, done, total)

    return report
