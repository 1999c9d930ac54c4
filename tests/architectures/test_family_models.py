"""Every supported family: a tiny model from its config compresses exactly at full rank, runs at half rank,
and decoders generate identically at full rank."""

import pytest
import torch

import collab_convert
from collab_convert import CompressOptions, compress
from fixtures.models import FAMILY_CASES, FamilyCase, build_family


CASES = FAMILY_CASES


def inputs(case: FamilyCase):
    g = torch.Generator().manual_seed(1)
    if case.kind == "vision":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(3, 60, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    if case.kind != "causal":
        mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if case.kind == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(3, 60, (2, 5), generator=g)
    return batch


def first_output(model, batch):
    with torch.no_grad():
        out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def relative_max_error(a, b):
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_full_rank_is_exact_and_half_rank_runs(case, tmp_path):
    original = build_family(case, tmp_path / "model")
    batch = inputs(case)
    full_rank = case.heads * case.head_dim
    result = compress(str(tmp_path / "model"), CompressOptions(rank=full_rank, output=tmp_path / "full"))
    assert result.layers, "no attention layer found"
    assert all(layer.relative_error < 1e-6 for layer in result.layers)
    collaborative = case.auto_class().from_pretrained(tmp_path / "full").eval()
    assert any(getattr(m, "is_collaborative", False) for m in collaborative.modules())
    assert relative_max_error(first_output(original, batch), first_output(collaborative, batch)) <= 1e-4

    compress(str(tmp_path / "model"), CompressOptions(rank=case.head_dim, output=tmp_path / "half"))
    reduced = collab_convert.load_model(tmp_path / "half").eval()
    assert torch.isfinite(first_output(reduced, batch)).all()


GENERATORS = [c for c in CASES if c.kind in ("causal", "seq2seq")]


@pytest.mark.parametrize("case", GENERATORS, ids=lambda c: c.name)
def test_greedy_generation_is_identical_at_full_rank(case, tmp_path):
    original = build_family(case, tmp_path / "model")
    compress(str(tmp_path / "model"), CompressOptions(rank=case.heads * case.head_dim, output=tmp_path / "full"))
    collaborative = case.auto_class().from_pretrained(tmp_path / "full").eval()
    prompt = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12)
    a = original.generate(prompt, **settings)
    b = collaborative.generate(prompt, **settings)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["opt", "gpt2", "gpt_bigcode"])
def test_decoder_cache_holds_exactly_the_shared_key(name, tmp_path):
    case = next(c for c in CASES if c.name == name)
    build_family(case, tmp_path / "model")
    rank = 12
    compress(str(tmp_path / "model"), CompressOptions(rank=rank, output=tmp_path / "out"))
    model = case.auto_class().from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(3, 60, (1, 7)), use_cache=True).past_key_values
    keys = cache.layers[0].keys  # (batch, 1, tokens, R + N_h): one packed shared key per token
    # the shared key (R) and one content-bias score per head, nothing padded
    assert keys.shape == (1, 1, 7, rank + case.heads)
    assert keys.shape[-1] < case.heads * case.head_dim


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_encoder_decoder_caches_hold_exactly_the_shared_keys(name, tmp_path):
    # The decoder's self-attention caches its packed shared key token by token, encoder-decoder attention
    # the encoder's once; nothing padded to whole heads (13 + N_h and 13 are no multiples of the head size
    # here). BART has query biases, so each key also carries one content-bias number per head (R + N_h); T5 has
    # none, so its content bias would be all zeros and the cache holds the shared key alone (R).
    case = next(c for c in CASES if c.name == name)
    build_family(case, tmp_path / "model")
    rank = 13
    compress(str(tmp_path / "model"), CompressOptions(rank=rank, output=tmp_path / "out"))
    model = case.auto_class().from_pretrained(tmp_path / "out").eval()
    heads = getattr(model.config, "decoder_attention_heads", None) or model.config.num_heads
    width = rank + heads if name == "bart" else rank
    assert width % case.head_dim
    source, target = torch.randint(3, 60, (1, 9)), torch.randint(3, 60, (1, 5))
    with torch.no_grad():
        cache = model(input_ids=source, decoder_input_ids=target, use_cache=True).past_key_values
    assert cache.self_attention_cache.layers[0].keys.shape == (1, 1, 5, width)
    assert cache.cross_attention_cache.layers[0].keys.shape == (1, 1, 9, width)


def test_a_layer_without_query_bias_stores_no_content_bias_unless_calibrated(tmp_path, monkeypatch):
    # T5 has no query bias: weight-only, its content bias would be all zeros, so the checkpoint leaves it out
    # and says so; calibration adds a content bias (the mean of the query-side inputs), which is then kept.
    import json

    from safetensors import safe_open

    from collab_convert.integration import model_runs
    from fixtures import SENTENCES
    from fixtures.models import CharacterTokenizer

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    monkeypatch.setattr("collab_convert.predict.can_measure", lambda source: False)  # no real tokenizer here
    case = next(c for c in CASES if c.name == "t5")
    build_family(case, tmp_path / "model")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES[:12]) + "\n")
    for calibrated in (False, True):
        out = tmp_path / f"out-{calibrated}"
        compress(str(tmp_path / "model"), CompressOptions(rank=8, output=out, calibration=texts if calibrated else None,
                                                          refine_steps=0, calibration_max_length=24))
        layers = json.loads((out / "config.json").read_text())["quantization_config"]["layers"]
        with safe_open(out / "model.safetensors", "pt") as weights:
            stored = [name for name in weights.keys() if name.endswith("content_bias")]
        if calibrated:
            assert len(stored) == len(layers) and all("content_bias" not in entry for entry in layers.values())
        else:
            assert stored == [] and all(entry["content_bias"] is False for entry in layers.values())
        assert case.auto_class().from_pretrained(out) is not None


def test_multi_query_layout_is_recorded(tmp_path):
    # GPTBigCode (multi-query): four query heads read one key/value head, T[i] = W_Q^(i)^T W_K. The checkpoint
    # records both head counts so the loader rebuilds the module with one value head.
    import json

    case = next(c for c in CASES if c.name == "gpt_bigcode")
    build_family(case, tmp_path / "model")
    compress(str(tmp_path / "model"), CompressOptions(rank=16, output=tmp_path / "out"))
    layers = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["layers"]
    assert all(spec["num_heads"] == 4 and spec["kv_heads"] == 1 for spec in layers.values())


def test_albert_shared_attention_is_decomposed_once(tmp_path):
    case = next(c for c in CASES if c.name == "albert")
    build_family(case, tmp_path / "model")
    result = compress(str(tmp_path / "model"), CompressOptions(rank=16, output=tmp_path / "out"))
    assert [layer.name for layer in result.layers] == ["encoder.albert_layer_groups.0.albert_layers.0.attention"]
