"""A calibration batch holds the same share of the checkpoint whatever precision the pass runs in."""

from pathlib import Path

import torch
from safetensors.torch import save_file

from collab_convert import devices
from collab_convert.integration.batches import batch_tokens
from collab_convert.integration.model_runs import CalibrationRun, pass_batch_tokens, pass_share
from collab_convert.io.folders import stored_float_type


def _checkpoint(folder: Path, **tensors: torch.Tensor) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_the_stored_precision_is_what_most_of_the_numbers_are_stored_in(tmp_path):
    half = _checkpoint(tmp_path / "half", big=torch.zeros(64, 64, dtype=torch.bfloat16),
                       norm=torch.zeros(64, dtype=torch.float32), ids=torch.zeros(8, dtype=torch.int64))
    single = _checkpoint(tmp_path / "single", weight=torch.zeros(8, 8))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"weight": torch.zeros(2)}, pickled / "pytorch_model.bin")
    assert stored_float_type(half) == "BF16"
    assert stored_float_type(single) == "F32"
    assert stored_float_type(pickled) == "F32"  # unreadable without unpickling: sized as float32, the smaller batches


def test_a_half_precision_checkpoint_run_in_float32_takes_half_the_tokens_a_batch(tmp_path, monkeypatch):
    half = _checkpoint(tmp_path / "half", weight=torch.zeros(32, 32, dtype=torch.bfloat16))
    float16 = _checkpoint(tmp_path / "float16", weight=torch.zeros(32, 32, dtype=torch.float16))
    single = _checkpoint(tmp_path / "single", weight=torch.zeros(32, 32))
    run = CalibrationRun(width=576)
    monkeypatch.setattr(devices, "training_products", lambda device: torch.float32)  # no bfloat16 products
    assert pass_batch_tokens(half, run) == batch_tokens(576) // 2
    assert pass_batch_tokens(float16, run) == batch_tokens(576) // 2  # float16 runs in float32 on any CPU
    assert pass_batch_tokens(single, run) == batch_tokens(576)
    monkeypatch.setattr(devices, "training_products", lambda device: torch.bfloat16)  # the pass stays in bfloat16
    assert pass_batch_tokens(half, run) == batch_tokens(576)
    # verify runs both models in float32 on a CPU whatever it multiplies: its batches take the float32 share
    assert pass_share(half, "cpu", torch.float32) == 0.5


def test_held_out_batches_shrink_by_the_same_share_on_both_sides_of_the_fidelity_check():
    """The calibration pass runs the held-out texts through the original as the fidelity check batches them
    (model_runs.KeptStates): both take the share, so the batches stay equal, each within its share of tokens."""
    from types import SimpleNamespace

    from collab_convert.integration.batches import probe_batches
    from fixtures.models import CharacterTokenizer

    config = SimpleNamespace(hidden_size=1024, vocab_size=50257)
    texts = ["a text of some length " * 4] * 40
    whole, halved = (probe_batches(CharacterTokenizer(), texts, 96, config, share) for share in (1.0, 0.5))
    assert [len(group) for group in halved.chosen] == [len(group) for group in probe_batches(
        CharacterTokenizer(), texts, 96, config, 0.5).chosen]
    most = max(ids.numel() for ids, _ in whole.batches)
    assert max(ids.numel() for ids, _ in halved.batches) <= most // 2 < most
    assert sum(len(group) for group in halved.chosen) == len(texts)
