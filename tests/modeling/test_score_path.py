"""The shared-key score path gives what per-head attention gives: masks, content bias, causal, grouped values,
eager and SDPA alike."""

import pytest
import torch
from torch import nn

from collab_convert import CompressOptions, compress
from collab_convert.modeling import attention, blocks
from collab_convert.modeling.attention import _per_head_attention, shared_key_attention


class FakeModule(nn.Module):
    """What the score path reads from a collaborative module: mixing, its origin, config, causality."""

    collaborative_origin = nn.Module
    is_collaborative = True

    def __init__(self, heads, rank, causal=False, content_bias=True):
        super().__init__()
        self.mixing = nn.Parameter(torch.randn(heads, rank))
        self.content_bias = torch.zeros(heads if content_bias else 0, 1)  # the score path reads its row count
        self.is_causal = causal
        self.config = type("Config", (), {"_attn_implementation": "eager"})()


def pseudo_heads(batch, n, m, heads, rank, head_dim, content_bias=True):
    """Shared query and packed key [shared key, per-head bias (where there is one)], padded to head_dim chunks,
    as (B, P, len, d)."""
    def padded(width, length):
        tensor = torch.zeros(batch, length, -(-width // head_dim) * head_dim)
        tensor[..., :width] = torch.randn(batch, length, width)
        return tensor.view(batch, length, -1, head_dim).transpose(1, 2)
    return padded(rank, n), padded(rank + (heads if content_bias else 0), m)


def masks(kind, batch, n, m):
    """(the mask handed to the score path, the same as an additive float mask for per-head attention)"""
    minimum = torch.finfo(torch.float32).min
    if kind == "padding":
        mask = torch.zeros(batch, 1, 1, m)
        mask[1, ..., 3:] = minimum
        return mask, mask
    if kind == "bool":
        mask = torch.ones(batch, 1, n, m, dtype=torch.bool).tril(m - n)
        return mask, torch.zeros(batch, 1, n, m).masked_fill(~mask, minimum)
    if kind == "full-float":
        mask = torch.randn(batch, 1, n, m)
        return mask, mask
    if kind == "causal-none":  # no mask: the module is causal, queries are the last n of m positions
        return None, torch.zeros(n, m).masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), minimum)
    return None, None


@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "causal-none", "full-float"])
@pytest.mark.parametrize("value_heads", [4, 1, 2])
@pytest.mark.parametrize("content_bias", [True, False], ids=["content-bias", "no-content-bias"])
def test_shared_key_path_matches_per_head_attention(mask_kind, value_heads, content_bias):
    torch.manual_seed(0)
    batch, n, heads, rank, head_dim = 2, 5, 4, 6, 8
    module = FakeModule(heads, rank, causal=mask_kind == "causal-none", content_bias=content_bias)
    query, key = pseudo_heads(batch, n, n, heads, rank, head_dim, content_bias)
    value = torch.randn(batch, value_heads, n, head_dim)
    mask, additive = masks(mask_kind, batch, n, n)
    fast, fast_weights = shared_key_attention(module, query, key, value, mask, scaling=0.3)
    slow, slow_weights = _per_head_attention(module, query, key, value, additive, scaling=0.3)
    assert torch.allclose(fast, slow, atol=1e-5) and torch.allclose(fast_weights, slow_weights, atol=1e-6)
    assert fast.shape == (batch, n, heads, head_dim)


class BusyNeighbour:
    def busy_elsewhere(self) -> float:
        return 1e6  # every core of any machine busy elsewhere


@pytest.fixture(params=["torch-threads", "block-workers"])
def scheduling(request, monkeypatch):
    """How the blocks run: each operation split over torch's threads (a quiet machine), or whole blocks shared
    out to single-threaded workers (beside a busy neighbour, as the gauge here says)."""

    if request.param == "block-workers":
        monkeypatch.setattr(blocks.BlockWorkers, "_gauge", BusyNeighbour())
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        yield request.param
        torch.set_num_threads(threads)
    else:
        yield request.param


@pytest.mark.parametrize("block_numbers", [1, 700, 1 << 20], ids=["row-blocks", "sequence-blocks", "one-block"])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "causal-none", "full-float"])
@pytest.mark.parametrize("cached", [False, True], ids=["prefill", "with-cache"])
@pytest.mark.parametrize("content_bias", [True, False], ids=["content-bias", "no-content-bias"])
def test_blocked_inference_matches_per_head_attention(block_numbers, mask_kind, cached, content_bias, scheduling,
                                                      monkeypatch):
    # Inference without weights to return runs in blocks of sequences or of query rows; a cache makes the
    # queries the last n of m positions. Every blocking, however scheduled, gives per-head attention's output.

    monkeypatch.setattr(attention, "BLOCK_NUMBERS", block_numbers)
    torch.manual_seed(1)
    batch, heads, rank, head_dim = 5, 4, 6, 8
    n, m = (3, 7) if cached else (7, 7)
    module = FakeModule(heads, rank, causal=mask_kind == "causal-none", content_bias=content_bias)
    query, key = pseudo_heads(batch, n, m, heads, rank, head_dim, content_bias)
    value = torch.randn(batch, 2, m, head_dim)
    mask, additive = masks(mask_kind, batch, n, m)
    bias = torch.randn(1, heads, n, m)
    with torch.no_grad():
        fast, weights = shared_key_attention(module, query, key, value, mask, scaling=0.3, keep_weights=False,
                                             position_bias=bias)
        combined = bias if additive is None else bias + additive
        slow, _ = _per_head_attention(module, query, key, value, combined, scaling=0.3)
    assert weights is None and fast.shape == (batch, n, heads, head_dim)
    assert torch.allclose(fast, slow, atol=1e-5)
    with torch.inference_mode():  # the workers run in the caller's mode
        fast, _ = shared_key_attention(module, query, key, value, mask, scaling=0.3, keep_weights=False,
                                       position_bias=bias)
    assert torch.allclose(fast, slow, atol=1e-5)


def test_block_workers_run_on_one_thread_and_leave_everyone_elses_thread_count(monkeypatch):
    import threading


    monkeypatch.setattr(blocks.BlockWorkers, "_gauge", BusyNeighbour())
    monkeypatch.setattr(blocks.BlockWorkers, "_pool", None)  # a fresh pool, started here
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        blocks.BlockWorkers.run(lambda block: seen.append(torch.get_num_threads()), list(range(6)))
        assert seen == [1] * 6
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("busy, workers", [(None, False), (0.2, False), (5.0, False), (6.6, True)])
def test_workers_take_over_only_when_others_crowd_our_cores(busy, workers, monkeypatch):
    # 8 cores, torch on 2: others may keep 6 busy before any of their work lands on ours
    import threading


    class Gauge:
        def busy_elsewhere(self):
            return busy

    monkeypatch.setattr(blocks.BlockWorkers, "_gauge", Gauge())
    monkeypatch.setattr(blocks.os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        names = []
        blocks.BlockWorkers.run(lambda block: names.append(threading.current_thread().name), [1, 2, 3, 4])
    finally:
        torch.set_num_threads(before)
    assert all(name.startswith("collab-blocks") == workers for name in names) and len(names) == 4


def test_a_forked_child_runs_blocks_with_workers_of_its_own(monkeypatch):
    # A child forked after the pool started (a data-loader worker, say) inherits the pool but not its threads;
    # handing it blocks must not wait forever.
    import os
    import signal
    import time


    monkeypatch.setattr(blocks.BlockWorkers, "_gauge", BusyNeighbour())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        blocks.BlockWorkers.run(lambda block: None, [1, 2, 3])  # the parent's pool, started
        child = os.fork()
        if child == 0:
            seen = []
            blocks.BlockWorkers.run(seen.append, [4, 5, 6])
            os._exit(0 if sorted(seen) == [4, 5, 6] else 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child's blocks never ran")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(before)


def test_the_neighbour_gauge_counts_other_processes_cpu_time_not_ours(monkeypatch):
    from collab_convert import cpu

    clock = {"wall": 0.0, "own": 0.0, "busy_ticks": 0}
    monkeypatch.setattr(cpu.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(cpu.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(cpu, "_cpu_ticks", lambda: (1000 - clock["busy_ticks"], 1000))  # (idle, all)
    gauge = cpu.NeighbourGauge(interval=0.25)
    gauge._hertz = 100
    assert gauge.busy_elsewhere() is None  # one reading is no rate yet
    clock.update(wall=1.0, own=1.5, busy_ticks=200)  # 2 cores busy for 1 s, 1.5 s of it ours
    assert gauge.busy_elsewhere() == pytest.approx(0.5)
    clock.update(wall=1.1, own=1.6, busy_ticks=220)  # within the interval: the last reading stands
    assert gauge.busy_elsewhere() == pytest.approx(0.5)
    clock.update(wall=2.0, own=3.5, busy_ticks=400)  # all of the busy time was ours
    assert gauge.busy_elsewhere() == pytest.approx(0.0)


def test_eager_and_sdpa_give_the_same_collaborative_model(tiny_bert, tmp_path, token_batch):
    from transformers import AutoModel

    compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out"))
    outputs = {}
    for implementation in ("eager", "sdpa"):
        model = AutoModel.from_pretrained(tmp_path / "out", attn_implementation=implementation).eval()
        with torch.no_grad():
            outputs[implementation] = model(**token_batch).last_hidden_state
    assert torch.allclose(outputs["eager"], outputs["sdpa"], atol=1e-5)


def test_blocked_inference_runs_in_and_out_of_inference_mode(tiny_bert, tmp_path, token_batch):
    # The blocks' scratch memory is kept between calls; a tensor made under inference_mode cannot be written
    # outside it, so a model first run under inference_mode must still run under no_grad (and back).
    from transformers import AutoModel

    compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out"))
    model = AutoModel.from_pretrained(tmp_path / "out", attn_implementation="sdpa").eval()
    with torch.inference_mode():
        first = model(**token_batch).last_hidden_state.clone()
    with torch.no_grad():
        second = model(**token_batch).last_hidden_state
    with torch.inference_mode():
        third = model(**token_batch).last_hidden_state
    assert torch.equal(first, second) and torch.equal(first, third)
