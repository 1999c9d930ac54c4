"""How many CPU threads the math should use: the cores that are idle now, not every core there is.

On a shared machine a second job already holds some cores; torch's default (one thread per core) then
oversubscribes them, and its parallel regions wait on parked threads (2 cores, one busy neighbour: a calibrated
all-MiniLM-L6-v2 compress took 134 s on 2 threads, 72 s on 1). So a job uses the cores idle over a short window
(/proc/stat, Linux), at least one and at most torch's default (threads.py: through a run); --threads wins.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time

WINDOW = 0.2  # seconds of /proc/stat to judge the idle cores by
REUSE = 30.0  # seconds one measurement serves later jobs in the same process (a loop of compress calls)
_measured: tuple[float, float | None] | None = None  # (when, idle cores)


def _cpu_ticks() -> tuple[int, int] | None:
    """(idle ticks, all ticks) summed over cores, or None where /proc/stat is not there."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)


def idle_cores(window: float = WINDOW) -> float | None:
    """Cores idle over the next `window` seconds (e.g. 1.0 of 2 with one busy neighbour), or None if unknown."""
    before = _cpu_ticks()
    if before is None:
        return None
    time.sleep(window)
    after = _cpu_ticks()
    if after is None or after[1] <= before[1]:
        return None
    cores = os.cpu_count() or 1
    return cores * (after[0] - before[0]) / (after[1] - before[1])


def choose_threads(requested: int | None, default: int) -> tuple[int, str]:
    """(threads, why) for the math: `requested` if given, else the idle cores rounded, within 1..default."""
    global _measured
    if requested is not None:
        return requested, "asked for"
    if _measured is None or time.monotonic() - _measured[0] > REUSE:
        _measured = (time.monotonic(), idle_cores())
    idle = _measured[1]
    if idle is None:
        return default, "torch's default (idle cores unknown here)"
    return max(1, min(most_threads(default), round(idle))), f"{idle:.1f} idle cores of {os.cpu_count()}"


def most_threads(default: int) -> int:
    """torch's default count, within the cores this process may run on (its affinity, where the system says)."""
    return min(default, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else default


# Kernels oneDNN keeps for the product shapes it met last. Its default keeps 1,024, and what they hold stays for the
# process's life: a calibrated compress of a 12-layer GPT-2-medium shape left 107 MB of anonymous memory behind
# (86 MB at 128 kernels, 56 MB at 32 or none), more as the model deepens, under the fidelity check's peak. None
# kept made a shared-key refinement 1.35-1.5 times as slow (each product's kernel built anew); 32, no slower.
PRIMITIVE_CACHE = "32"
# ideep, PyTorch's layer over oneDNN, keeps its own cache of the same kernels (LRU_CACHE_CAPACITY, 1,024 by
# default). With oneDNN's at 32, each refinement that met new product shapes still left about 1.6 MB behind: a
# shared-key layer's width differs from its neighbours', so glibc's bytes in use at the fidelity check's entry grew
# with depth (29 MB at 12 layers, 40 at 24). Both at 32: 13 MB at either depth, and SmolLM2's dumped layers refined
# in the same time. 0 crashes ideep.
KERNEL_CACHE = "32"


def bound_primitive_cache() -> bool:
    """Keep oneDNN's kernel cache to PRIMITIVE_CACHE entries and ideep's to KERNEL_CACHE, each unless the
    environment sets it. Both read their setting when they first build a kernel, so this works where nothing in
    the process has multiplied through them yet (a CLI run; a library caller's first job). Returns whether this
    call set oneDNN's."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", KERNEL_CACHE)
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ or "DNNL_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        return False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = PRIMITIVE_CACHE
    return True


# torch's CPU allocator asks the kernel for transparent huge pages on its buffers of 2 MiB and more where this is
# "1" (read at its first allocation). A decoder's calibration pass allocates and frees such buffers batch after
# batch, and each one came back page by page: on a Qwen2-0.5B-shaped checkpoint 8-16M page faults and 23.9-28.8 s
# of calibrating, 3.0M and 20.8-20.9 s with it, the same figures to every digit and the same peak. The CP form's
# fits grow glibc's heap with it set (a 407 MB GPT-2-medium shape: 246 MB against 186 MB, past the memory bound),
# so only the decoder forms ask. docs/benchmarks.md, "Huge pages for the decoder forms".
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE_FORMS = ("shared-key", "multi-query")


# torch's allocator asks for huge pages on buffers of at least this many bytes, and aligns them to the page
HUGE_PAGE_BUFFER = 2 << 20


def ask_for_huge_pages(form: str | None) -> bool:
    """For a run in `form`, set torch's HUGE_PAGES where the form is one of HUGE_PAGE_FORMS and the environment does
    not say otherwise. torch reads it at its first allocation: the command line asks before torch loads, or, for a
    form left to the model's family (known once the lookup has loaded torch), before anything is allocated. Where
    torch is loaded, the allocator is checked (huge_pages_on) and a setting it did not take is taken back, so that
    it misleads neither the report nor child processes. Returns whether torch takes it."""
    if form not in HUGE_PAGE_FORMS or HUGE_PAGES in os.environ:
        return False
    os.environ[HUGE_PAGES] = "1"
    if "torch" in sys.modules and not huge_pages_on():  # torch had allocated, and read its setting then
        del os.environ[HUGE_PAGES]
        return False
    return True


def huge_pages_on() -> bool:
    """Whether torch's allocator asks for huge pages in this process (as the report says), read off the allocator:
    with the setting, its buffers of HUGE_PAGE_BUFFER bytes and more start on a page; without, on 64 bytes (three
    on a page by chance: one time in 64^3). Where torch has not allocated yet, this is its first allocation."""
    if not sys.platform.startswith("linux"):  # the setting is Linux's transparent huge pages
        return False
    import torch

    page = os.sysconf("SC_PAGE_SIZE")
    held = [torch.empty(HUGE_PAGE_BUFFER + page * i + 64, dtype=torch.uint8) for i in range(3)]
    return all(buffer.data_ptr() % page == 0 for buffer in held)


KERNEL_HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/enabled"


def kernel_huge_pages(path: str = KERNEL_HUGE_PAGES) -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never; torch's setting asks by madvise, so it
    gets none under never), or None where the kernel does not say."""
    try:
        with open(path, encoding="ascii") as setting:
            chosen = [word for word in setting.read().split() if word.startswith("[")]
    except (OSError, ValueError):
        return None
    return chosen[0].strip("[]") if chosen else None


class NeighbourGauge:
    """How many cores other processes kept busy lately: the machine's busy time (/proc/stat) less this
    process's own CPU time, over the wall time since the last reading. Cheap enough to ask on every call (a
    reading is reused for `interval` seconds); None where /proc/stat is not there."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self._last: tuple[float, float, float] | None = None  # (wall, busy seconds of all cores, own CPU seconds)
        self._busy: float | None = None
        self._hertz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy_elsewhere(self) -> float | None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._busy
        ticks = _cpu_ticks()
        if ticks is None:
            return None
        reading = (now, (ticks[1] - ticks[0]) / self._hertz, time.process_time())
        if self._last is not None:
            wall = reading[0] - self._last[0]
            others = (reading[1] - self._last[1]) - (reading[2] - self._last[2])
            self._busy = max(others, 0.0) / wall
        self._last = reading
        return self._busy


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20
HEAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold (64-bit)
M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD = 128 << 10  # glibc's default, fixed once a threshold is set by hand
# the heap's top kept by loops of steps: a step's working set stays mapped (SmolLM2's shared-key steps and
# MiniLM's refining stage took as long as at 64 MiB), and at most this much freed memory beyond it is held
# (64 MiB, what glibc pairs with its own moving threshold, put a 12-layer GPT-2-medium-shaped checkpoint's
# refining stage at 208-217 MB above the imports; 16 MiB at 188-196 MB)
HEAP_TRIM_THRESHOLD = 16 << 20


@functools.cache
def glibc():
    """glibc, loaded once: finding it (find_library runs ldconfig) took 1.5 ms a call, and the block-at-a-time
    passes may hand the heap back after every batch (BoundedHeap)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None  # glibc only
    return libc


def return_freed_memory() -> bool:
    """Have glibc give large freed blocks back to the system at once.

    By default glibc raises its mmap threshold each time a large block is freed, so later large tensors come
    from the heap, which it rarely shrinks: running a model block after block then grew a process by hundreds
    of MB of memory it no longer used (measured: 300 -> 836 MB over four passes of a 12-block GPT-2; flat at
    300 MB with a fixed threshold). A fixed 1 MiB threshold keeps every tensor-sized block mmapped, returned
    when freed. Returns whether it applied (glibc only)."""
    libc = glibc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the system now (glibc's malloc_trim; elsewhere nothing).

    Blocks under the 1 MiB threshold still come from the heap, and an offloaded model's pass frees many of them
    (each block's small weights, reloaded per pass) between long-lived ones, so the heap's top rarely shrinks by
    itself. Trimmed after each pass of the fidelity check: its peak on a 24-layer GPT-2-medium-shaped bf16
    checkpoint fell from 433 to 349 MB above the baseline, and 267 MB stayed resident after it, 155 MB trimmed."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anonymous_resident_bytes() -> int | None:
    """The process's anonymous resident memory (resident less file-backed and shared pages, /proc/self/statm),
    or None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * _PAGE_SIZE


class BoundedHeap:
    """Between the batches of a reused heap (reused_heap): its free pages handed back once the process's anonymous
    memory has grown by more than `most` bytes since the last hand-back. A reused heap whose requests change size
    (batches of other lengths) leaves holes a little too small for the next ones, and grows by them.

    Growth is read from /proc (microseconds a look). glibc's own count of free bytes (mallinfo2) walks every free
    chunk: 7.5 ms a call after each batch, 5 s of SmolLM2's calibration pass on 300 documents."""

    def __init__(self, most: int):
        self.most, self.since = most, anonymous_resident_bytes()

    def check(self) -> None:
        now = anonymous_resident_bytes()
        if now is None or self.since is None or now - self.since <= self.most:
            return
        return_freed_heap()
        self.since = anonymous_resident_bytes()  # what stays is in use (samples kept, records): the next look's start


def release_unreachable() -> None:
    """Free what is unreachable now, cycles included, and hand the heap's free pages back: for the points where a
    model has just been let go (its modules and hooks hold each other, so reference counts never free it)."""
    import gc

    gc.collect()
    return_freed_heap()


_HEAP_USERS = 0  # callers inside reused_heap now: the heap stays until the last one is done
_TOPS: list[int] = []  # the tops they keep (`top`), where they keep one: the largest is kept
_HEAP_LOCK = threading.Lock()


@contextlib.contextmanager
def reused_heap(top: int = 0):
    """Within: blocks up to 32 MiB come from glibc's heap and are reused, as glibc does by default.

    Refinement allocates the same few-MB tensors at every Adam step; mmapped, each one is mapped, zeroed page
    by page and unmapped again, which made a calibrated compress of all-MiniLM-L6-v2 38% slower (refining
    23 -> 38 s). Its working set is one layer's, so a heap is harmless there; on the way out its free pages are
    handed back (malloc_trim) and the 1 MiB threshold returns for the block-at-a-time passes. On the way in too:
    the heap then grows from what is live, not on top of what the work before it freed (a layer's PCA fit left
    80-160 MB of freed small blocks under each refinement of a 12-layer GPT-2-medium-shaped checkpoint). Nested
    or threaded users share it: the threshold returns when the last of them is done. Forward passes use it a
    block at a time, with their growth bounded (BoundedHeap).

    `top`: up to this many free bytes at the heap's top stay mapped (glibc's trim threshold), for loops that
    allocate the same working set again and again. A threshold set by hand leaves glibc's 128 KiB trim threshold
    fixed, so every step's freed tensors were handed back at the top and faulted in again at the next, page by
    page: 4,600 faults and 16-19 ms a MiniLM refinement step, none and 10 ms with 16 MiB kept
    (HEAP_TRIM_THRESHOLD, for loops of steps: refinement, distillation). What stays is at most a step's own
    working set, which the peak already holds. The calibration pass keeps a sixteenth of the checkpoint, between
    16 and 64 MiB (model_runs.kept_top): a Qwen2-0.5B shape's feed-forward frees tensors of 17.7 MB in pairs,
    handed back at 16 MiB and faulted in again by the next batch. The fidelity check keeps none: a 12-layer
    GPT-2-medium-shaped checkpoint then peaked 40 MB higher, and SmolLM2's check was no faster. Users keeping
    different tops share the largest."""
    global _HEAP_USERS
    libc = glibc()
    if libc is None:
        yield
        return
    with _HEAP_LOCK:
        _HEAP_USERS += 1
        if _HEAP_USERS == 1:
            libc.malloc_trim(0)
            libc.mallopt(M_MMAP_THRESHOLD, HEAP_THRESHOLD)
        if top:
            _keep_top(libc, _TOPS + [top])
    try:
        yield
    finally:
        with _HEAP_LOCK:
            _HEAP_USERS -= 1
            if top:
                rest = list(_TOPS)
                rest.remove(top)
                _keep_top(libc, rest)
            if _HEAP_USERS == 0:
                libc.malloc_trim(0)
                libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _keep_top(libc, tops: list[int]) -> None:
    """The tops kept become `tops`: glibc's trim threshold set to their largest where that changes (its default,
    fixed, where none is left)."""
    before = max(_TOPS, default=0)
    _TOPS[:] = tops
    after = max(tops, default=0)
    if after != before:
        libc.mallopt(M_TRIM_THRESHOLD, after or TRIM_THRESHOLD)
