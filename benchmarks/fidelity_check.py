"""The language-model fidelity check (compress's "measuring fidelity" stage, and `verify`), batched against one text
at a time, side by side in one run.

    python benchmarks/fidelity_check.py [--texts 32] [--rounds 2] [--loaded]

Model: the embedded SmolLM2-135M-Instruct and its weight-only compression at `--key-cache 0.75` (written here
into a scratch folder), both loaded as compress loads them to measure (offloaded block by block, float32
blocks), with glibc returning freed tensors as compress has it. Text: Brown documents of about 200 words
(benchmarks/calibration_documents.py), cut at 128 tokens as the check cuts them. Each round times
`compare_language_models` twice in alternating order: with its default batches of bodies, and with one text per
batch (what it did before: every block reloaded per text). Printed: each variant's seconds and peak anonymous
resident memory above the level before it, the ratio of the medians, and that the figures agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_documents import documents  # noqa: E402
from neighbour import busy_neighbour  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def anonymous_memory() -> int:
    """Bytes of this process's anonymous resident memory (the tensors; not the checkpoint's mapped file pages,
    which the kernel drops at will)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakMemory:
    """The most anonymous resident memory above the level at the start, sampled every 10 ms while the block runs."""

    def __enter__(self):
        self.peak, self.running = 0, True
        self.start = anonymous_memory()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, anonymous_memory() - self.start)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loaded", action="store_true", help="beside a busy neighbour")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import collab_convert.integration.batches as batches
    from collab_convert.cpu import return_freed_memory
    from collab_convert.integration.fidelity import compare_language_models
    from collab_convert.integration.layerwise import load_offloaded
    from collab_convert.integration.loading import load_tokenizer
    from collab_convert.io.folders import resolve_model

    return_freed_memory()  # as compress has glibc do: freed tensors go back to the system
    texts = documents()[1][: args.texts]
    original = resolve_model(SMOLLM2)
    tokenizer = load_tokenizer(original, "the benchmark")
    budget = batches.batch_tokens
    variants = {"batched bodies": budget, "one text a batch": lambda width: 1}  # the budget's floor is one text
    with tempfile.TemporaryDirectory() as scratch, busy_neighbour(args.loaded):
        compressed = Path(scratch) / "out"
        subprocess.run([sys.executable, "-m", "collab_convert", "compress", SMOLLM2, "--key-cache", "0.75",
                        "--weight-only", "-o", str(compressed)], check=True, capture_output=True)
        model = load_offloaded(compressed, AutoModelForCausalLM)
        base = load_offloaded(original, AutoModelForCausalLM)
        times = {name: [] for name in variants}
        peaks = {name: [] for name in variants}
        figures = {}
        for round_ in range(args.rounds):
            for name in (list(variants) if round_ % 2 == 0 else list(reversed(variants))):
                batches.batch_tokens = variants[name]
                with PeakMemory() as memory:
                    started = time.perf_counter()
                    found = compare_language_models(model, base, tokenizer, texts)
                    times[name].append(time.perf_counter() - started)
                peaks[name].append(memory.peak)
                figures[name] = found
        batches.batch_tokens = budget
    print(f"SmolLM2-135M-Instruct, key cache 0.75 weight-only against the original, {len(texts)} Brown documents "
          f"at 128 tokens, {args.rounds} rounds, {torch.get_num_threads()} threads, "
          f"{'beside a busy neighbour' if args.loaded else 'quiet'} ({os.cpu_count()} cores)")
    for name in variants:
        found = figures[name]
        print(f"  {name:18s} median {statistics.median(times[name]):6.1f} s  (runs: "
              f"{', '.join(f'{t:.1f}' for t in times[name])})   peak memory +{max(peaks[name]) / 2**20:.0f} MB   "
              f"top-1 {found.top1_agreement:.4f}  KL {found.kl_mean:.5f}  cosine {found.cosine.mean:.5f}")
    ratio = statistics.median(times["batched bodies"]) / statistics.median(times["one text a batch"])
    print(f"  batched / one text a batch: {ratio:.3f} of the medians")


if __name__ == "__main__":
    main()
