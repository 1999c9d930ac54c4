"""Weight-only compress of billion-parameter rotary checkpoints: time past imports, peak memory, and where the time
goes, on synthetic bf16 checkpoints of real shapes in 2 GB safetensors shards.

    python benchmarks/rotary_scale.py [--shapes tinyllama,llama2-7b] [--key-cache 0.5]

Shapes: TinyLlama-1.1B (22 layers, hidden 2048, 32 query / 4 key-value heads, head_dim 64) and Llama-2-7B
(32 layers, hidden 4096, 32 heads, no grouping). The checkpoint is written tensor by tensor with our streaming
shard writer (never held in memory). compress runs in a fresh process that samples its resident memory every
2 ms: the peak above its baseline after imports, in total and anonymous only (the rest is pages of the
memory-mapped input, which the kernel may drop under pressure). Time: "fits" is the layers' fits (reading their
query/key weights and the math) summed over the worker threads that run them side by side; "waiting" is the
part of the wall time the writer spent waiting on a fit, "streaming" the part it spent copying tensors through
(report.json's seconds per stage).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "tinyllama": dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                      intermediate_size=5632, vocab_size=32000),
    "llama2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000),
}

MEASURE = r"""
import json, sys, threading, time
import collab_convert, torch, transformers  # imports are the baseline, not the work
from collab_convert import CompressOptions, compress
from pathlib import Path

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
baseline, baseline_anon = status("VmRSS"), status("RssAnon")
peak, peak_anon, running = [baseline], [baseline_anon], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], status("VmRSS")); peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
result = compress(sys.argv[1], CompressOptions(key_cache=float(sys.argv[3]), output=Path(sys.argv[2]),
                                               max_shard_size="2GB"))
seconds = time.perf_counter() - started
running[0] = False
print(json.dumps({"peak": peak[0] - baseline, "peak_anon": peak_anon[0] - baseline_anon, "seconds": seconds,
                  "fits": sum(layer.seconds for layer in result.layers), "threads": result.threads,
                  "waiting": result.stage_seconds.get("fitting", 0.0),
                  "streaming": result.stage_seconds.get("writing", 0.0)}))
"""


def synthesise(folder: Path, shape: dict) -> int:
    """A llama checkpoint of `shape` in bf16, written one tensor at a time into 2 GB shards."""
    import torch
    from transformers import LlamaConfig

    from collab_convert.io.headers import TensorSpec

    from collab_convert.io.writer import ShardWriter

    config = LlamaConfig(**shape, max_position_embeddings=2048, torch_dtype="bfloat16")
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    d, inner, heads, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = d // heads
    shapes = [("model.embed_tokens.weight", (shape["vocab_size"], d))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (d,)), (f"{p}.self_attn.q_proj.weight", (heads * head_dim, d)),
                   (f"{p}.self_attn.k_proj.weight", (kv * head_dim, d)), (f"{p}.self_attn.v_proj.weight", (kv * head_dim, d)),
                   (f"{p}.self_attn.o_proj.weight", (d, heads * head_dim)),
                   (f"{p}.post_attention_layernorm.weight", (d,)), (f"{p}.mlp.gate_proj.weight", (inner, d)),
                   (f"{p}.mlp.up_proj.weight", (inner, d)), (f"{p}.mlp.down_proj.weight", (d, inner))]
    shapes += [("model.norm.weight", (d,)), ("lm_head.weight", (shape["vocab_size"], d))]
    specs = [TensorSpec(name, torch.bfloat16, size) for name, size in shapes]
    writer = ShardWriter(folder, specs, 2 * 10**9)
    generator = torch.Generator().manual_seed(0)
    for name, size in shapes:
        if name.endswith("norm.weight"):
            tensor = 1 + 0.1 * torch.randn(size, generator=generator)
        else:
            tensor = torch.randn(size, generator=generator) * 0.02
        writer.add(name, tensor.to(torch.bfloat16))
    writer.finish()
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tinyllama")
    parser.add_argument("--key-cache", type=float, default=0.5)
    args = parser.parse_args()
    print(f"{'shape':<10} {'checkpoint':>10} {'seconds':>8} {'fits':>6} {'waiting':>8} {'streaming':>9} {'peak':>9} {'share':>6} "
          f"{'anon peak':>10} {'share':>6}  threads")
    for name in args.shapes.split(","):
        with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1] / "data") as scratch:
            source = Path(scratch) / name
            size = synthesise(source, SHAPES[name])
            run = subprocess.run([sys.executable, "-c", MEASURE, str(source), str(Path(scratch) / "out"),
                                  str(args.key_cache)], capture_output=True, text=True, check=True)
            found = json.loads(run.stdout.strip().splitlines()[-1])
            gib = 2**30
            print(f"{name:<10} {size / gib:>8.2f} G {found['seconds']:>8.1f} {found['fits']:>6.1f} "
                  f"{found['waiting']:>8.1f} {found['streaming']:>9.1f} {found['peak'] / gib:>7.2f} G {found['peak'] / size:>6.2f} "
                  f"{found['peak_anon'] / gib:>8.2f} G {found['peak_anon'] / size:>6.2f}  "
                  f"{found['threads']['threads']} ({found['threads']['why']})", flush=True)


if __name__ == "__main__":
    main()
