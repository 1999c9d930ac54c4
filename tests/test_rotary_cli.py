"""Rotary decoders through the CLI, as a user meets them: analyze shows the per-frequency picture and the key
cache at candidate budgets; compress takes --key-cache or --rank; wrong combinations and broken GGUF files end
in one line, with nothing written."""

import json

import pytest

from collab_convert.cli import main
from fixtures.models import ROTARY_CASES, build_rotary


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rotary") / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), folder)
    return folder


def run(capsys, *arguments):
    code = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code, err, fragment):
    assert code != 0 and err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err and "Traceback" not in err


def test_analyze_shows_per_frequency_spectra_and_key_cache_budgets(tiny_llama, capsys):
    code, out, _ = run(capsys, "analyze", tiny_llama, "--json")
    assert code == 0
    result = json.loads(out)
    layer = result["layers"][0]
    assert len(layer["frequency_spectra"]) == 8 and len(layer["frequency_spectra"][0]) == 2  # frequencies x key heads
    assert sum(sum(row) for row in layer["frequency_spectra"]) == pytest.approx(1, abs=1e-3)
    caches = [p["key_cache_per_token"] for p in result["predictions"]]
    assert caches == sorted(caches, reverse=True) and caches[0] == 2 * 32  # the full budget: 2 layers x 2 heads x 16
    errors = [p["mean_relative_error"] for p in result["predictions"]]
    assert errors[0] == pytest.approx(0, abs=1e-6) and errors == sorted(errors)


def test_analyze_table_names_the_next_step(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "analyze", tiny_llama, "-q")
    assert code == 0 and "strongest frequencies" in out and "--key-cache" in out


def test_compress_with_key_cache_writes_a_smaller_cache(tiny_llama, tmp_path, capsys):
    code, out, _ = run(capsys, "compress", tiny_llama, "--key-cache", "0.5", "-o", tmp_path / "out", "--json")
    assert code == 0
    result = json.loads(out)
    assert sum(layer["rank"] for layer in result["layers"]) <= 32
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("arguments, fragment", [
    ((), "--key-cache"),  # neither --rank nor --key-cache
    (("--rank", "16", "--key-cache", "0.5"), "not both"),
    (("--rank", "33"), "exceeds the full rank"),
    (("--key-cache", "0"), "--key-cache"),
    (("--key-cache", "0.5", "--rank-spread", "energy"), "already spreads its budget"),
    (("--kv-cache", "0.5", "--rank-spread", "energy"), "already spreads its budget"),
])
def test_bad_budgets_are_refused_in_one_line(tiny_llama, tmp_path, capsys, arguments, fragment):
    code, _, err = run(capsys, "compress", tiny_llama, *arguments, "-o", tmp_path / "out")
    assert_refused(code, err, fragment)
    assert not (tmp_path / "out").exists()


def test_key_cache_is_refused_for_models_without_a_shared_key_form(tiny_bert, tmp_path, capsys):
    code, _, err = run(capsys, "compress", tiny_bert, "--key-cache", "0.5", "-o", tmp_path / "out")
    assert_refused(code, err, "not offered for model_type 'bert'")


def test_a_file_that_is_not_gguf_is_refused(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    code, _, err = run(capsys, "compress", fake, "--key-cache", "0.5", "-o", tmp_path / "out")
    assert_refused(code, err, "not a GGUF file")
    assert not (tmp_path / "out").exists()


def test_no_plots_skips_the_pictures_and_keeps_the_reports(tiny_llama, tmp_path, capsys):
    code, _, _ = run(capsys, "compress", tiny_llama, "--key-cache", "0.5", "-o", tmp_path / "out", "--no-plots", "-q")
    assert code == 0
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"report.md", "report.json", "README.md", "model.safetensors"} <= files
    assert not {"spectra.svg", "errors.svg"} & files


def test_output_bytes_do_not_depend_on_the_number_of_threads(tiny_llama, tmp_path, capsys):
    for threads in ("1", "2"):
        code, _, err = run(capsys, "compress", str(tiny_llama), "--key-cache", "0.5", "-o", str(tmp_path / threads),
                           "--threads", threads, "--no-plots", "-q")
        assert code == 0, err
    assert (tmp_path / "1" / "model.safetensors").read_bytes() == (tmp_path / "2" / "model.safetensors").read_bytes()


def test_refined_layers_show_refining_layer_by_layer(tmp_path):
    from collab_convert import CompressOptions, compress
    from fixtures.models import save_tiny_tokenizer

    decoder = tmp_path / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), decoder)
    save_tiny_tokenizer(decoder)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the {w} was on the {v}" for w in "abcdef" for v in "ghij") + "\n")
    seen = []
    result = compress(str(decoder), CompressOptions(key_cache=0.5, output=tmp_path / "out", threads=2, plots=False,
                                                    calibration=texts, refine_steps=20),
                      lambda stage, done, total: seen.append((stage, done, total)))
    refining = [(done, total) for stage, done, total in seen if stage.startswith("refining")]
    layers = len(result.layers)
    assert [done for done, _ in refining] == list(range(layers)) and {total for _, total in refining} == {layers}
    # layers refine one at a time by default: memory holds one layer's samples, however deep the model
    assert {layer.refinement["layers_together"] for layer in result.layers} == {1}
    # refined in the same steps, the layers show as one: "layers 1-2/2"
    seen.clear()
    compress(str(decoder), CompressOptions(key_cache=0.5, output=tmp_path / "out", threads=2, plots=False,
                                           calibration=texts, refine_steps=20, refine_together=layers,
                                           overwrite=True),
             lambda stage, done, total: seen.append((stage, done, total)))
    assert any(stage.startswith("refining") and f"layers 1-{layers}/{layers}" in stage for stage, _, _ in seen)
    assert all(layer.refinement and layer.refinement["steps"] > 0 for layer in result.layers)
    assert result.stage_seconds["refining"] > 0 and "fitting" not in result.stage_seconds


def test_each_form_refines_its_own_default_number_of_steps(tiny_bert, tmp_path, monkeypatch):
    """--refine-steps left out: each form's own count, measured to pay for that form (docs/benchmarks.md): 200 for
    the shared-key form (steps of 4 sequences) and the collaborative form, 130 for the multi-query form (steps of
    8); given, it is what the user asked for."""
    from collab_convert import CompressOptions, compress
    from fixtures.models import save_tiny_tokenizer

    decoder = tmp_path / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), decoder)
    save_tiny_tokenizer(decoder)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the {w} was on the {v}" for w in "abcdef" for v in "ghij") + "\n")
    settings = {"output": tmp_path / "out", "threads": 1, "plots": False, "calibration": texts, "overwrite": True}
    from collab_convert.decompose import shared_key_refinement

    drawn, refine = [], shared_key_refinement.refine_shared_keys
    monkeypatch.setattr(shared_key_refinement, "refine_shared_keys",
                        lambda *args, **kwargs: drawn.append(kwargs["batch_sequences"]) or refine(*args, **kwargs))
    for budget, steps, sequences in (({"key_cache": 0.5}, 200, 4), ({"kv_cache": 0.5}, 130, 8)):
        drawn.clear()
        result = compress(str(decoder), CompressOptions(**budget, **settings))
        assert f"up to {steps} Adam steps per layer" in result.calibration["refinement"]
        assert f"each on {sequences} of" in result.calibration["refinement"]
        assert "32 query positions in each" in result.calibration["refinement"]
        assert "checked every 40 steps" in result.calibration["refinement"]
        assert all(0 < layer.refinement["steps"] <= steps for layer in result.layers)
        assert drawn and set(drawn) == {sequences}  # what the report says is what the steps draw
    asked = compress(str(decoder), CompressOptions(key_cache=0.5, refine_steps=40, **settings))
    assert "up to 40 Adam steps per layer" in asked.calibration["refinement"]
    encoder = compress(str(tiny_bert), CompressOptions(rank=8, **settings))
    assert "200 steps per layer on average" in encoder.calibration["refinement"]


def test_layers_refine_one_at_a_time_by_default_however_large_the_checkpoint(tmp_path):
    """Layers refined in the same steps hold their samples at once: by default one layer refines at a time, so
    memory does not grow with depth, even where the samples are small beside the checkpoint (a default that
    grouped layers within a share of the checkpoint grew with depth on a Llama-shaped model: docs/benchmarks.md).
    --refine-together asks for groups."""
    from dataclasses import replace

    from collab_convert import CompressOptions, compress
    from fixtures.models import save_tiny_tokenizer

    llama = next(c for c in ROTARY_CASES if c.name == "llama")
    decoder = tmp_path / "llama"  # a 50,000-word vocabulary: 26 MB of embeddings beside kilobytes of samples
    build_rotary(replace(llama, settings={**llama.settings, "vocab_size": 50_000}), decoder)
    save_tiny_tokenizer(decoder)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the {w} was on the {v}" for w in "abcdef" for v in "ghij") + "\n")
    for asked, expected in (({}, 1), ({"refine_together": 2}, 2)):
        result = compress(str(decoder), CompressOptions(key_cache=0.5, output=tmp_path / f"out-{expected}",
                                                        plots=False, calibration=texts, refine_steps=5, **asked))
        assert {layer.refinement["layers_together"] for layer in result.layers} == {expected}


@pytest.mark.parametrize("budget", [{"key_cache": 0.5}, {"kv_cache": 0.5}])
def test_layers_are_refined_one_at_a_time(budget, tmp_path, monkeypatch):
    """Memory holds one refinement at a time (its layers' stacked sequences and step workspace), whatever the
    threads: two side by side broke the 0.5x-checkpoint bound on a GPT-2-medium-shaped model (benchmarks/memory.py).
    The layers a refinement holds share its steps (--refine-together, forms/shared_key/fitting.py)."""
    import threading

    from collab_convert import CompressOptions, compress
    from collab_convert.decompose import shared_key_refinement
    from fixtures.models import save_tiny_tokenizer

    decoder = tmp_path / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), decoder)
    save_tiny_tokenizer(decoder)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the {w} was on the {v}" for w in "abcdef" for v in "ghij") + "\n")
    refine, lock, running, most = shared_key_refinement.refine_shared_keys, threading.Lock(), [0], [0]

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return refine(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(shared_key_refinement, "refine_shared_keys", counted)
    result = compress(str(decoder), CompressOptions(**budget, output=tmp_path / "out", threads=2, plots=False,
                                                    calibration=texts, refine_steps=30))
    assert all(layer.refinement for layer in result.layers) and most[0] == 1
