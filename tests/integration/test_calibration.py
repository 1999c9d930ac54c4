"""Fitting to real inputs: calibrated fits, refinement against the original attention, automatic ranks, verify."""

import json

import pytest
import torch
from typer.testing import CliRunner

from collab_convert import CompressOptions, compress, load_model
from collab_convert.cli import app, main
from collab_convert.decompose.als import fit_collaborative
from collab_convert.decompose.calibrated import WHITENING_POWER, InputMetric, fit_calibrated
from collab_convert.decompose.products import HeadProducts, content_bias
from collab_convert.decompose.refinement import refine_attention


def anisotropic_inputs(d_in=24, count=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, d_in, dtype=torch.float64)  # a few directions carry most of the signal
    mixing = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))[0]
    return (torch.randn(count, d_in, generator=g, dtype=torch.float64) * scales) @ mixing.T + 0.7


def metric(samples, centre=True):
    mean = samples.mean(0)
    centred = samples - mean if centre else samples
    return InputMetric(centred.T @ centred / samples.shape[0], mean)


def logit_error(products, factors, correction, x, y):
    exact = torch.einsum("nq,hdq,hdk,mk->hnm", x, products.query_heads, products.key_heads, y)
    approx = torch.einsum("nq,qr,hr,kr,mk->hnm", x, factors.shared_query, factors.mixing, factors.shared_key, y)
    if correction is not None:
        approx = approx + (y @ correction.T).T[:, None, :]
    difference = exact - approx
    difference = difference - difference.mean(-1, keepdim=True)  # what a softmax over keys can see
    return float(difference.norm() / (exact - exact.mean(-1, keepdim=True)).norm())


def test_calibrated_fit_beats_weight_only_on_the_logits_of_real_inputs():
    g = torch.Generator().manual_seed(1)
    products = HeadProducts.from_projections(torch.randn(24, 24, generator=g), torch.randn(24, 24, generator=g), 4)
    x, y = anisotropic_inputs(seed=2), anisotropic_inputs(seed=3)
    plain = fit_collaborative(products, 6)
    calibrated, correction = fit_calibrated(products, 6, metric(x), metric(y))
    assert logit_error(products, calibrated.factors, correction, x, y) < 0.7 * logit_error(
        products, plain.factors, None, x, y
    )


HEAD_WEIGHTS = torch.tensor([2.0, 0.5, 1.0, 0.5], dtype=torch.float64)


def weighted_fit(seed):
    """(products, query inputs, key inputs, the calibrated rank-6 fit with the heads weighed) of 4 random heads."""
    g = torch.Generator().manual_seed(seed)
    products = HeadProducts.from_projections(torch.randn(24, 24, generator=g), torch.randn(24, 24, generator=g), 4)
    x, y = anisotropic_inputs(seed=seed + 1), anisotropic_inputs(seed=seed + 2)
    fit, _ = fit_calibrated(products, 6, metric(x), metric(y), weights=HEAD_WEIGHTS)
    return products, x, y, fit


def ridged_power(covariance, exponent):
    """The ridged covariance to a power, as the fit takes it."""
    c = covariance + 1e-3 * covariance.diagonal().mean() * torch.eye(len(covariance), dtype=torch.float64)
    values, vectors = torch.linalg.eigh(c)
    return (vectors * values.pow(exponent)) @ vectors.T


def test_a_calibrated_fit_carries_its_factors_back_through_the_head_rows_as_the_inverse_whitening_would():
    # the ALS's factors are combinations of the whitened heads' rows; the same combinations of the raw rows must be
    # C^(-p/2) times them (with the heads weighed too), so no inverse is held through the fit
    products, x, y, fit = weighted_fit(6)
    # the ALS ran (so the rows carried the factors back), and its row weights, which combine the whitened rows,
    # are not handed on beside factors they no longer give
    assert fit.iterations > 0 and fit.row_weights is None
    scale = HEAD_WEIGHTS.sqrt()[:, None, None]
    half = WHITENING_POWER / 2  # the fit's tempered metric; its scale to the root's trace changes no product
    whitened = HeadProducts(products.query_heads @ ridged_power(metric(x).covariance, half) * scale,
                            products.key_heads @ ridged_power(metric(y).covariance, half))
    reference = fit_collaborative(whitened, 6)
    expected = torch.einsum("ar,hr,br->hab", ridged_power(metric(x).covariance, -half)
                            @ reference.factors.shared_query, reference.factors.mixing / scale[:, :, 0],
                            ridged_power(metric(y).covariance, -half) @ reference.factors.shared_key)
    # to the float32 ALS's precision: the old path multiplied its float32 rows out before the inverse
    assert float((fit.factors.dense() - expected).abs().max()) < 1e-5 * float(expected.abs().max())


def test_a_calibrated_fit_reports_the_logit_error_not_its_tempered_metrics():
    # the fit whitens with a tempered power of the covariances; what it reports is still the share of the logit
    # energy on the calibration inputs it loses, the heads weighed as fitted
    products, x, y, fit = weighted_fit(9)
    left, right = ridged_power(metric(x).covariance, 0.5), ridged_power(metric(y).covariance, 0.5)
    lost = (left @ (products.dense() - fit.factors.dense()) @ right).pow(2).sum((1, 2))
    energy = (left @ products.dense() @ right).pow(2).sum((1, 2))
    expected = float(((HEAD_WEIGHTS * lost).sum() / (HEAD_WEIGHTS * energy).sum()).sqrt())
    assert fit.relative_error == pytest.approx(expected, rel=1e-6)


def test_the_tempered_whitening_keeps_the_roots_scale_and_inverts_exactly():
    from collab_convert.decompose.calibrated import _SideMetric

    covariance = metric(anisotropic_inputs(seed=12)).covariance
    side = _SideMetric(covariance, 1e-3, power=0.75)
    assert float(side.whitening().trace()) == pytest.approx(float(side.root().trace()), rel=1e-12)
    assert torch.allclose(side.whitening() @ side.whitening(inverse=True), torch.eye(24, dtype=torch.float64),
                          atol=1e-9)
    # flatter than the root: its condition number is the root's to the power 0.75
    condition = lambda m: float(torch.linalg.cond(m))  # noqa: E731
    assert condition(side.whitening()) == pytest.approx(condition(side.root()) ** 0.75, rel=1e-6)
    assert torch.allclose(_SideMetric(covariance, 1e-3, power=1.0).whitening(), side.root())


def test_calibrated_full_rank_stays_exact():
    g = torch.Generator().manual_seed(4)
    products = HeadProducts.from_projections(torch.randn(24, 24, generator=g), torch.randn(24, 24, generator=g), 4)
    x = anisotropic_inputs(seed=5)
    fit, correction = fit_calibrated(products, 24, metric(x), metric(x))
    assert torch.allclose(fit.factors.dense(), products.dense(), atol=1e-6)
    assert correction.abs().max() < 1e-6


def test_refinement_lowers_the_attention_kl():
    g = torch.Generator().manual_seed(6)
    heads, d_in = 4, 16
    wq, wk = torch.randn(16, d_in, generator=g), torch.randn(16, d_in, generator=g)
    bq = torch.randn(16, generator=g)
    sequences = [torch.randn(int(n), d_in, generator=g) for n in torch.randint(3, 12, (24,), generator=g)]
    products = HeadProducts.from_projections(wq, wk, heads)
    start = fit_collaborative(products, 5).factors
    result = refine_attention(
        sequences, sequences, wq, bq, wk, start, content_bias(wk, bq, heads), heads, 0.5
    )
    assert result.kl_after < 0.8 * result.kl_before


def test_a_consuming_refinement_steps_the_given_float32_factors_and_ends_where_a_copying_one_does():
    # the CP form hands its fit over in float32 (consume) rather than holding the float64 fit beside a copy
    g = torch.Generator().manual_seed(6)
    heads, d_in = 4, 16
    wq, wk = torch.randn(16, d_in, generator=g), torch.randn(16, d_in, generator=g)
    sequences = [torch.randn(int(n), d_in, generator=g) for n in torch.randint(3, 12, (24,), generator=g)]
    start = fit_collaborative(HeadProducts.from_projections(wq, wk, heads), 5).factors
    bias = content_bias(wk, None, heads)
    copied = refine_attention(sequences, sequences, wq, None, wk, start, bias, heads, 0.5, steps=40)
    given = start.to(torch.float32)
    untouched = given.shared_query.clone()
    consumed = refine_attention(sequences, sequences, wq, None, wk, given, bias, heads, 0.5, steps=40, consume=True)
    assert not torch.equal(given.shared_query, untouched)  # Adam stepped the caller's tensor itself
    for a, b in zip((copied.factors.shared_query, copied.factors.shared_key, copied.factors.mixing),
                    (consumed.factors.shared_query, consumed.factors.shared_key, consumed.factors.mixing)):
        assert torch.equal(a.float(), b)  # the same float32 numbers, only not widened back
    assert consumed.factors.shared_query.dtype == torch.float32


def test_compress_with_calibration_records_and_loads(tiny_bert, calibration_file, tmp_path, token_batch):
    out = tmp_path / "out"
    result = compress(str(tiny_bert), CompressOptions(rank=16, output=out, calibration=calibration_file, refine_steps=20))
    assert result.calibration["examples"] == 29  # the last 3 of the 32 lines are held out for the fidelity figure
    assert all(layer.logit_error is not None and 0 < layer.logit_error < 1 for layer in result.layers)
    assert all(layer.refinement["kl_after"] <= layer.refinement["kl_before"] for layer in result.layers)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["method"] == "tucker-cp-als+calibrated"
    report = json.loads((out / "report.json").read_text())
    assert "20 steps per layer on average" in report["calibration"]["refinement"]
    model = load_model(out).eval()
    with torch.no_grad():
        assert torch.isfinite(model(**token_batch).last_hidden_state).all()


def test_calibrated_full_rank_reproduces_the_model(tiny_bert, calibration_file, tmp_path, token_batch):
    from transformers import AutoModel

    compress(str(tiny_bert), CompressOptions(rank=48, output=tmp_path / "full", calibration=calibration_file))
    a = AutoModel.from_pretrained(tiny_bert).eval()
    b = AutoModel.from_pretrained(tmp_path / "full").eval()
    mask = token_batch["attention_mask"].bool()
    with torch.no_grad():
        x, y = a(**token_batch).last_hidden_state[mask], b(**token_batch).last_hidden_state[mask]
    assert (x - y).abs().max() / x.abs().max() < 1e-4


def test_rank_auto_picks_a_rank_per_layer(tiny_bert, calibration_file, tmp_path):
    low = compress(str(tiny_bert), CompressOptions(rank="auto", energy=0.6, output=tmp_path / "low"))
    high = compress(str(tiny_bert), CompressOptions(rank="auto", energy=0.99, output=tmp_path / "high"))
    assert all(1 <= a.rank <= b.rank <= 48 for a, b in zip(low.layers, high.layers))
    assert low.parameters_after < high.parameters_after
    config = json.loads((tmp_path / "low" / "config.json").read_text())
    assert [v["rank"] for v in config["quantization_config"]["layers"].values()] == [l.rank for l in low.layers]
    load_model(tmp_path / "low")
    result = CliRunner().invoke(
        app, ["compress", str(tiny_bert), "--rank", "auto", "--energy", "0.9", "--calibration",
              str(calibration_file), "--refine-steps", "5", "-o", str(tmp_path / "cli"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert all(layer["rank"] <= 48 for layer in json.loads(result.stdout)["layers"])


def test_verify_reports_fidelity_and_gates(tiny_bert, calibration_file, tmp_path, capsys):
    compress(str(tiny_bert), CompressOptions(rank=24, output=tmp_path / "out"))
    arguments = ["verify", str(tmp_path / "out"), "--against", str(tiny_bert), "--texts", str(calibration_file)]
    assert main(arguments + ["--json", "--min-cosine", "0.1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["texts"] == 32 and 0.1 < report["cosine_mean"] <= 1.0 + 1e-6
    assert report["cosine_p01"] <= report["cosine_mean"]
    # the five texts served worst, lowest first, each one of the given lines
    worst = report["worst_texts"]
    lines = [" ".join(line.split()) for line in calibration_file.read_text().splitlines()]
    assert len(worst) == 5 and [w["cosine"] for w in worst] == sorted(w["cosine"] for w in worst)
    assert worst[0]["cosine"] == pytest.approx(report["cosine_min"]) and all(w["text"] in lines for w in worst)
    assert main(arguments) == 0
    shown = capsys.readouterr().out
    assert "- the 5 texts with the lowest embedding cosine:" in shown and worst[0]["text"] in shown
    assert main(arguments + ["--min-cosine", "1"]) == 1  # rank 24 of 48 is not exact
    err = capsys.readouterr().err
    assert err.startswith("error: cosine_mean") and err.count("\n") == 1


def test_verify_language_model_metrics(tmp_path, calibration_file):
    import transformers as T

    from fixtures.models import save_tiny_tokenizer

    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=120, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    T.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    save_tiny_tokenizer(tmp_path / "gpt2")
    compress(str(tmp_path / "gpt2"), CompressOptions(rank=32, output=tmp_path / "out"))
    result = CliRunner().invoke(
        app, ["verify", str(tmp_path / "out"), "--against", str(tmp_path / "gpt2"), "--texts", str(calibration_file),
              "--json", "--min-top1", "0.99", "--max-kl", "1e-4"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["top1_agreement"] >= 0.99 and report["kl_mean"] < 1e-4


def test_gpt2_refines_with_its_own_per_layer_scaling(tmp_path, calibration_file):
    """GPT-2 may scale scores by 1/(layer + 1) on top of 1/sqrt(d_k): calibration reads each module's own
    scaling, so the refinement reproduces the attention the model really computes."""
    import transformers as T

    from collab_convert.architectures.source import open_model
    from collab_convert.integration.capture import collect_statistics
    from fixtures.models import save_tiny_tokenizer

    torch.manual_seed(0)
    folder = tmp_path / "gpt2"
    config = T.GPT2Config(vocab_size=120, n_embd=32, n_layer=2, n_head=4, n_positions=160,
                          scale_attn_by_inverse_layer_idx=True)
    T.GPT2LMHeadModel(config).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    source = open_model(str(folder))
    try:
        prefixes = [layer.prefix for layer in source.layers]
        statistics, _ = collect_statistics(source.folder, source.layout, source.family.position_bias, prefixes, ["the cat sat on a mat"] * 4)
    finally:
        source.close()
    head_dim = 32 // 4
    assert [statistics[p].scaling for p in prefixes] == pytest.approx([head_dim**-0.5, head_dim**-0.5 / 2])
    result = compress(str(folder), CompressOptions(rank=4, output=tmp_path / "out", calibration=calibration_file,
                                                   refine_steps=40, plots=False))
    assert all(layer.refinement and layer.refinement["kl_after"] <= layer.refinement["kl_before"]
               for layer in result.layers)
    assert "not available" not in result.calibration["refinement"]


def test_compress_headlines_and_gates_on_the_fidelity_it_measured(tiny_bert, calibration_file, tmp_path, capsys):
    """The weight error of a calibrated fit says little of the model; the fidelity measured on held-out lines
    does: the terminal and --json carry it, and --min-cosine / --min-top1 / --max-kl gate on it (exit 1)."""
    arguments = ["compress", str(tiny_bert), "--rank", "24", "--calibration", str(calibration_file), "--refine-steps",
                 "5", "--calibration-samples", "24"]
    assert main(arguments + ["-o", str(tmp_path / "pass"), "--min-cosine", "0.1", "-q"]) == 0
    shown = capsys.readouterr().out
    assert "Fidelity, measured on 8 held-out lines" in shown and "embedding cosine mean" in shown
    assert "Weight error" in shown and "targets the outputs" in shown
    assert main(arguments + ["-o", str(tmp_path / "json"), "--min-cosine", "0.1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["failures"] == [] and 0.1 < result["fidelity"]["cosine_mean"] <= 1.0 + 1e-6
    assert main(arguments + ["-o", str(tmp_path / "fail"), "--min-cosine", "1", "--max-kl", "0.5", "-q"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: cosine_mean") and "fails --min-cosine 1.0" in error and error.count("\n") == 1
    assert "top1_agreement" not in error  # no --min-top1 asked; --max-kl on an encoder: not a language model
    assert "kl_mean n/a (not a language model) fails --max-kl 0.5" in error


def test_a_fidelity_gate_without_calibration_is_refused_before_any_work(tiny_bert, tmp_path, capsys):
    assert main(["compress", str(tiny_bert), "--rank", "24", "-o", str(tmp_path / "out"), "--min-top1", "0.9"]) == 3
    assert "give --calibration" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _tiny_language_model(folder, tokenizer=True):
    from fixtures.models import build_family, family_case, save_tiny_tokenizer

    build_family(family_case("gpt2"), folder)
    if tokenizer:
        save_tiny_tokenizer(folder)
    return folder


def test_a_language_model_calibrates_on_built_in_text_by_default(tmp_path):
    model = _tiny_language_model(tmp_path / "in")
    result = compress(str(model), CompressOptions(rank=8, output=tmp_path / "out", refine_steps=5))
    assert result.calibration["source"] == "the built-in English text" and not result.warnings
    assert result.fidelity["measured_on"] == "32 held-out lines of the built-in English text"
    assert result.fidelity["top1_agreement"] is not None  # a language model: next tokens measured too
    assert "calibrated" in json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["method"]


@pytest.mark.parametrize("form", ["collaborative", "shared-key"])
def test_a_language_models_check_reads_the_originals_held_out_states_from_the_calibration_pass(form, tmp_path,
                                                                                               monkeypatch):
    """The calibration pass kept the original's states on the held-out lines, so the check runs the original's head
    alone (and its final norm); the figures it reports are those of both models run whole on the same lines."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transformers as T

    from collab_convert.integration import fidelity
    from fixtures.models import save_tiny_tokenizer

    torch.manual_seed(0)  # weights large enough for attention that is far from uniform, so a rank 4 key costs
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=40,
                                   initializer_range=0.3)).save_pretrained(model := tmp_path / "in")
    save_tiny_tokenizer(model)
    lines = [f"the {w} and the {v} were on the way {w}{v} again" for w in "abcdefgh" for v in "xyz"]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    reused, finished = [], fidelity.finished_bodies
    monkeypatch.setattr(fidelity, "finished_bodies", lambda *args: reused.append(1) or finished(*args))
    result = compress(str(model), CompressOptions(rank=4, output=tmp_path / "out", refine_steps=5, form=form,
                                                  calibration=tmp_path / "lines.txt", calibration_samples=16))
    assert reused == [1] and result.fidelity["measured_on"] == "8 held-out lines of " + str(tmp_path / "lines.txt")
    whole = fidelity.compare_language_models(load_model(tmp_path / "out", AutoModelForCausalLM),
                                             AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(
                                                 model), lines[16:], 128)
    assert result.fidelity["top1_agreement"] == whole.top1_agreement
    assert result.fidelity["kl_mean"] == pytest.approx(whole.kl_mean, rel=1e-5) and whole.kl_mean > 1e-4
    assert result.fidelity["cosine_mean"] == pytest.approx(whole.cosine.mean, abs=1e-6)


def test_weight_only_decoders_warn_what_it_costs(tmp_path, capsys):
    model = _tiny_language_model(tmp_path / "in")
    capsys.readouterr()  # what building the model printed
    assert main(["compress", str(model), "--rank", "8", "--weight-only", "-o", str(tmp_path / "out"), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["calibration"] is None and len(result["warnings"]) == 1
    assert captured.err.startswith("warning: fitted from the weights alone (--weight-only)")
    assert "next token 23% of the time" in captured.err and captured.err.count("\n") == 1
    assert "- warning: fitted from the weights alone" in (tmp_path / "out" / "report.md").read_text()
    untokenized = _tiny_language_model(tmp_path / "bare", tokenizer=False)  # nothing to calibrate with
    bare = compress(str(untokenized), CompressOptions(rank=8, output=tmp_path / "bare-out"))
    assert bare.calibration is None and "no tokenizer to calibrate with" in bare.warnings[0]


def test_weight_only_and_calibration_contradict(tmp_path, calibration_file, capsys):
    model = _tiny_language_model(tmp_path / "in")
    code = main(["compress", str(model), "--rank", "8", "--weight-only", "--calibration", str(calibration_file), "-o",
                 str(tmp_path / "out")])
    assert code == 3 and "contradict" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_encoders_are_not_calibrated_unasked(tiny_bert, tmp_path):
    result = compress(str(tiny_bert), CompressOptions(rank=8, output=tmp_path / "out"))
    assert result.calibration is None and not result.warnings


def test_a_tokenizer_is_read_once_per_process_until_its_files_change(tiny_bert):
    import os

    from collab_convert.integration.loading import load_tokenizer

    first = load_tokenizer(tiny_bert, "calibration")
    assert load_tokenizer(tiny_bert, "a fidelity estimate") is first
    changed = tiny_bert / "tokenizer.json"
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    assert load_tokenizer(tiny_bert, "calibration") is not first


def test_next_token_figures_formed_a_few_positions_at_a_time_equal_the_whole_matrices():
    from collab_convert.integration.fidelity import DISTRIBUTION_ROWS, _next_token_agreement

    generator = torch.Generator().manual_seed(3)
    base = torch.randn(3 * DISTRIBUTION_ROWS + 5, 500, generator=generator).to(torch.bfloat16)
    model = (base.float() + 0.5 * torch.randn(base.shape, generator=generator)).to(torch.bfloat16)
    p, q = torch.log_softmax(base.float(), -1), torch.log_softmax(model.float(), -1)
    agree, kl_sum = _next_token_agreement(base, model)
    assert agree == int((p.argmax(-1) == q.argmax(-1)).sum()) and 0 < agree < len(base)
    assert kl_sum == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-5)


def test_next_token_figures_formed_in_place_are_the_plain_expressions_and_leave_the_logits_alone():
    """The KL's terms are formed in the distributions' own tensors (no temporaries beside them at the check's
    peak): the same numbers, to the bit, as the plain expression on each few positions, and the float32 logits the
    heads give are not written to."""
    from collab_convert.integration.fidelity import DISTRIBUTION_ROWS, _next_token_agreement

    generator = torch.Generator().manual_seed(4)
    base = torch.randn(2 * DISTRIBUTION_ROWS + 3, 700, generator=generator)
    model = base + 0.3 * torch.randn(base.shape, generator=generator)
    before = (base.clone(), model.clone())
    agree, kl_sum = 0, 0.0
    for first in range(0, len(base), DISTRIBUTION_ROWS):
        p = torch.log_softmax(base[first : first + DISTRIBUTION_ROWS], -1)
        q = torch.log_softmax(model[first : first + DISTRIBUTION_ROWS], -1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl_sum += float((p.exp() * (p - q)).sum())
    assert _next_token_agreement(base, model) == (agree, kl_sum)
    assert torch.equal(base, before[0]) and torch.equal(model, before[1])
