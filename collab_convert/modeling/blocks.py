"""Running the score blocks of CPU inference (attention.py) fast on a shared machine: a pool of single-threaded
workers that take blocks as they free up, used beside a busy neighbour, and per-thread scratch memory for the
blocks' queries and scores."""

from __future__ import annotations

import math
import os
import threading

import torch

from ..cpu import NeighbourGauge


class BlockWorkers:
    """A few threads, each running torch on one thread, that take blocks from a shared iterator until none are
    left: dynamic scheduling of the score blocks over the cores torch was given. Used only beside a busy
    neighbour (NeighbourGauge). Started when first needed and kept (a new pool per call would cost more than a
    small layer)."""

    _pool = None
    _size = 0
    _pid = None  # a forked child inherits the pool object but not its threads: it starts its own
    _lock = threading.Lock()
    _gauge = NeighbourGauge()
    BUSY = 0.5  # cores busy elsewhere from which the workers take over

    @classmethod
    def run(cls, work, blocks: list) -> None:
        threads = torch.get_num_threads()
        busy = cls._gauge.busy_elsewhere() if threads > 1 else None
        # others' work lands on our threads' cores only once it fills the cores we leave free (a big machine's
        # other jobs usually run beside ours, not on top of them)
        spare = max((os.cpu_count() or threads) - threads, 0)
        if threads <= 1 or busy is None or busy - spare < cls.BUSY:
            for block in blocks:
                work(block)
            return
        # one block (a decode step) too: one thread that runs it whole waits for no slowed thread
        threads = min(threads, len(blocks))
        taken = iter(blocks)  # next() on a list iterator is atomic under the GIL: each block runs once
        pool = cls._executor(threads)
        futures = [pool.submit(cls._take, work, taken) for _ in range(threads)]
        for future in futures:
            future.result()

    @staticmethod
    def _take(work, taken) -> None:
        for block in taken:
            work(block)

    @classmethod
    def _executor(cls, threads: int):
        with cls._lock:
            if cls._pool is None or cls._size < threads or cls._pid != os.getpid():
                from concurrent.futures import ThreadPoolExecutor

                if cls._pool is not None and cls._pid == os.getpid():
                    cls._pool.shutdown(wait=False)
                ready = threading.Barrier(threads)
                pool = ThreadPoolExecutor(threads, thread_name_prefix="collab-blocks",
                                          initializer=_single_threaded, initargs=(ready,))
                # torch.set_num_threads also sets the count every thread started later begins with: start all the
                # workers now, then give that count back, so the caller's threads and new ones keep theirs
                for future in [pool.submit(lambda: None) for _ in range(threads)]:
                    future.result()
                torch.set_num_threads(torch.get_num_threads())
                cls._pool, cls._size, cls._pid = pool, threads, os.getpid()
            return cls._pool


def _single_threaded(ready: threading.Barrier) -> None:
    torch.get_num_threads()  # torch's per-thread set-up first: it would later reset this thread's count
    torch.set_num_threads(1)
    try:
        ready.wait(timeout=30)  # every worker started before the count is given back
    except threading.BrokenBarrierError:
        pass  # a slow start: the caller's count may be given back early, this thread still runs on one


_WORKSPACES = threading.local()


def workspace(like: torch.Tensor, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Tensors of these shapes carved from this thread's scratch memory, kept from call to call (like a BLAS
    workspace): a block's queries and scores written into fresh memory every layer would be page-faulted in
    afresh whenever the allocator has handed that memory back to the system, which on CPU cost more than the
    arithmetic (MiniLM, batch 32 x 128: 14,000 more page faults per forward than the original without it)."""
    sizes = [math.prod(shape) for shape in shapes]
    # inference-mode tensors cannot be written outside inference mode: one workspace for each
    key = (like.device, like.dtype, torch.is_inference_mode_enabled())
    spaces = getattr(_WORKSPACES, "spaces", None)
    if spaces is None:
        spaces = _WORKSPACES.spaces = {}
    space = spaces.get(key)
    if space is None or space.numel() < sum(sizes):
        space = spaces[key] = torch.empty(sum(sizes), dtype=like.dtype, device=like.device)
    return [part.view(shape) for part, shape in zip(torch.split(space[: sum(sizes)], sizes), shapes, strict=True)]
