"""Ours against the paper's re-parametrization at the same rank, on all-MiniLM-L6-v2 and real text.

Prints, from one run: time to compress, mean relative error of the head products, embedding fidelity
(mean and 1st-percentile cosine to the original's sentence embeddings on held-out Brown sentences), and two
downstream tasks on held-out documents:
- genre: Brown genre classification (15 genres) by logistic regression on sentence embeddings, trained on
  other documents;
- retrieval: for each held-out sentence, is its nearest neighbour among the other held-out sentences from
  the same document (precision@1, no training at all)?
Each is given two ways: "own" (classifier trained on / index built with the compressed model's own
embeddings) and "swap" (the original's classifier / index, queried with the compressed model's embeddings:
a drop-in replacement in a deployed system).

    python benchmarks/fidelity_vs_paper.py --rank 192
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
    parser.add_argument("--rank", type=int, default=192)
    parser.add_argument("--train", type=int, default=4000, help="training sentences for the genre classifier")
    parser.add_argument("--test", type=int, default=2000, help="held-out sentences (fidelity and accuracy)")
    parser.add_argument("--tolerance", type=float, default=None, help="ALS tolerance for ours (default: the tool's)")
    parser.add_argument("--skip-paper", action="store_true", help="skip the slow reference method")
    args = parser.parse_args()

    import torch
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    train_docs, test_docs = brown.split(brown.sentences())
    train = brown.sample(train_docs, args.train, seed=1)
    test = brown.sample(test_docs, args.test, seed=2)
    print(f"Brown corpus: {len(train)} training and {len(test)} held-out sentences (split by document)")

    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    original = AutoModel.from_pretrained(folder)

    def embed(model):
        return (
            sentence_embeddings(model, tokenizer, [s.text for s in train]).numpy(),
            sentence_embeddings(model, tokenizer, [s.text for s in test]).numpy(),
        )

    documents = np.array([s.document for s in test])

    labels_train = np.array([s.genre for s in train])
    labels_test = np.array([s.genre for s in test])
    base_train, base_test = embed(original)
    base_classifier = LogisticRegression(max_iter=2000, C=10.0).fit(base_train, labels_train)
    base_accuracy = float((base_classifier.predict(base_test) == labels_test).mean())
    base_retrieval = same_document_precision(base_test, base_test, documents)
    print(f"original: genre accuracy {base_accuracy:.4f}, same-document retrieval P@1 {base_retrieval:.4f}")

    methods = ["tucker-cp-als"] + ([] if args.skip_paper else ["reference-parafac"])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for method in methods:
            out = Path(scratch) / method
            started = time.perf_counter()
            options = dict(rank=args.rank, output=out, method=method)
            if args.tolerance is not None:
                options["tolerance"] = args.tolerance
            result = collab_convert.compress(args.model, collab_convert.CompressOptions(**options))
            seconds = time.perf_counter() - started
            model = collab_convert.load_model(out)
            emb_train, emb_test = embed(model)
            cos = cosine_stats(torch.from_numpy(base_test), torch.from_numpy(emb_test))
            own = LogisticRegression(max_iter=2000, C=10.0).fit(emb_train, labels_train)
            own_accuracy = float((own.predict(emb_test) == labels_test).mean())
            swap_accuracy = float((base_classifier.predict(emb_test) == labels_test).mean())
            retrieval = (
                same_document_precision(emb_test, emb_test, documents),
                same_document_precision(emb_test, base_test, documents),
            )
            rows.append((method, seconds, result, cos, own_accuracy, swap_accuracy, retrieval))

    print()
    print(f"rank {args.rank}, {args.model}")
    header = (
        f"{'method':<20} {'seconds':>8} {'mean rel err':>12} {'cos mean':>9} {'cos p1':>8} "
        f"{'genre own':>9} {'genre swap':>10} {'retr own':>8} {'retr swap':>9} {'QK params':>10}"
    )
    print(header)
    for method, seconds, result, cos, own_accuracy, swap_accuracy, retrieval in rows:
        print(
            f"{method:<20} {seconds:>8.1f} {result.mean_relative_error:>12.4f} {cos.mean:>9.4f} {cos.p01:>8.4f} "
            f"{own_accuracy:>9.4f} {swap_accuracy:>10.4f} {retrieval[0]:>8.4f} {retrieval[1]:>9.4f} "
            f"{result.parameters_after:>10,}"
        )
    print(f"{'original':<20} {'':>8} {0.0:>12.4f} {1.0:>9.4f} {1.0:>8.4f} {base_accuracy:>9.4f} "
          f"{base_accuracy:>10.4f} {base_retrieval:>8.4f} {base_retrieval:>9.4f} "
          f"{rows[0][2].parameters_before:>10,}")
    if len(rows) == 2:
        ours, paper = rows
        print(
            f"\nspeed-up {paper[1] / ours[1]:.1f}x; error ratio ours/paper "
            f"{ours[2].mean_relative_error / paper[2].mean_relative_error:.3f}"
        )


def same_document_precision(queries: np.ndarray, index: np.ndarray, documents: np.ndarray) -> float:
    """Share of sentences whose nearest other sentence (cosine) comes from the same document."""
    similarity = queries @ index.T
    np.fill_diagonal(similarity, -np.inf)
    return float((documents[similarity.argmax(1)] == documents).mean())


if __name__ == "__main__":
    main()
