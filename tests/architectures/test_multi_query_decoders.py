"""The multi-query form: rotary decoders as stock checkpoints of their own family with one key/value head. At the
full width they load in a Python that never imports collab_convert and match the original (logits, greedy
generation with the cache); at half the KV cache transformers' own cache holds exactly half the bytes; what the
stock shape cannot say is refused in one line."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from collab_convert import CompressOptions, compress
from collab_convert.cli import main
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny_tokenizer

STOCK = ["llama", "llama-mqa-llama3-rope", "qwen2", "qwen2-yarn-rope", "mistral", "phi3", "phi3-window"]
WRITTEN_AS = {"phi3": "llama", "phi3-window": "mistral"}  # a family whose own config cannot hold the shape

# Loads both checkpoints with transformers alone, in a fresh interpreter, and prints what the tests compare.
FRESH = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
original, stock = (AutoModelForCausalLM.from_pretrained(p).eval() for p in sys.argv[1:3])
ids = torch.randint(3, 90, (2, 120), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    a, b = original(ids).logits, stock(ids).logits
    caches = [m(ids, use_cache=True).past_key_values for m in (original, stock)]
prompt = ids[:1, :12]
same = torch.equal(original.generate(prompt, max_new_tokens=40, do_sample=False),
                   stock.generate(prompt, max_new_tokens=40, do_sample=False))
cache_bytes = [sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                   for l in cache.layers) for cache in caches]
print(json.dumps({"relative": float((a - b).abs().max() / a.abs().max()), "same_generation": same,
                  "cache_bytes": cache_bytes, "imported_us": "collab_convert" in sys.modules}))
"""


def case(name):
    return next(c for c in ROTARY_CASES if c.name == name)


def fresh_comparison(original, stock) -> dict:
    done = subprocess.run([sys.executable, "-c", FRESH, str(original), str(stock)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", STOCK)
def test_full_width_is_the_original_loaded_without_our_package(name, tmp_path):
    build_rotary(case(name), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(kv_cache=1.0, output=tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert result.form == "multi-query" and "quantization_config" not in config
    assert config["num_key_value_heads"] == 1 and config["rope_parameters"]["rope_type"] == "longrope"
    own = json.loads((tmp_path / "in" / "config.json").read_text())["model_type"]
    assert config["model_type"] == WRITTEN_AS.get(name, own)
    seen = fresh_comparison(tmp_path / "in", tmp_path / "out")
    assert not seen["imported_us"]
    assert seen["relative"] <= 1e-4 and seen["same_generation"]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_half_the_kv_cache_is_half_of_transformers_own_cache(name, tmp_path):
    build_rotary(case(name), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(kv_cache=0.5, output=tmp_path / "out"))
    seen = fresh_comparison(tmp_path / "in", tmp_path / "out")
    before, after = seen["cache_bytes"]
    assert after * 2 == before
    layer = result.layers[0]
    assert layer.rank == layer.kv_heads * layer.head_dim // 2 and sum(layer.frequency_ranks) == layer.rank // 2


@pytest.mark.parametrize("name", ["llama", "qwen2-yarn-rope"])
def test_engines_that_read_rope_theta_and_rope_scaling_turn_the_shared_key_at_the_same_frequencies(name, tmp_path):
    """transformers 4's names, as SGLang's model code and older readers take them (`rope_theta`, default 10000
    where missing; `rope_scaling` with longrope's per-pair factors), give the frequencies transformers 5 builds
    from rope_parameters."""
    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    build_rotary(case(name), tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(kv_cache=0.5, output=tmp_path / "out", weight_only=True))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    scaling, width = config["rope_scaling"], config["head_dim"]
    assert scaling["rope_type"] == "longrope" and "rope_theta" not in scaling
    # longrope as transformers 4 and SGLang's Phi3LongRoPEScaledRotaryEmbedding compute it (short = long here)
    exponents = torch.arange(0, width, 2, dtype=torch.int64).float() / width
    legacy = 1.0 / (torch.tensor(scaling["short_factor"]) * config["rope_theta"] ** exponents)
    assert scaling["short_factor"] == scaling["long_factor"]
    built = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path / "out"))
    assert built.attention_scaling == pytest.approx(scaling.get("attention_factor", 1.0))
    # cos/sin scaled as transformers 5 scales them: engines take short/long_mscale, or with neither derive 1 from a
    # length that is not extended
    if "short_mscale" in scaling:
        assert scaling["short_mscale"] == scaling["long_mscale"] == pytest.approx(built.attention_scaling)
    else:
        assert config["max_position_embeddings"] <= scaling["original_max_position_embeddings"]
        assert built.attention_scaling == 1.0
    assert torch.allclose(built.inv_freq, legacy, rtol=1e-6)


def test_the_key_profile_is_the_same_in_every_layer_and_the_config_says_it(tmp_path):
    build_rotary(case("llama"), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(kv_cache=0.5, output=tmp_path / "out"))
    profiles = {tuple(layer.frequency_ranks) for layer in result.layers}
    assert len(profiles) == 1
    record = json.loads((tmp_path / "out" / "config.json").read_text())["collab_convert"]
    assert tuple(record["key_frequency_ranks"]) == profiles.pop() and record["kv_cache_share"] == 0.5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # a stock checkpoint, the provenance kept
    assert model.config.head_dim == 16


def test_calibration_refines_keys_and_values_together(tmp_path):
    build_rotary(case("llama"), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")
    texts = tmp_path / "texts.txt"
    from fixtures import SENTENCES

    texts.write_text("\n".join(SENTENCES) + "\n")
    result = compress(str(tmp_path / "in"), CompressOptions(kv_cache=0.5, output=tmp_path / "out", calibration=texts,
                                                            calibration_samples=24, refine_steps=20))
    refined = [layer.refinement for layer in result.layers]
    assert all(r and r["objective"] == "attention output" and r["loss_after"] <= r["loss_before"] for r in refined)
    assert any(r["loss_after"] < r["loss_before"] for r in refined)
    assert result.fidelity["top1_agreement"] is not None


@pytest.mark.parametrize("name, flags, why", [
    ("llama-dynamic-rope", ("--kv-cache", "0.5"), "changes its frequencies with the input length"),
    ("qwen3", ("--kv-cache", "0.5"), "not offered for model_type 'qwen3'"),
    ("phi", ("--form", "multi-query", "--kv-cache", "0.5"), "not offered for model_type 'phi'"),
    ("llama", ("--kv-cache", "0.5", "--key-cache", "0.5"), "not --key-cache"),
    ("llama", ("--form", "multi-query", "--rank", "15"), "must be even"),
    # a budget below one RoPE pair per token was raised to one silently: more cache than asked for
    ("llama", ("--kv-cache", "1e-9"), "less than one rotary pair"),
])
def test_what_the_stock_shape_cannot_say_is_refused_in_one_line(name, flags, why, tmp_path, capsys):
    build_rotary(case(name), tmp_path / "in")
    capsys.readouterr()  # what building the model printed
    code = main(["compress", str(tmp_path / "in"), *flags, "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 3 and why in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_analyze_shows_widths_profiles_and_what_each_costs(tmp_path, capsys):
    build_rotary(case("llama"), tmp_path / "in")
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "in"), "--form", "multi-query", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["form"] == "multi-query" and [p["rank"] for p in result["predictions"]] == [32, 24, 16, 8]
    half = result["predictions"][2]
    assert half["key_cache_per_token"] == half["value_cache_per_token"] == 2 * 16  # two layers
    assert result["layers"][0]["candidates"][2]["frequency_ranks"] and result["layers"][0]["value_spectrum"]
    assert main(["analyze", str(tmp_path / "in"), "--form", "multi-query"]) == 0
    out = capsys.readouterr().out
    assert "Head widths" in out and "vLLM (FlashAttention/FlashInfer)" in out


def test_dry_run_names_the_width_and_the_engines_that_take_it(tmp_path, capsys):
    build_rotary(case("llama"), tmp_path / "in")
    capsys.readouterr()
    assert main(["compress", str(tmp_path / "in"), "--kv-cache", "0.5", "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "one key/value head of 16 per layer" in out and "vLLM FlashAttention yes" in out


def test_distillation_tunes_the_stock_projections(tmp_path):
    build_rotary(case("llama"), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")
    from fixtures import SENTENCES

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES) + "\n")
    result = compress(str(tmp_path / "in"), CompressOptions(kv_cache=0.5, output=tmp_path / "out", calibration=texts,
                                                            calibration_samples=24, refine_steps=5, distill_steps=20))
    assert result.distillation["kl_after"] <= result.distillation["kl_before"]
    assert result.distillation["parameters_tuned"] == sum(
        p.numel() for n, p in AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters()
        if ".self_attn." in n)
    assert torch.isfinite(torch.tensor(result.distillation["kl_after"]))


def test_the_value_latents_start_is_chosen_on_a_quarter_of_the_samples(tmp_path, monkeypatch):
    from collab_convert.decompose import shared_key_refinement

    build_rotary(case("llama"), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")
    texts = tmp_path / "texts.txt"
    from fixtures import SENTENCES

    texts.write_text("\n".join(SENTENCES) + "\n")
    scored, original = [], shared_key_refinement.attention_output_errors

    def counted(samples, *args, **kwargs):
        scored.append(len(samples))
        return original(samples, *args, **kwargs)

    monkeypatch.setattr(shared_key_refinement, "attention_output_errors", counted)
    result = compress(str(tmp_path / "in"), CompressOptions(kv_cache=0.5, output=tmp_path / "out", calibration=texts,
                                                            calibration_samples=24, refine_steps=5))
    kept = len(SENTENCES[:24])  # every calibration text is kept for refinement here
    assert scored == [-(-kept // 4)] * len(result.layers)  # every fourth, the first included
    assert {layer.refinement["value_start"] for layer in result.layers} <= {"per head", "summed over a group's heads"}
