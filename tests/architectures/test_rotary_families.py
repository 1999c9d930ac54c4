"""Every rotary family: a tiny decoder from its config keeps its logits and its greedy generation (with the KV
cache) at the full key budget, and at half the budget caches half the keys, really, in the KV cache."""

import json

import pytest
import torch

from collab_convert import CompressOptions, compress
from collab_convert.integration.loading import load_model
from fixtures.models import ROTARY_CASES, build_rotary


def prompt(length=24, batch=2):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(1))


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def cached(model, ids) -> list[tuple[torch.Size, torch.Size]]:
    """(key shape, value shape) of every layer's KV cache after one forward pass with the cache on."""
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys.shape, layer.values.shape) for layer in cache.layers]


@pytest.mark.parametrize("case", ROTARY_CASES, ids=lambda c: c.name)
def test_full_key_budget_is_exact_and_generates_identically(case, tmp_path):
    original = build_rotary(case, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(key_cache=1.0, output=tmp_path / "out"))
    shared = load_model(tmp_path / "out").eval()
    assert type(shared).__name__ == type(original).__name__

    ids = prompt()
    expected = logits(original, ids)
    assert float((logits(shared, ids) - expected).abs().max() / expected.abs().max()) <= 1e-4

    # A padded batch: the model's own mask reaches the shared-key attention.
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    expected = logits(original, ids, attention_mask=mask)
    assert float((logits(shared, ids, attention_mask=mask) - expected)[1, 5:].abs().max()) <= 1e-4 * float(expected.abs().max())

    start = ids[:1, :6]
    generated = original.generate(start, max_new_tokens=24, do_sample=False)
    assert torch.equal(shared.generate(start, max_new_tokens=24, do_sample=False), generated)


@pytest.mark.parametrize("case", [c for c in ROTARY_CASES if c.name in ("llama", "gemma2", "phi", "qwen3")],
                         ids=lambda c: c.name)
def test_half_key_budget_halves_the_cached_keys(case, tmp_path):
    original = build_rotary(case, tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(key_cache=0.5, output=tmp_path / "out"))
    shared = load_model(tmp_path / "out").eval()
    ids = prompt(batch=1)
    before, after = cached(original, ids), cached(shared, ids)
    for (keys, values), (shared_keys, shared_values), layer in zip(before, after, result.layers, strict=True):
        assert shared_values == values  # values untouched
        assert shared_keys[-2] == keys[-2]  # as many tokens (a sliding-window layer keeps its window)
        assert shared_keys[1] * shared_keys[-1] == layer.rank  # one shared key of `rank` numbers per token
    widths = [layer.rank for layer in result.layers]
    assert sum(widths) <= sum(keys[1] * keys[-1] for keys, _ in before) // 2  # the budget is a ceiling
    # Generation with the cache equals generation without it (each step recomputed from scratch).
    start = ids[:, :6]
    with_cache = shared.generate(start, max_new_tokens=12, do_sample=False)
    uncached = shared.generate(start, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, uncached)


def test_the_checkpoint_records_the_form_and_how_the_budget_splits(tmp_path):
    case = next(c for c in ROTARY_CASES if c.name == "llama")
    build_rotary(case, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(rank=16, output=tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # a model_type of its own, so that transformers alone refuses it; the original's kept in the record
    assert config["model_type"] == "collaborative_llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"]["original_model_type"] == "llama"
    layers = config["quantization_config"]["layers"]
    assert len(layers) == 2
    for entry in layers.values():
        assert entry["form"] == "shared-key"
        assert entry["kv_heads"] == 2 and entry["num_heads"] == 4 and entry["rotary_dim"] == 16
        assert entry["rank"] == 2 * sum(entry["frequency_ranks"]) + entry["pass_rank"]
        assert len(entry["frequency_ranks"]) == 8 and max(entry["frequency_ranks"]) <= 2
    assert sum(entry["rank"] for entry in layers.values()) <= 2 * 16
    report = (tmp_path / "out" / "report.md").read_text()
    assert "per frequency" in report and "shares one rotary key" in report


def test_calibration_refines_the_shared_key_against_the_original_attention(tmp_path):
    case = next(c for c in ROTARY_CASES if c.name == "qwen2")
    build_rotary(case, tmp_path / "in")
    from fixtures.models import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path / "in")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the {w} was on the {v} and it is {w}" for w in "abcdefgh" for v in "ijkl") + "\n")
    result = compress(str(tmp_path / "in"), CompressOptions(key_cache=0.5, output=tmp_path / "out",
                                                            calibration=texts, calibration_samples=24,
                                                            refine_steps=40))
    assert result.calibration is not None and "Adam" in result.calibration["refinement"]
    for layer in result.layers:
        # The objective (the attention output's error, held out) never gets worse; the KL is reported beside it.
        assert layer.refinement["objective"] == "attention output"
        assert layer.refinement["loss_after"] <= layer.refinement["loss_before"]
        assert {"kl_before", "kl_after", "steps"} <= set(layer.refinement)
        assert layer.logit_error is not None
    assert load_model(tmp_path / "out") is not None


def test_the_kept_query_basis_follows_a_changed_core(tmp_path):
    # Inference keeps each layer's query-basis matrix between calls; a core changed in place (fine-tuning,
    # a reloaded state dict) must be seen by the next forward, under no_grad and inference_mode alike.
    from collab_convert.decompose.rotary_ops import query_basis_matrix

    case = next(c for c in ROTARY_CASES if c.name == "llama")
    build_rotary(case, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(key_cache=0.5, output=tmp_path / "out"))
    model = load_model(tmp_path / "out").eval()
    ids = prompt()
    before = logits(model, ids)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "query_core"):
                module.query_core.mul_(-1.5)
    with torch.inference_mode():
        after = model(ids).logits
    assert not torch.allclose(before, after, atol=1e-3)
    module = next(m for m in model.modules() if hasattr(m, "query_core"))
    core = module.query_core.detach()
    no_pass = core.new_zeros(core.shape[0], 0, 0)  # full rotary: no pass-through dimensions
    expected = query_basis_matrix(core, no_pass, module.slot_frequencies(core.device), module.rotary_dim,
                                  module.rotary_dim)
    assert torch.equal(module.query_basis(), expected)
