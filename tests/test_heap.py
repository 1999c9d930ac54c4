"""Refinement's reused heap (cpu.reused_heap) is process-wide: layers refined side by side in threads share it, and
the 1 MiB mmap threshold of the block-at-a-time passes returns only when the last of them is done."""

import threading

import pytest

from collab_convert import cpu

from fixtures.libc import RecordingLibc


def test_the_heap_stays_until_the_last_refinement_sharing_it_is_done(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "_libc", lambda: libc)
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
    monkeypatch.setattr(cpu, "_libc", lambda: libc)
    try:
        with cpu.reused_heap():
            raise ValueError("a refinement that failed")
    except ValueError:
        pass
    assert libc.calls[-1] == ("mallopt", cpu.MMAP_THRESHOLD)
    with cpu.reused_heap():  # and the next one takes the heap again
        assert libc.calls[-1] == ("mallopt", cpu.HEAP_THRESHOLD)


def test_the_heap_is_trimmed_before_a_refinement_takes_it(monkeypatch):
    """What the work before freed (a layer's fit) is handed back first: the heap grows from what is live."""
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "_libc", lambda: libc)
    with cpu.reused_heap():
        assert libc.calls == [("trim", 0), ("mallopt", cpu.HEAP_THRESHOLD)]
        with cpu.reused_heap():  # a user inside another's heap takes it as it is
            assert libc.calls == [("trim", 0), ("mallopt", cpu.HEAP_THRESHOLD)]


def test_the_heap_is_handed_back_only_past_its_bound_of_free_bytes(monkeypatch):
    """Between a block's batches: a heap with little free keeps it for the next batch; one whose holes grew past the
    bound gives its free pages back."""
    libc = RecordingLibc()
    monkeypatch.setattr(cpu, "_libc", lambda: libc)
    free = [10 << 20]
    monkeypatch.setattr(cpu, "free_heap_bytes", lambda: free[0])
    cpu.bound_free_heap(64 << 20)
    assert libc.calls == []
    free[0] = 65 << 20
    cpu.bound_free_heap(64 << 20)
    assert libc.calls == [("trim", 0)]


def test_the_free_part_of_the_heap_is_read_from_glibc():
    """Where glibc answers (mallinfo2), freeing a large block that came from the heap shows in its free bytes."""
    import ctypes

    if cpu.free_heap_bytes() is None:
        pytest.skip("not glibc, or one older than 2.33: the bound is then never applied")
    libc = cpu._libc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    with cpu.reused_heap():  # 8 MiB comes from the heap here, not from its own mapping
        before = cpu.free_heap_bytes()
        first, second = libc.malloc(8 << 20), libc.malloc(2 << 20)  # the second keeps the first off the top
        libc.free(first)
        after = cpu.free_heap_bytes()
        libc.free(second)
    assert after - before >= 7 << 20  # the 8 MiB block, less what the second request took of the free part
