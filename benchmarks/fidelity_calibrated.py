"""Weight-only against calibrated compression at several ranks, on real text we did not calibrate on.

Calibration text: sentences from three quarters of the Brown corpus's documents. Evaluation: sentences from
the held-out quarter. Prints embedding fidelity (mean and 1st-percentile cosine to the original's sentence
embeddings) and Brown genre classification accuracy (logistic regression on the embeddings, trained on
other documents; "own" retrains on the compressed model's embeddings, "swap" keeps the original's
classifier), with the time each compression took.

    python benchmarks/fidelity_calibrated.py --ranks 192,96
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import brown  # noqa: E402

import collab_convert  # noqa: E402
from collab_convert.io.folders import DEFAULT_MODEL, resolve_model  # noqa: E402
from collab_convert.integration.fidelity import cosine_stats, sentence_embeddings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--ranks", default="192,96")
    parser.add_argument("--calibration", type=int, default=512, help="calibration sentences")
    parser.add_argument("--test", type=int, default=2000, help="held-out sentences")
    parser.add_argument("--train", type=int, default=4000, help="classifier training sentences")
    args = parser.parse_args()

    import torch
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoModel, AutoTokenizer

    train_docs, test_docs = brown.split(brown.sentences())
    calibration = brown.sample(train_docs, args.calibration, seed=7)
    train = brown.sample(train_docs, args.train, seed=1)
    test = brown.sample(test_docs, args.test, seed=2)
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def embed(model, items):
        return sentence_embeddings(model, tokenizer, [s.text for s in items])

    original = AutoModel.from_pretrained(folder)
    base_train, base_test = embed(original, train), embed(original, test)
    labels_train = np.array([s.genre for s in train])
    labels_test = np.array([s.genre for s in test])
    base_classifier = LogisticRegression(max_iter=2000, C=10.0).fit(base_train.numpy(), labels_train)
    base_accuracy = float((base_classifier.predict(base_test.numpy()) == labels_test).mean())
    print(f"{len(calibration)} calibration sentences, {len(test)} held-out sentences from other documents")
    print(f"original genre accuracy {base_accuracy:.4f}\n")
    header = f"{'rank':>5} {'fit':<11} {'seconds':>8} {'cos mean':>9} {'cos p1':>8} {'acc own':>8} {'acc swap':>9}"
    print(header)

    with tempfile.TemporaryDirectory() as scratch:
        texts = Path(scratch) / "calibration.txt"
        texts.write_text("\n".join(s.text for s in calibration) + "\n")
        for rank in [int(r) for r in args.ranks.split(",")]:
            for label, extra in (("weight-only", {}), ("calibrated", {"calibration": texts})):
                out = Path(scratch) / f"{label}-{rank}"
                started = time.perf_counter()
                collab_convert.compress(args.model, collab_convert.CompressOptions(rank=rank, output=out, **extra))
                seconds = time.perf_counter() - started
                model = collab_convert.load_model(out)
                emb_train, emb_test = embed(model, train), embed(model, test)
                cos = cosine_stats(base_test, emb_test)
                own = LogisticRegression(max_iter=2000, C=10.0).fit(emb_train.numpy(), labels_train)
                own_accuracy = float((own.predict(emb_test.numpy()) == labels_test).mean())
                swap_accuracy = float((base_classifier.predict(emb_test.numpy()) == labels_test).mean())
                print(
                    f"{rank:>5} {label:<11} {seconds:>8.1f} {cos.mean:>9.4f} {cos.p01:>8.4f} "
                    f"{own_accuracy:>8.4f} {swap_accuracy:>9.4f}",
                    flush=True,
                )
                del model
                torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
