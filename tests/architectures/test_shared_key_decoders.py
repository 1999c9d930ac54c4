"""Decoders with absolute or relative positions (GPT-2, OPT, GPTBigCode; BART and T5, encoder-decoders) in the
shared-key form: each head keeps its query, one shared key replaces the key heads. At the full key cache the
logits and greedy generation are the original's; at half of it the KV caches really hold the shared key alone,
with no content-bias column and no padding; the form is asked for with --form shared-key (or --key-cache alone)
and refused, in one line, where it is not offered."""

import json

import pytest
import torch

from collab_convert import CompressOptions, compress
from collab_convert.cli import main
from collab_convert.format import original_config
from collab_convert.integration.loading import load_model
from fixtures.models import build_family, family_case, save_tiny_tokenizer

DECODERS = ["gpt2", "opt", "gpt_bigcode"]


def prompt(length=24, batch=2):
    return torch.randint(3, 60, (batch, length), generator=torch.Generator().manual_seed(1))


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def run(capsys, *arguments):
    code = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", DECODERS)
def test_full_key_cache_is_exact_and_generates_identically(name, tmp_path):
    original = build_family(family_case(name), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(form="shared-key", key_cache=1.0, output=tmp_path / "out"))
    assert (result.family, result.form) == (name, "shared-key")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == original.config.architectures
    assert original_config(config)["model_type"] == original.config.model_type != config["model_type"]
    shared = load_model(tmp_path / "out").eval()
    assert type(shared).__name__ == type(original).__name__

    ids = prompt()
    assert relative(logits(shared, ids), logits(original, ids)) <= 1e-4
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: the model's own mask reaches the shared-key attention
    expected = logits(original, ids, attention_mask=mask)
    assert relative(logits(shared, ids, attention_mask=mask)[1, 5:], expected[1, 5:]) <= 1e-4

    start = ids[:1, :6]
    generated = original.generate(start, max_new_tokens=20, do_sample=False)
    assert torch.equal(shared.generate(start, max_new_tokens=20, do_sample=False), generated)


@pytest.mark.parametrize("name", DECODERS)
def test_half_key_cache_caches_exactly_the_shared_key(name, tmp_path):
    original = build_family(family_case(name), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(key_cache=0.5, output=tmp_path / "out"))  # form: auto
    assert (result.family, result.form) == (name, "shared-key")
    shared = load_model(tmp_path / "out").eval()
    ids = prompt(batch=1)
    with torch.no_grad():
        before = original(ids, use_cache=True).past_key_values.layers
        after = shared(ids, use_cache=True).past_key_values.layers
    full = before[0].keys.shape[1] * before[0].keys.shape[-1]  # key heads x head_dim
    for old, new, layer in zip(before, after, result.layers, strict=True):
        assert new.keys.shape == (1, 1, ids.shape[1], layer.rank)  # R numbers per token: no bias column, no padding
        assert new.values.shape == old.values.shape
    assert sum(layer.rank for layer in result.layers) == round(0.5 * full) * len(result.layers)
    # Close to the original still (these tiny random models keep most of their score energy in few directions).
    assert relative(logits(shared, ids), logits(original, ids)) < 0.05


SEQ2SEQ = ["bart", "t5"]


def seq2seq_batch():
    g = torch.Generator().manual_seed(1)
    ids, decoder_ids = torch.randint(3, 60, (2, 12), generator=g), torch.randint(3, 60, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded source: the encoder's mask reaches encoder and encoder-decoder attention
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids}


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoders_are_exact_at_the_full_key_cache_and_cache_the_shared_key(name, tmp_path):
    original = build_family(family_case(name), tmp_path / "in")
    for share in (1.0, 0.5):
        out = tmp_path / f"out-{share}"
        result = compress(str(tmp_path / "in"), CompressOptions(form="shared-key", key_cache=share, output=out))
        assert (result.family, result.form) == (name, "shared-key")
        shared = load_model(out).eval()
        batch = seq2seq_batch()
        with torch.no_grad():
            expected, found = original(**batch).logits, shared(**batch).logits
            cache = shared(**{k: v[:1] for k, v in batch.items()}, use_cache=True).past_key_values
        ranks = {layer.name: layer.rank for layer in result.layers}
        decoder_self = sorted(r for n, r in ranks.items() if "decoder" in n and ("self_attn" in n or "SelfAttention" in n))
        decoder_cross = sorted(r for n, r in ranks.items() if "encoder_attn" in n or "EncDecAttention" in n)
        assert sorted(layer.keys.shape[-1] for layer in cache.self_attention_cache.layers) == decoder_self
        assert sorted(layer.keys.shape[-1] for layer in cache.cross_attention_cache.layers) == decoder_cross
        assert all(layer.keys.shape[1] == 1 for layer in cache.self_attention_cache.layers)  # one shared key
        if share == 1.0:
            assert relative(found, expected) <= 1e-4
            start = batch["input_ids"][:1]
            assert torch.equal(shared.generate(start, max_new_tokens=10, do_sample=False),
                               original.generate(start, max_new_tokens=10, do_sample=False))


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_the_key_cache_budget_of_an_encoder_decoder_is_spent_on_the_keys_it_caches(name, tmp_path):
    # the encoder's self-attention runs once over the input and caches nothing: --key-cache 0.5 halves what the
    # decoder caches (its self-attention and its reads of the encoder), and the encoder keeps the same width on
    # average among its own layers
    build_family(family_case(name), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(form="shared-key", key_cache=0.5, output=tmp_path / "out"))
    cached = [layer for layer in result.layers if "decoder" in layer.name]
    encoder = [layer for layer in result.layers if "decoder" not in layer.name]
    assert cached and encoder
    full = cached[0].cost_before["key_cache_per_token"]
    assert sum(layer.rank for layer in cached) == round(0.5 * full) * len(cached)
    assert sum(layer.rank for layer in encoder) == round(0.5 * full) * len(encoder)
    assert all(layer.cost_before["key_cache_per_token"] == layer.cost_after["key_cache_per_token"] == 0
               for layer in encoder)
    assert sum(layer.cost_after["key_cache_per_token"] for layer in result.layers) == sum(
        layer.rank for layer in cached)


@pytest.mark.parametrize("form", ["shared-key", "collaborative"])
def test_analyze_counts_the_key_cache_of_an_encoder_decoder_on_the_decoder_side(form, tmp_path, capsys):
    build_family(family_case("bart"), tmp_path / "in")
    code, out, _ = run(capsys, "analyze", tmp_path / "in", "--form", form, "--json")
    assert code == 0
    result = json.loads(out)
    decoder = [layer for layer in result["layers"] if "decoder" in layer["name"]]
    assert all(layer["original"]["key_cache_per_token"] == 0 for layer in result["layers"] if layer not in decoder)
    assert result["predictions"][0]["key_cache_before"] == sum(
        layer["original"]["key_cache_per_token"] for layer in decoder) > 0


def test_only_a_decoders_attention_caches_keys():
    from collab_convert.architectures.families import FAMILIES

    by_name = {family.name: family for family in FAMILIES}
    bart_encoder, bart_decoder, bart_cross = by_name["bart"].sites
    assert not by_name["bart"].caches_keys(bart_encoder)
    assert by_name["bart"].caches_keys(bart_decoder) and by_name["bart"].caches_keys(bart_cross)
    assert not by_name["bert"].caches_keys(by_name["bert"].sites[0])  # an encoder runs once over its input
    assert by_name["llama"].caches_keys(by_name["llama"].sites[0])


@pytest.mark.parametrize("form, name", [("shared-key", "t5"), ("shared-key", "bart"), ("collaborative", "t5")])
def test_calibrated_encoder_decoders_refine_every_kind_of_attention(form, name, tmp_path):
    # Encoder (bidirectional), decoder (causal) and encoder-decoder attention, T5's position bias added; the
    # fidelity of an encoder-decoder is measured with the text on both sides, as calibration runs it.
    build_family(family_case(name), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"the cat was on the mat and it is with her at {i} of the {i % 7}" for i in range(40)))
    budget = {"key_cache": 0.4} if form == "shared-key" else {"rank": 16}
    result = compress(str(tmp_path / "in"), CompressOptions(form=form, calibration=text, refine_steps=20,
                                                             output=tmp_path / "out", **budget))
    kinds = {"cross" if ("encoder_attn" in layer.name or "EncDecAttention" in layer.name)
             else "decoder" if "decoder" in layer.name else "encoder" for layer in result.layers}
    assert kinds == {"encoder", "decoder", "cross"}
    for layer in result.layers:
        # never worse on the held-out sequences in what it is chosen by: the shared key's attention output (its
        # attention KL, only reported, may move either way), the collaborative form's attention KL
        refinement = layer.refinement
        before, after = ((refinement["loss_before"], refinement["loss_after"]) if form == "shared-key"
                         else (refinement["kl_before"], refinement["kl_after"]))
        assert refinement["steps"] > 0 and after <= before + 1e-9
    assert result.fidelity["cosine_mean"] > 0.99


def test_calibrated_shared_key_refines_and_reports_it(tmp_path, monkeypatch):
    from collab_convert.integration import fidelity

    by_block, bodies = [], fidelity.bodies_by_block
    monkeypatch.setattr(fidelity, "bodies_by_block", lambda model, *rest: by_block.append(1) or bodies(model, *rest))
    kept, finished = [], fidelity.finished_bodies
    monkeypatch.setattr(fidelity, "finished_bodies", lambda model, *rest: kept.append(1) or finished(model, *rest))
    build_family(family_case("gpt2"), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"the cat was on the mat and it is with her at {i} of the {i % 7}" for i in range(40)))
    options = CompressOptions(form="shared-key", key_cache=0.25, calibration=text, refine_steps=10,
                              output=tmp_path / "out")
    result = compress(str(tmp_path / "in"), options)
    assert result.calibration["tokens"] > 0 and "per frequency" not in result.calibration["objective"]
    for layer in result.layers:
        assert layer.refinement["steps"] > 0
        assert layer.refinement["loss_after"] <= layer.refinement["loss_before"]
    assert result.fidelity["cosine_mean"] > 0.9
    # the fidelity check ran the result's body a block at a time, and the original's blocks not at all: their
    # output on the held-out lines was kept by the calibration pass
    assert len(by_block) == 1 and len(kept) == 1


def test_analyze_in_the_shared_key_form_costs_key_cache_budgets(tmp_path, capsys):
    build_family(family_case("opt"), tmp_path / "in")
    code, out, _ = run(capsys, "analyze", tmp_path / "in", "--form", "shared-key", "--json")
    assert code == 0
    result = json.loads(out)
    assert (result["family"], result["form"]) == ("opt", "shared-key")
    assert all(layer["frequency_spectra"] == [] for layer in result["layers"])  # nothing rotates
    caches = [p["key_cache_per_token"] for p in result["predictions"]]
    assert caches[0] == 2 * 32 and caches == sorted(caches, reverse=True)
    errors = [p["mean_relative_error"] for p in result["predictions"]]
    assert errors[0] == pytest.approx(0, abs=1e-6) and errors == sorted(errors)
    code, out, _ = run(capsys, "analyze", tmp_path / "in", "--form", "shared-key", "-q")
    assert code == 0 and "absolute positions" in out and "strongest frequencies" not in out
    # in its default (CP) form, analyze says the other form exists and how to look at it
    code, out, _ = run(capsys, "analyze", tmp_path / "in", "-q")
    assert code == 0 and "--form shared-key" in out
    code, out, _ = run(capsys, "analyze", tmp_path / "in", "--json")
    assert json.loads(out)["forms"] == ["collaborative", "shared-key"]


def test_the_default_form_of_an_absolute_decoder_stays_collaborative(tmp_path):
    build_family(family_case("gpt2"), tmp_path / "in")
    result = compress(str(tmp_path / "in"), CompressOptions(rank=16, output=tmp_path / "out"))
    assert (result.family, result.form) == ("gpt2", "collaborative") and result.layers[0].per_head_truncation_error >= 0


@pytest.mark.parametrize("family, arguments, fragment", [
    ("bert", ("--form", "shared-key", "--key-cache", "0.5"), "not offered for model_type 'bert'"),
    ("bert", ("--key-cache", "0.5"), "not offered for model_type 'bert'"),
    ("gpt2", ("--form", "collaborative", "--key-cache", "0.5"), "--key-cache"),
    ("gpt2", ("--key-cache", "0.001"), "at least 1 number per token, got 0"),
    ("opt-post-norm", ("--form", "shared-key", "--key-cache", "0.5"), "do_layer_norm_before"),
])
def test_a_form_that_is_not_offered_is_refused_in_one_line(family, arguments, fragment, tmp_path, capsys):
    build_family(family_case(family.removesuffix("-post-norm")), tmp_path / "in")
    if family.endswith("-post-norm"):  # OPT-350m's layout: the norm follows the attention
        config = json.loads((tmp_path / "in" / "config.json").read_text())
        (tmp_path / "in" / "config.json").write_text(json.dumps({**config, "do_layer_norm_before": False}))
    code, _, err = run(capsys, "compress", tmp_path / "in", *arguments, "-o", tmp_path / "out")
    assert code != 0 and err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_rotary_decoder_refuses_the_collaborative_form(tmp_path, capsys):
    from fixtures.models import ROTARY_CASES, build_rotary

    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), tmp_path / "in")
    code, _, err = run(capsys, "compress", tmp_path / "in", "--form", "collaborative", "--rank", "8", "-o",
                       tmp_path / "out")
    assert code != 0 and "shared-key form only" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_plan_and_the_report_count_the_query_key_tensors_written(tmp_path):
    from safetensors import safe_open

    from collab_convert.compression import plan

    build_family(family_case("gpt2"), tmp_path / "in")
    options = CompressOptions(key_cache=0.5, output=tmp_path / "out")
    planned = plan(str(tmp_path / "in"), options)
    result = compress(str(tmp_path / "in"), options)
    query_key = (".query_projection.", ".shared_key.", ".query_core", ".pass_core")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as weights:
        written = sum(weights.get_tensor(name).numel() for name in weights.keys()
                      if any(part in name for part in query_key))
    assert planned.parameters_after == result.parameters_after == written


def test_a_layers_refinement_holds_neither_its_statistics_nor_its_float64_fit_nor_its_projections(tmp_path,
                                                                                                    monkeypatch):
    """While shared-key layers refine, what only their start needed is gone: the calibration records' key
    statistics, the float64 fits (the refinement gets float32 factors) and the layers' projections, which are read
    only once the refinement is done. Each sat under the refining stage's peak (benchmarks/memory.py). The layers
    (two here, as asked) refine in the same steps."""
    import gc

    from collab_convert.architectures.shared_key import SharedKeyProjections
    from collab_convert.decompose import shared_key_refinement
    from collab_convert.decompose.shared_key import KeyStatistics

    events, refine = [], shared_key_refinement.refine_shared_keys

    def watched_refine(layers, *args, **kwargs):
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, KeyStatistics)]
        shapes = {layer.factors.key_mixing.shape for layer in layers}
        fits = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float64
                and o.shape in shapes]
        events.append(("refine", len(layers), len(alive), len(fits),
                       {layer.factors.key_mixing.dtype for layer in layers}))
        return refine(layers, *args, **kwargs)

    monkeypatch.setattr(shared_key_refinement, "refine_shared_keys", watched_refine)
    read = SharedKeyProjections.read

    def watched_read(self, reader, layer):
        events.append(("read", layer.prefix))
        return read(self, reader, layer)

    monkeypatch.setattr(SharedKeyProjections, "read", watched_read)
    build_family(family_case("gpt2"), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"the cat was on the mat and it is with her at {i} of the {i % 7}" for i in range(40)))
    result = compress(str(tmp_path / "in"), CompressOptions(form="shared-key", key_cache=0.25, calibration=text,
                                                            refine_steps=5, refine_together=2,
                                                            output=tmp_path / "out"))
    assert len(result.layers) == 2
    # one refinement for both layers, holding no statistics and no float64 fit; both read after it
    assert events == [("refine", 2, 0, 0, {torch.float32})] + [("read", layer.name) for layer in result.layers]
    assert all(layer.refinement["steps"] >= 1 and layer.refinement["layers_together"] == 2 for layer in result.layers)
