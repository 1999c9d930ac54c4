"""compress measures a checkpoint as transformers runs it: a bfloat16 checkpoint's blocks in bfloat16 where the
device multiplies it natively (half the float32 time), float32 elsewhere; the report names the precision."""

import pytest
import torch

from collab_convert import devices
from collab_convert.compression import compress
from collab_convert.options import CompressOptions
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny_tokenizer

TEXTS = [f"the {w} was on the {v} and it is {w} again" for w in "abcd" for v in "ijk"]


def bfloat16_llama(folder, seed: int = 0):
    model = build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), folder)
    with torch.no_grad():  # another seed: a model far from the first, so every figure is far from perfect
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed)) * 0.1 * seed)
    model.to(torch.bfloat16).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def measured(model, result, monkeypatch, native: bool) -> tuple[dict, set]:
    """(compress's figures for `result` from the original `model`, the dtypes each model's first block computed
    in), the device said to multiply bfloat16 natively or not."""
    from collab_convert.architectures.source import open_model
    from collab_convert.integration import fidelity
    from collab_convert.predict import FidelityEstimator
    from collab_convert.stages import ProbeTexts

    seen, compare = set(), fidelity.compare_language_models

    def recording(*models, **kwargs):
        for which in models[:2]:
            which.model.layers[0].register_forward_hook(lambda module, args, output: seen.add(
                (output[0] if isinstance(output, tuple) else output).dtype))
        return compare(*models, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(fidelity, "compare_language_models", recording)
        patched.setattr(devices, "training_products", lambda device: torch.bfloat16 if native else torch.float32)
        source = open_model(str(model))
        try:
            estimator = FidelityEstimator(source, CompressOptions(output=result), ProbeTexts(TEXTS, "test lines"))
            figures = estimator.measured(result)
        finally:
            source.close()
    return figures, seen


def test_a_bfloat16_checkpoint_is_measured_in_bfloat16_where_the_device_multiplies_it(tmp_path, monkeypatch):
    """The original and a model far from it (another seed), both stored in bfloat16."""
    folder, other = bfloat16_llama(tmp_path / "in"), bfloat16_llama(tmp_path / "other", seed=1)
    native, native_dtypes = measured(folder, other, monkeypatch, native=True)
    emulated, emulated_dtypes = measured(folder, other, monkeypatch, native=False)
    assert native_dtypes == {torch.bfloat16} and native["computed_in"] == "bfloat16"
    assert emulated_dtypes == {torch.float32} and emulated["computed_in"] == "float32"
    # the same two checkpoints: the figures differ by bfloat16's rounding only
    assert emulated["kl_mean"] > 1e-2
    assert native["kl_mean"] == pytest.approx(emulated["kl_mean"], rel=0.01)  # measured: 2.5e-4
    assert native["cosine_mean"] == pytest.approx(emulated["cosine_mean"], abs=1e-3)


def test_a_result_written_in_another_precision_is_measured_in_it_and_says_both(tmp_path, monkeypatch):
    folder = bfloat16_llama(tmp_path / "in")
    compress(str(folder), CompressOptions(key_cache=0.5, output=tmp_path / "out", refine_steps=5, plots=False,
                                          dtype="f32"))
    figures, dtypes = measured(folder, tmp_path / "out", monkeypatch, native=True)
    assert dtypes == {torch.bfloat16, torch.float32}
    assert figures["computed_in"] == "float32 (the original in bfloat16)"
