"""Calibrated encoders on text of another domain than their calibration text, as a user runs the CLI.

    python benchmarks/cross_domain.py [--ranks 192,96] [--documents 300] [--model FOLDER]
        [--variant NAME='--flag value ...' ...] [--loaded]

Calibration: `--documents` news documents (Brown's news texts, runs of consecutive sentences of about 200 words,
one per line), from three quarters of the news texts. Scored on:
  - news: documents of the other quarter of the news texts (the calibration's own domain, unseen texts);
  - fiction: documents of Brown's fiction, mystery, science fiction, adventure, romance and humour texts;
  - reviews: documents of Brown's reviews;
  - short lines: benchmarks/texts/short_lines.txt, 100 lines written for this benchmark (queries, chat, product
    reviews, headlines, commands), nothing like news prose.
For each: the mean and the 1st-percentile cosine of the compressed model's sentence embeddings (mean-pooled, the
sentence-transformers recipe) to the original's. Downstream: a logistic-regression genre probe (15 Brown genres)
trained on the original's embeddings of documents from three quarters of the texts, scored on documents of the
other quarter with the original's and with each compressed model's embeddings ("swap": the classifier is not
retrained), in accuracy points.

Each variant runs `collab-convert compress MODEL --rank R --calibration news.txt [its flags]` in a fresh process
(wall time, and the time past imports from report.json). The default variant is the default run; add others
with --variant, e.g. --variant "distil=--distill-steps 100".

--calibrate-on asks what the calibration's domain is worth:
  - news (the default): the news documents above;
  - short: the 100 short lines themselves (the short lines' cells are then on lines the fit saw: the form's
    capacity for them, not a held-out figure);
  - news+short: the news documents with every other short line, one after every six documents; the short lines
    are scored in two halves, the unseen half and the half the fit saw.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_documents import document_runs, probe_documents  # noqa: E402
from neighbour import busy_neighbour  # noqa: E402

WORDS_PER_DOCUMENT = 200
FICTION = {"fiction", "mystery", "science_fiction", "adventure", "romance", "humor"}
SHORT_LINES = Path(__file__).resolve().parent / "texts" / "short_lines.txt"


def spread(items: list, count: int) -> list:
    return items[:: max(len(items) // count, 1)][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="192,96")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--evaluate", type=int, default=300, help="documents per scored domain at most")
    parser.add_argument("--model", default=None, help="the encoder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--variant", action="append", default=[], help="NAME='compress flags'")
    parser.add_argument("--no-default", action="store_true", help="only the --variant runs")
    parser.add_argument("--loaded", action="store_true", help="a second job runs beside the measurement")
    parser.add_argument("--calibrate-on", choices=("news", "short", "news+short"), default="news")
    args = parser.parse_args()
    with busy_neighbour(args.loaded):
        run(args)


def calibration_set(on: str, news: list[str], scored: dict[str, list[str]]) -> tuple[list[str], dict]:
    """(the calibration texts, the scored sets) for --calibrate-on."""
    short = scored["short lines"]
    rest = {name: texts for name, texts in scored.items() if name != "short lines"}
    if on == "short":
        return list(short), {**rest, "short (seen)": short}
    if on == "news+short":
        seen, unseen = short[0::2], short[1::2]
        mixed = []
        for index, document in enumerate(news):
            mixed.append(document)
            if index % 6 == 0 and index // 6 < len(seen):
                mixed.append(seen[index // 6])
        mixed += seen[len(news[::6]):]
        return mixed, {**rest, "short unseen": unseen, "short seen": seen}
    return news, scored


def run(args) -> None:
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoModel, AutoTokenizer

    import collab_convert  # noqa: F401 - loads the collaborative checkpoints
    from collab_convert.integration.fidelity import cosine_stats, sentence_embeddings
    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    every = document_runs(WORDS_PER_DOCUMENT)
    news = [d for d in every if d[1] == "news"]
    calibration = spread([d[0] for d in news if d[2] % 4 != 3], args.documents)
    scored = {
        "news (held out)": spread([d[0] for d in news if d[2] % 4 == 3], args.evaluate),
        "fiction": spread([d[0] for d in every if d[1] in FICTION], args.evaluate),
        "reviews": spread([d[0] for d in every if d[1] == "reviews"], args.evaluate),
        "short lines": [line for line in SHORT_LINES.read_text().splitlines() if line.strip()],
    }
    calibration, scored = calibration_set(args.calibrate_on, calibration, scored)
    probe_train = spread([d for d in every if d[2] % 4 != 3], 1500)
    probe_test = spread([d for d in every if d[2] % 4 == 3], 600)
    print(f"calibration: {len(calibration)} texts ({args.calibrate_on}); scored: "
          + ", ".join(f"{name} {len(texts)}" for name, texts in scored.items())
          + f"; genre probe {len(probe_train)} / {len(probe_test)} documents"
          + ("; a second job runs beside it" if args.loaded else ""), flush=True)

    source = resolve_model(args.model or DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source)

    def embeddings(model) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            found = {name: sentence_embeddings(model, tokenizer, texts) for name, texts in scored.items()}
            found["probe"] = sentence_embeddings(model, tokenizer, [d[0] for d in probe_test])
        return found

    original = AutoModel.from_pretrained(source).eval()
    reference = embeddings(original)
    with torch.inference_mode():
        train = sentence_embeddings(original, tokenizer, [d[0] for d in probe_train]).numpy()
    probe = LogisticRegression(max_iter=3000, C=10.0).fit(train, np.array([d[1] for d in probe_train]))
    labels = np.array([d[1] for d in probe_test])
    base_accuracy = float((probe.predict(reference["probe"].numpy()) == labels).mean())
    print(f"genre probe with the original's embeddings: {100 * base_accuracy:.1f}%", flush=True)

    variants = ([] if args.no_default else [("default", [])]) + [
        (name, flags.split()) for name, flags in (v.split("=", 1) for v in args.variant)]
    names = list(scored)
    print(f"{'rank':>4} {'variant':<12} {'wall s':>7} {'past imp.':>9}  "
          + "  ".join(f"{n[:15]:>15}" for n in names) + "  probe (points)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "news.txt"
        probes = probe_documents(calibration, avoid=[t for texts in scored.values() for t in texts])
        text.write_text("\n".join(calibration + probes) + "\n")
        for rank in [int(r) for r in args.ranks.split(",")]:
            for name, flags in variants:
                out = Path(scratch) / f"r{rank}-{name}"
                started = time.perf_counter()
                subprocess.run(["collab-convert", "compress", str(source), "--rank", str(rank), "--calibration",
                                str(text), "--calibration-samples", str(len(calibration)), "-o", str(out), "-q",
                                "--json", "--overwrite", *flags], check=True, stdout=subprocess.DEVNULL)
                wall = time.perf_counter() - started
                report = json.loads((out / "report.json").read_text())
                found = embeddings(AutoModel.from_pretrained(out).eval())
                stats = {n: cosine_stats(reference[n], found[n]) for n in names}
                accuracy = float((probe.predict(found["probe"].numpy()) == labels).mean())
                cells = "  ".join(f"{stats[n].mean:.4f}/{stats[n].p01:.4f}" for n in names)
                print(f"{rank:>4} {name:<12} {wall:7.1f} {report['seconds']:9.1f}  {cells}  "
                      f"{100 * (accuracy - base_accuracy):+.1f}", flush=True)
                rows.append({"rank": rank, "variant": name, "flags": flags, "wall_seconds": wall,
                             "seconds_past_imports": report["seconds"], "stage_seconds": report.get("stage_seconds"),
                             "cosine": {n: {"mean": stats[n].mean, "p01": stats[n].p01} for n in names},
                             "probe_points": 100 * (accuracy - base_accuracy),
                             "distillation": report.get("distillation")})
    print("cells: mean cosine / 1st-percentile cosine to the original's embeddings")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
