"""Refinement's reused heap (cpu.reused_heap) is process-wide: layers refined side by side in threads share it, and
the 1 MiB mmap threshold of the block-at-a-time passes returns only when the last of them is done. What the
process keeps for its life is bounded too (oneDNN's kernel cache)."""

import os
import threading

import pytest
import torch

from collab_convert import cpu
from collab_convert.threads import math_threads

from fixtures.libc import RecordingLibc


def test_the_heap_stays_until_the_last_refinement_sharing_it_is_done(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    first_inside, second_done = threading.Event(), threading.Event()

    def first():
        with cpu.reused_heap():
            first_inside.set()
            second_done.wait(5)
            assert libc.calls == [("trim", 0), ("mallopt", cpu.HEAP_THRESHOLD)]  # the other one left: still ours

    thread = threading.Thread(target=first)
    thread.start()
    first_inside.wait(5)
    with cpu.reused_heap():
        pass
    second_done.set()
    thread.join(5)
    assert libc.calls == [("trim", 0), ("mallopt", cpu.HEAP_THRESHOLD), ("trim", 0), ("mallopt", cpu.MMAP_THRESHOLD)]


def test_an_error_inside_still_gives_the_threshold_back(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    try:
        with cpu.reused_heap():
            raise ValueError("a refinement that failed")
    except ValueError:
        pass
    assert libc.calls[-1] == ("mallopt", cpu.MMAP_THRESHOLD)
    with cpu.reused_heap():  # and the next one takes the heap again
        assert libc.calls[-1] == ("mallopt", cpu.HEAP_THRESHOLD)


def test_loops_of_steps_keep_the_heaps_top_and_forward_passes_do_not(monkeypatch):
    """A threshold set by hand fixes glibc's trim threshold at 128 KiB: every step's freed tensors would go back at
    the heap's top and be faulted in again. A loop of steps keeps the top (up to 16 MiB) while it runs, even
    with a forward pass's user sharing the heap; a forward pass alone leaves the default."""
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    with cpu.reused_heap():
        assert libc.trim_thresholds == []
    with cpu.reused_heap(top=cpu.HEAP_TRIM_THRESHOLD):
        assert libc.trim_thresholds == [("mallopt", cpu.HEAP_TRIM_THRESHOLD)]
        with cpu.reused_heap():  # a pass inside a refinement's heap: the top stays
            pass
        assert libc.trim_thresholds == [("mallopt", cpu.HEAP_TRIM_THRESHOLD)]
    assert libc.trim_thresholds == [("mallopt", cpu.HEAP_TRIM_THRESHOLD), ("mallopt", cpu.TRIM_THRESHOLD)]
    assert cpu.HEAP_TRIM_THRESHOLD == 16 << 20 and cpu.TRIM_THRESHOLD == 128 << 10


def test_users_keeping_different_tops_share_the_largest_until_it_leaves(monkeypatch):
    """A large checkpoint's calibration pass keeps up to 64 MiB at the top (model_runs.kept_top), a loop of steps
    16 MiB: sharing the heap, the larger stands while its user is inside, and the smaller returns when it leaves."""
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    steps, batch = cpu.HEAP_TRIM_THRESHOLD, 64 << 20
    with cpu.reused_heap(top=steps):
        with cpu.reused_heap(top=batch):
            assert libc.trim_thresholds[-1] == ("mallopt", batch)
            with cpu.reused_heap(top=steps):  # a smaller one inside changes nothing
                pass
            assert libc.trim_thresholds == [("mallopt", steps), ("mallopt", batch)]
        assert libc.trim_thresholds[-1] == ("mallopt", steps)
    assert libc.trim_thresholds == [("mallopt", steps), ("mallopt", batch), ("mallopt", steps),
                                    ("mallopt", cpu.TRIM_THRESHOLD)]


def test_the_heap_is_trimmed_before_a_refinement_takes_it(monkeypatch):
    """What the work before freed (a layer's fit) is handed back first: the heap grows from what is live."""
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    with cpu.reused_heap():
        assert libc.calls == [("trim", 0), ("mallopt", cpu.HEAP_THRESHOLD)]
        with cpu.reused_heap():  # a user inside another's heap takes it as it is
            assert libc.calls == [("trim", 0), ("mallopt", cpu.HEAP_THRESHOLD)]


def test_the_heap_is_handed_back_only_past_its_bound_of_growth(monkeypatch):
    """Between a block's batches: a heap that grew little keeps its free pages for the next batch; one whose holes
    grew past the bound gives them back, and what stays after that is the start of the next look."""
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    resident = [100 << 20]
    monkeypatch.setattr(cpu, "anonymous_resident_bytes", lambda: resident[0])
    heap = cpu.BoundedHeap(64 << 20)
    resident[0] = 150 << 20
    heap.check()
    assert libc.calls == []
    resident[0] = 170 << 20
    heap.check()
    assert libc.calls == [("trim", 0)]
    heap.check()  # 170 MB stayed after the trim (in use): no growth since
    assert libc.calls == [("trim", 0)]


def test_anonymous_memory_is_read_from_the_process():
    """Where /proc answers, touching a fresh 64 MiB tensor shows in the anonymous resident memory."""
    if cpu.anonymous_resident_bytes() is None:
        pytest.skip("no /proc: the bound is then never applied")
    before = cpu.anonymous_resident_bytes()
    touched = torch.ones(16 << 20)  # 64 MiB of float32, every page written
    after = cpu.anonymous_resident_bytes()
    assert after - before >= 60 << 20 and float(touched[-1]) == 1.0


def test_onednn_keeps_a_bounded_number_of_kernels_unless_the_environment_says_otherwise(monkeypatch):
    """oneDNN's kernel cache (1,024 by default) holds its memory for the process's life: compress, analyze and
    verify bound it before their first product, and leave a capacity the user set alone."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    assert cpu.bound_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == cpu.PRIMITIVE_CACHE
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    with math_threads(1):  # what compress and analyze run their math in sets it too
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == cpu.PRIMITIVE_CACHE
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
        monkeypatch.setenv(name, "7")
        assert not cpu.bound_primitive_cache()
        assert os.environ[name] == "7" and os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7") == "7"
        monkeypatch.delenv(name)


def test_ideeps_own_kernel_cache_is_bounded_too_unless_the_environment_says_otherwise(monkeypatch):
    """ideep, between PyTorch and oneDNN, keeps a second cache of the same kernels (LRU_CACHE_CAPACITY, 1,024 by
    default), which grew the memory a run leaves behind with every new product shape: bounded with oneDNN's, and
    a capacity the user set is left alone."""
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")  # set by the user: ideep's is bounded all the same
    cpu.bound_primitive_cache()
    assert os.environ["LRU_CACHE_CAPACITY"] == cpu.KERNEL_CACHE
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "5")
    cpu.bound_primitive_cache()
    assert os.environ["LRU_CACHE_CAPACITY"] == "5" and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
