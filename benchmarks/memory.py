"""Peak memory of `compress` against checkpoint size, on GPT-2-medium-shaped or Llama-shaped bf16 checkpoints.

Builds GPT-2 checkpoints (n_embd 1024, 16 heads, bf16, a small vocabulary) with 12 and 24 layers, or with
--shape llama rotary grouped-query ones of the same width (16 query heads and 4 key-value heads of 64, a SwiGLU
feed-forward of 2816, untied embeddings), saved in 100 MB shards, then compresses each in a fresh process and
reports the peak resident memory (anonymous and file-backed, sampled every 2 ms) above that process's own
baseline, taken after its imports and a warm-up compression of a one-layer model of the same shape (one-time lazy
loading of library code is not what grows with the model). Streaming means: one input shard mapped, one layer's math and
one tensor in flight at a time, so the peak stays flat as the model grows.

    python benchmarks/memory.py [--ranks 256,512,768] [--calibration DOCUMENTS [--refine-steps 200,20]]
        [--form shared-key] [--shape llama]

With --shape llama the form is the rotary shared key, and a rank is its key width per layer (of 256: 64, 128 and
192 are a quarter, half and three quarters of the key cache); --kv-cache 0.25,0.5 measures the multi-query export
at those shares of the KV cache instead of ranks.

Every combination of rank and refinement steps is measured (the bound must hold across them, not at one point).

--calibration N compresses with calibration on N Brown documents (about 200 words each, see
calibration_documents.py) and the default refinement: the model then runs on text, a block at a time, its
statistics, samples and fits waiting on disk. The models get GPT-2's vocabulary size and all-MiniLM-L6-v2's
tokenizer (any tokenizer whose ids fit the vocabulary serves: the weights are random).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import json, sys, threading, time
from pathlib import Path
from collab_convert.cpu import ask_for_huge_pages
from collab_convert.options import CompressOptions
settings = json.loads(sys.argv[4])
# as the command line does: a decoder form asked for by name asks torch for huge pages before torch loads,
# one left to the family once the lookup has loaded it, before anything is allocated
requested = CompressOptions(output=Path(sys.argv[2]), **settings).requested_form
ask_for_huge_pages(requested)
import collab_convert, torch  # imports are the baseline, not the work
from collab_convert.architectures.source import ask_for_huge_pages_for
ask_for_huge_pages_for(sys.argv[1], requested)
from collab_convert.progress import stage_of

# Warm-up on a one-layer model of the same shape: lazily loaded library code (LAPACK, the safetensors
# reader) and allocator arenas are paid once per process, whatever the model size.
collab_convert.compress(sys.argv[3], collab_convert.CompressOptions(
    output=Path(sys.argv[2] + "-warmup"), max_shard_size="100MB", **settings))

def resident():  # (VmRSS, its anonymous part, its file-backed part) in bytes
    found = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
            found[line.split(":")[0]] = int(line.split()[1]) * 1024
    return found["VmRSS"], found["RssAnon"], found["RssFile"]
def rss():
    return resident()[0]
baseline_parts = resident()
baseline = baseline_parts[0]
peak = [baseline]
stage, stage_peaks = ["start"], {}  # the peak within each progress stage, to say which one sets the peak
stage_parts = {}  # each stage's peaks of the anonymous and the file-backed parts, apart
running = [True]
def sample():
    while running[0]:
        now, anon, mapped = resident()
        peak[0] = max(peak[0], now)
        stage_peaks[stage[0]] = max(stage_peaks.get(stage[0], 0), now - baseline)
        parts = stage_parts.setdefault(stage[0], [0, 0])
        parts[0] = max(parts[0], anon - baseline_parts[1])
        parts[1] = max(parts[1], mapped - baseline_parts[2])
        time.sleep(0.002)
def progress(label, done, total):
    stage[0] = stage_of(label)  # the stage names report.json's seconds use
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
result = collab_convert.compress(sys.argv[1], collab_convert.CompressOptions(
    output=Path(sys.argv[2]), max_shard_size="100MB", **settings), progress)
seconds = time.perf_counter() - started
running[0] = False
peak[0] = max(peak[0], rss())
print(json.dumps({"baseline": baseline, "peak": peak[0], "seconds": seconds, "stages": result.stage_seconds,
                  "stage_peaks": stage_peaks, "stage_parts": stage_parts,
                  "files": [f for f in result.files if f.endswith(".safetensors")]}))
"""


def build(folder: Path, layers: int, with_tokenizer: bool = False, shape: str = "gpt2") -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if shape == "llama":  # the tokenizer's ids (30,522) fit Llama's vocabulary
        config = LlamaConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                             intermediate_size=2816, max_position_embeddings=1024,
                             vocab_size=32000 if with_tokenizer else 1000, bos_token_id=0, eos_token_id=0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    else:
        config = GPT2Config(n_embd=1024, n_layer=layers, n_head=16, n_positions=1024,
                            vocab_size=50257 if with_tokenizer else 1000, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100MB")
    if with_tokenizer:
        import shutil

        import collab_convert.io.folders as folders

        minilm = folders.resolve_model("sentence-transformers/all-MiniLM-L6-v2")
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if (minilm / name).is_file():
                shutil.copy(minilm / name, folder / name)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def measure(source: Path, size: int, layers: int, rank: str, refine: int, warmup: Path, settings: dict) -> None:
    """One compress in a fresh process (`settings`: its options, the size among them): its peak above its own
    baseline, printed as a row labelled `rank`."""
    shards = len(list(source.glob("*.safetensors")))
    output = source.parent / f"out-{layers}-{rank}-{refine}"
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(source), str(output), str(warmup), json.dumps(settings)],
        capture_output=True, text=True, check=True,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    above = measured["peak"] - measured["baseline"]
    print(f"{rank:>5} {refine or 'auto':>6} {layers:>6} {size / 1e6:>9.0f}MB {shards:>7} {above / 1e6:>18.0f}MB "
          f"{above / size:>7.1%} {measured['seconds']:>8.1f}", flush=True)
    print("        seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in measured["stages"].items()))
    print("        peak above baseline per stage: "
          + ", ".join(f"{k} {v / 1e6:.0f}MB" for k, v in measured["stage_peaks"].items()), flush=True)
    print("        of which anonymous / file-backed (each part's own peak): "
          + ", ".join(f"{k} {a / 1e6:.0f} / {f / 1e6:.0f}MB" for k, (a, f) in measured["stage_parts"].items()),
          flush=True)
    import shutil

    shutil.rmtree(output, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24", help="model depths to measure")
    parser.add_argument("--ranks", "--rank", default="512", help="ranks to measure at, e.g. 256,512,768")
    parser.add_argument("--kv-cache", default=None, help="with --shape llama: the multi-query export at these shares "
                        "of the KV cache (e.g. 0.25,0.5) instead of ranks")
    parser.add_argument("--calibration", type=int, default=0, help="calibrate on this many Brown documents")
    parser.add_argument("--refine-steps", default=None,
                        help="with --calibration: refinement steps per layer to measure at, e.g. 200,20 (default: the "
                        "form's own, 200, or 130 for the multi-query export)")
    parser.add_argument("--refine-together", type=int, default=0,
                        help="compress --refine-together (0: its default, one layer at a time)")
    parser.add_argument("--shape", default="gpt2", choices=["gpt2", "llama"],
                        help="GPT-2-medium-shaped checkpoints (absolute positions) or Llama-shaped (rotary, "
                        "grouped keys)")
    parser.add_argument("--form", default="auto", help="compress --form: collaborative (the default here) or "
                        "shared-key (--rank is then the shared key's width)")
    args = parser.parse_args()
    settings = {"form": args.form, **({"refine_together": args.refine_together} if args.refine_together else {})}
    print(f"{'rank':>5} {'refine':>6} {'layers':>6} {'checkpoint':>11} {'shards':>7} {'peak above baseline':>20} "
          f"{'share':>7} {'seconds':>8}")
    with tempfile.TemporaryDirectory() as scratch:
        if args.calibration:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from calibration_documents import documents

            texts = Path(scratch) / "documents.txt"
            fitted, held_out = documents()
            texts.write_text("\n".join(fitted[: args.calibration] + held_out[:32]) + "\n")
            settings.update(calibration=str(texts), calibration_samples=args.calibration)
            print(f"calibration: {args.calibration} documents, fidelity measured on 32 held-out ones")
        warmup = Path(scratch) / f"{args.shape}-warmup"
        build(warmup, 1, bool(args.calibration), args.shape)
        steps = [int(n) for n in args.refine_steps.split(",")] if args.calibration and args.refine_steps else [None]
        depths = [int(n) for n in args.layers.split(",")]
        sources = {layers: Path(scratch) / f"{args.shape}-{layers}" for layers in depths}
        sizes = {layers: build(sources[layers], layers, bool(args.calibration), args.shape) for layers in depths}
        sizes_asked = ({f"kv{share}": {"kv_cache": float(share)} for share in args.kv_cache.split(",")} if args.kv_cache
                       else {rank: {"rank": int(rank)} for rank in args.ranks.split(",")})
        for rank, sizing in sizes_asked.items():
            for refine in steps:
                for layers in depths:
                    measure(sources[layers], sizes[layers], layers, rank, refine, warmup,
                            {**settings, **sizing, **({"refine_steps": refine} if refine is not None else {})})
    print("\ntarget: peak above baseline under half the checkpoint size, and flat as models grow")


if __name__ == "__main__":
    main()
