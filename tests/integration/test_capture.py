"""Calibration statistics: batched and padded runs count exactly the real tokens, within a token budget."""

import torch

from collab_convert.architectures.source import open_model
from collab_convert.cpu import kernel_huge_pages
from collab_convert.integration import batches as batching
from collab_convert.integration.batches import token_batches
from collab_convert.integration.capture import collect_statistics
from transformers import AutoTokenizer

from fixtures import SENTENCES


def _statistics(folder, texts, **kwargs):
    source = open_model(str(folder))
    try:
        prefixes = [layer.prefix for layer in source.layers]
        return collect_statistics(source.folder, source.layout, source.family.position_bias, prefixes, texts, keep_samples=4, **kwargs)
    finally:
        source.close()


def test_batched_statistics_equal_one_text_at_a_time(tiny_bert, monkeypatch):
    texts = SENTENCES[:20]
    batched, batches = _statistics(tiny_bert, texts)
    assert len(batches.batches) < len(texts)  # several texts per forward pass, padded
    assert any(min(lengths) < max(lengths) for _, _, lengths in batches.batches)
    monkeypatch.setattr(batching, "BATCH_SEQUENCES", 1)
    single, _ = _statistics(tiny_bert, texts)
    for prefix, layer in batched.items():
        for side in ("query", "key"):
            mine, theirs = getattr(layer, side), getattr(single[prefix], side)
            assert torch.allclose(mine.covariance, theirs.covariance, rtol=1e-4, atol=1e-5)
            assert torch.allclose(mine.mean, theirs.mean, rtol=1e-4, atol=1e-5)
        # raw samples are real tokens only, and the key side shares the query side's copy
        assert [s.shape[0] for s in layer.query_samples] == [s.shape[0] for s in single[prefix].query_samples]
        assert all(q is k for q, k in zip(layer.query_samples, layer.key_samples))


def test_token_budget_caps_the_tokens_that_run(tiny_bert):
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    texts = SENTENCES[:20]
    everything = token_batches(tokenizer, texts, 64, None)
    capped = token_batches(tokenizer, texts, 64, 100)
    assert capped.tokens == 100 < everything.tokens
    real = sum(int(mask.sum()) for _, mask, _ in capped.batches)
    assert real == 100
    assert all(ids.shape[0] * ids.shape[1] <= batching.BATCH_TOKENS for ids, _, _ in everything.batches)


def test_the_report_records_the_tokens(tiny_bert, calibration_file, tmp_path):
    from collab_convert import CompressOptions, compress

    result = compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out", calibration=calibration_file,
                                                      refine_steps=0, calibration_tokens=150))
    assert result.calibration["tokens"] == 150
    assert 0 < result.calibration["examples"] < 32
    # the seconds of each stage the progress showed, in the order they ran
    assert list(result.stage_seconds)[:2] == ["opening the model", "calibrating"]
    assert {"fitting", "writing"} <= set(result.stage_seconds) and all(v >= 0 for v in result.stage_seconds.values())
    assert "(150 tokens)" in (tmp_path / "out" / "report.md").read_text()


def test_threads_follow_the_idle_cores_unless_asked(monkeypatch):
    from collab_convert import cpu

    monkeypatch.setattr(cpu, "REUSE", -1.0)  # measure every time
    monkeypatch.setattr(cpu, "idle_cores", lambda window=cpu.WINDOW: 1.1)  # a neighbour holds one of two cores
    assert cpu.choose_threads(None, default=2)[0] == 1
    monkeypatch.setattr(cpu, "idle_cores", lambda window=cpu.WINDOW: 0.2)  # never fewer than one
    assert cpu.choose_threads(None, default=2)[0] == 1
    monkeypatch.setattr(cpu, "idle_cores", lambda window=cpu.WINDOW: 7.9)  # never more than torch's default
    assert cpu.choose_threads(None, default=2)[0] == 2
    assert cpu.choose_threads(3, default=2) == (3, "asked for")


def test_a_run_restores_torchs_threads_and_reports_its_own(tiny_bert, tmp_path, monkeypatch):
    from collab_convert import CompressOptions, compress

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    before = torch.get_num_threads()
    result = compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out", threads=1, plots=False))
    assert torch.get_num_threads() == before
    assert result.threads == {"threads": 1, "why": "asked for", "huge_pages": False,
                              "huge_pages_kernel": kernel_huge_pages()}
    assert "CPU threads: 1 (asked for)" in (tmp_path / "out" / "report.md").read_text()


def test_analyze_runs_its_math_on_the_idle_cores_as_compress_does(tiny_bert, monkeypatch):
    """On a busy machine torch's default threads wait on each other: analyze took 72 s where compress took 15."""
    from collab_convert import cpu
    from collab_convert.analysis import analyze
    from collab_convert.forms.collaborative import analysis

    before, seen = torch.get_num_threads(), []
    monkeypatch.setattr(cpu, "REUSE", -1.0)
    monkeypatch.setattr(cpu, "idle_cores", lambda window=cpu.WINDOW: 1.1)
    spectra = analysis.spectra
    monkeypatch.setattr(analysis, "spectra",
                        lambda *args: seen.append(torch.get_num_threads()) or spectra(*args))
    analyze(str(tiny_bert), ranks=[8])
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before
