"""How the CP form's results read: the summary's sentences, its per-layer columns, and analyze's tables."""

from __future__ import annotations

import math

from ...results import AnalysisResult, CompressResult, Table, layer_labels
from ..base import candidate_table


def what_it_does() -> tuple[str, str]:
    return ("re-parametrized into collaborative multi-head attention (Cordonnier, Loukas and Jaggi, 2020)",
            "heads share one query and one key projection and each head keeps a mixing vector")


def rank_sentence(result: CompressResult) -> str:
    ranks = sorted({layer.rank for layer in result.layers})
    full = sorted({layer.num_heads * layer.head_dim for layer in result.layers})
    shown = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]} to {ranks[-1]} (per layer)"
    of = str(full[0]) if len(full) == 1 else "/".join(map(str, full))
    how = ""
    if result.rank_choice and result.rank_choice["mode"] == "fidelity target":
        choice = result.rank_choice
        how = (f", the smallest reaching an embedding cosine of {choice['target_cosine']} "
               f"(estimated {choice['estimated_cosine_mean']:.4f} before refinement, on {choice['probe']})")
    elif result.rank_choice and result.rank_choice["mode"] == "energy spread":
        how = (f", {result.rank_choice['total']} in all spread over the layers where they keep the most "
               f"{result.rank_choice['energy']}")
    elif result.rank_choice:
        how = f", keeping {result.rank_choice['energy']:.0%} of each layer's energy"
    return (f"Every attention layer ({len(result.layers)}) shares a query and a key projection of rank {shown} "
            f"(full rank, where the form is exact: {of}){how}.")


def error_line(result: CompressResult) -> str:
    line = f"- weight error (relative error of the head products, mean over layers): {result.mean_relative_error:.4f}"
    if result.calibration:  # the calibrated fit trades weight error for output fidelity: say which to read
        line += " (a calibrated fit targets the outputs on real text, not the weights: read the fidelity measured)"
    return line


def compute_line(result: CompressResult) -> str:
    saved = sum(l.cost_before["projection_flops_per_token"] - l.cost_after["projection_flops_per_token"]
                for l in result.layers)
    extra = sum(l.num_heads * (l.rank + 1) - l.num_heads * l.head_dim for l in result.layers)
    if saved <= 0:
        return ("compute: every head scores in R + 1 dimensions, so the query/key block costs more per token than "
                "the original at every length; the gains are parameters and the key cache")
    if extra <= 0:
        return "compute: the query/key block costs less per token than the original at every length"
    return (f"compute: the query/key block costs less per token than the original below about {saved // extra:,} "
            "tokens of context and more above (each head scores in R + 1 dimensions)")


def layer_columns(result: CompressResult) -> tuple[list[str], list[list[str]]]:
    rows = []
    for layer in result.layers:
        truncation = layer.per_head_truncation_error
        rows.append([str(layer.rank), f"{layer.relative_error:.4f}",
                     "-" if math.isnan(truncation) else f"{truncation:.4f}"])
    return ["rank", "relative error", "per-head truncation"], rows


def report_notes(result: CompressResult) -> list[str]:
    shrink = "parameters and the key cache shrink" if result.cache_before() else "parameters shrink"
    return ["", "Relative error is ||T - T~||_F / ||T||_F over the stacked per-head products T[i] = W_Q^(i) "
            "W_K^(i)^T. Q/K MACs per token are the multiply-adds of the query/key block for one token at context "
            "length n: its projections plus its scores against n keys. Collaborative heads score in R+1 dimensions "
            f"each, so long contexts can cost more than the original while {shrink}.", ""]


def analysis_tables(result: AnalysisResult) -> list[Table]:
    labels = layer_labels([layer.name for layer in result.layers])
    table = Table(f"{result.model} ({result.family}): shared dimensions holding 90/95/99% of the energy",
                  ["layer", "heads x d_k", "query side", "key side"])
    for layer in result.layers:
        table.rows.append([labels[layer.name], f"{layer.num_heads} x {layer.head_dim}",
                           "/".join(str(v) for v in layer.energy_ranks["query_unfolding"].values()),
                           "/".join(str(v) for v in layer.energy_ranks["key_unfolding"].values())])
    return [table, candidate_table(result)]


def analysis_advice(result: AnalysisResult) -> str:
    lines = ["error: relative error of the head products after the fit (mean over layers)"
             + ("; logit error: share of attention-logit energy lost on the calibration text" if any(
                 p.mean_logit_error is not None for p in result.predictions) else "") + "."]
    if result.probe:
        lines.append(f"cosine: embeddings of the compressed model against the original on {result.probe} "
                     "(before refinement, which only improves them).")
    if result.target:
        t = result.target
        lines.append(f"Smallest rank reaching cosine {t['target_cosine']}: {t['rank']} "
                     f"(measured {t['cosine_mean']:.4f} mean, {t['cosine_p01']:.4f} 1st percentile).")
        lines.append(f"Next: collab-convert compress {result.model} --rank {t['rank']} -o OUT")
    else:
        lines.append("Next: collab-convert analyze MODEL --target-cosine 0.99 names the rank that keeps embeddings "
                     "that close, or collab-convert compress MODEL --rank auto -o OUT picks it.")
    if "shared-key" in result.forms:
        lines.append(f"For the KV cache: collab-convert analyze {result.model} --form shared-key (each head keeps its "
                     "query and one key is shared: the most fidelity per cached key number).")
    return "\n".join(lines)


def spectra(layers) -> list[tuple[str, list[tuple[str, list[float]]]]]:
    """The plots' panels: the query- and key-side unfoldings of each layer's head products (layer reports carry
    their singular values; an analysis, all its spectra)."""
    if layers and hasattr(layers[0], "query_spectrum"):
        query, key = [(l.name, l.query_spectrum) for l in layers], [(l.name, l.key_spectrum) for l in layers]
    else:
        query = [(l.name, l.spectra["query_unfolding"]) for l in layers]
        key = [(l.name, l.spectra["key_unfolding"]) for l in layers]
    return [("Stacked head products, query side", query), ("Stacked head products, key side", key)]
