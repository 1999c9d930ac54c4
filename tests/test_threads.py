"""A long run's threads follow the idle cores as other jobs start and stop beside it (threads.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from collab_convert import cpu
from collab_convert.report.reports import _recounted
from collab_convert.threads import ThreadGovernor, governed, math_threads


class Neighbour:
    """A neighbour gauge whose load the test sets: cores busy with other jobs."""

    def __init__(self):
        self.busy = 0.0

    def busy_elsewhere(self) -> float:
        return self.busy


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_job_that_starts_beside_the_run_takes_a_thread_and_one_that_stops_gives_it_back(two_cores):
    neighbour, record = Neighbour(), {"threads": 2}
    governor = ThreadGovernor(2, ceiling=2, record=record, gauge=neighbour, cores=2)
    governor()
    assert torch.get_num_threads() == 2 and "changes" not in record  # a quiet machine: nothing to change

    neighbour.busy = 0.9  # one busy job shares the cores with ours
    governor()
    assert torch.get_num_threads() == 1

    neighbour.busy = 0.0  # and stops
    governor()
    assert torch.get_num_threads() == 2
    assert record["counts_used"] == [1, 2] and record["changes"] == 2
    assert _recounted(record) == ", then 1 to 2 as other jobs came and went (2 changes)"


def test_never_fewer_than_one_thread_nor_more_than_the_ceiling(two_cores):
    neighbour = Neighbour()
    governor = ThreadGovernor(2, ceiling=2, record={"threads": 2}, gauge=neighbour, cores=8)
    neighbour.busy = 7.6
    governor()
    assert torch.get_num_threads() == 1
    neighbour.busy = 0.0  # eight idle cores, but torch's default was two
    governor()
    assert torch.get_num_threads() == 2


def test_a_count_someone_else_set_is_left_to_them(two_cores):
    """Layer fits side by side set one thread each (streaming.py) and give the count back themselves."""
    neighbour, record = Neighbour(), {"threads": 2}
    governor = ThreadGovernor(2, ceiling=2, record=record, gauge=neighbour, cores=2)
    torch.set_num_threads(1)
    neighbour.busy = 0.0
    governor()
    assert torch.get_num_threads() == 1 and "changes" not in record


def test_only_the_main_thread_changes_the_count(two_cores):
    neighbour = Neighbour()
    governor = ThreadGovernor(2, ceiling=2, record={"threads": 2}, gauge=neighbour, cores=2)
    neighbour.busy = 1.0
    worker = threading.Thread(target=governor)
    worker.start()
    worker.join()
    assert torch.get_num_threads() == 2
    governor()
    assert torch.get_num_threads() == 1


def test_progress_is_left_alone_where_a_count_was_asked_for():
    def progress(what, done, total):
        pass

    with math_threads(1) as (threads, why):
        assert governed(progress, {"threads": threads, "why": why}) is progress
    assert governed(progress, {"threads": 1}) is progress  # outside a run: nothing to follow
