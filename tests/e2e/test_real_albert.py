"""The real ALBERT shipped (as a pickle-format pytorch_model.bin) in the PyPI package rxnmapper."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM

from collab_convert import CompressOptions, compress
from fixtures.models import folder_digest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def albert_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("rxnmapper")  # locate without importing (its imports need extras)
    if spec is None:
        pytest.fail("rxnmapper is not installed; .ci/run installs it with --no-deps")
    return Path(spec.origin).parent / "models" / "transformers" / "albert_heads_8_uspto_all_1310k"


def test_real_albert_compresses_exactly_at_full_rank(albert_path, tmp_path):
    before = folder_digest(albert_path)
    result = compress(str(albert_path), CompressOptions(rank=256, output=tmp_path / "full"))
    assert folder_digest(albert_path) == before
    # twelve layers share one attention module: decomposed once
    assert len(result.layers) == 1 and result.layers[0].num_heads == 8
    assert (tmp_path / "full" / "model.safetensors").is_file()
    assert not (tmp_path / "full" / "pytorch_model.bin").exists()

    original = AutoModelForMaskedLM.from_pretrained(albert_path).eval()
    collaborative = AutoModelForMaskedLM.from_pretrained(tmp_path / "full").eval()
    ids = torch.randint(5, 591, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 25:] = 0
    with torch.no_grad():
        a = original(input_ids=ids, attention_mask=mask).logits
        b = collaborative(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((a[real] - b[real]).abs().max() / a[real].abs().max()) <= 1e-4


def test_real_albert_at_half_rank(albert_path, tmp_path):
    result = compress(str(albert_path), CompressOptions(rank=128, output=tmp_path / "half"))
    assert result.parameters_after < result.parameters_before
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "half").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.randint(5, 591, (1, 20))).logits
    assert torch.isfinite(logits).all()
