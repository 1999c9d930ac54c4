"""The one summary of a compressed checkpoint that report.md and the model card both print, so they tell the
same story: the rank, what it saves (parameters, key cache), what it costs (query/key compute per token at a
few context lengths, and where it breaks even; time per token where it was measured), and the fidelity
measured, with what it was measured on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..decompose.costs import SEQUENCE_LENGTHS

if TYPE_CHECKING:
    from ..results import CompressResult


def _sum(result: "CompressResult", side: str, key: str) -> int:
    return sum(getattr(layer, side)[key] for layer in result.layers)


def _rotary(result: "CompressResult") -> bool:
    return any(layer.frequency_ranks is not None for layer in result.layers)


def _rotary_sentence(result: "CompressResult") -> str:
    widths = [layer.rank for layer in result.layers]
    full = max(layer.cost_before["key_cache_per_token"] for layer in result.layers)  # an encoder's layer caches 0
    spread = f"{min(widths)} to {max(widths)} per layer, " if min(widths) != max(widths) else ""
    how = ("one rotary key across its key heads, frequency by frequency (RoPE stays exact)"
           if any(layer.frequency_ranks for layer in result.layers) else "one key across its key heads")
    sentence = (f"Every attention layer ({len(result.layers)}) keeps its per-head queries and shares {how}: {spread}"
                f"{sum(widths) / len(widths):.1f} numbers per token on average, of {full} in the original key cache.")
    if _sum(result, "cost_after", "parameters") >= _sum(result, "cost_before", "parameters"):
        sentence += (" The parameters do not shrink (each head's core onto the shared key costs as much as the key "
                     "projection saves, or a QK-norm keeps the key projections): the gain is the key cache.")
    return sentence


def rank_sentence(result: "CompressResult") -> str:
    if _rotary(result):
        return _rotary_sentence(result)
    ranks = sorted({layer.rank for layer in result.layers})
    full = sorted({layer.num_heads * layer.head_dim for layer in result.layers})
    shown = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]} to {ranks[-1]} (per layer)"
    of = str(full[0]) if len(full) == 1 else "/".join(map(str, full))
    how = ""
    if result.rank_choice and result.rank_choice["mode"] == "fidelity target":
        choice = result.rank_choice
        how = (f", the smallest reaching an embedding cosine of {choice['target_cosine']} "
               f"(estimated {choice['estimated_cosine_mean']:.4f} before refinement, on {choice['probe']})")
    elif result.rank_choice:
        how = f", keeping {result.rank_choice['energy']:.0%} of each layer's energy"
    return (f"Every attention layer ({len(result.layers)}) shares a query and a key projection of rank {shown} "
            f"(full rank, where the form is exact: {of}){how}.")


def cost_lines(result: "CompressResult") -> list[str]:
    before, after = _sum(result, "cost_before", "parameters"), _sum(result, "cost_after", "parameters")
    cache_before = _sum(result, "cost_before", "key_cache_per_token")
    cache_after = _sum(result, "cost_after", "key_cache_per_token")
    lines = [
        f"- query/key parameters: {before:,} -> {after:,} ({_share(after, before)} of the original)",
        f"- key cache per token (decoders), all layers: {cache_before:,} -> {cache_after:,} numbers "
        f"({_share(cache_after, cache_before)})",
    ]
    per_token = []
    for n in SEQUENCE_LENGTHS:
        b = sum(layer.cost_before["flops_per_token"][str(n)] for layer in result.layers)
        a = sum(layer.cost_after["flops_per_token"][str(n)] for layer in result.layers)
        per_token.append(f"n={n}: {_short(b)} -> {_short(a)} ({_share(a, b)})")
    lines.append("- query/key multiply-adds per token (projections plus scores against n keys): " + "; ".join(per_token))
    lines.append(f"- {_break_even(result)}")
    return lines


def _break_even(result: "CompressResult") -> str:
    saved = sum(l.cost_before["projection_flops_per_token"] - l.cost_after["projection_flops_per_token"]
                for l in result.layers)
    extra = sum(l.num_heads * (l.rank + (0 if l.frequency_ranks is not None else 1)) - l.num_heads * l.head_dim
                for l in result.layers)
    if saved <= 0 and _rotary(result):
        return ("compute: each head keeps its query projection and scores against the shared key, so the "
                "gains are the key cache and the key projection; scores cost "
                + ("less" if extra <= 0 else "more") + " per key than the original")
    if saved <= 0:
        return ("compute: every head scores in R + 1 dimensions, so the query/key block costs more per token than "
                "the original at every length; the gains are parameters and the key cache")
    if extra <= 0:
        return "compute: the query/key block costs less per token than the original at every length"
    return (f"compute: the query/key block costs less per token than the original below about {saved // extra:,} "
            "tokens of context and more above (each head scores in R + 1 dimensions)")


def fidelity_lines(result: "CompressResult") -> list[str]:
    figures = result.fidelity
    if not figures:
        return ["- fidelity: not measured here; run `collab-convert verify OUT --against MODEL --texts FILE` "
                "on your own text"]
    line = (f"- fidelity, measured on {figures['measured_on']}: embedding cosine mean {figures['cosine_mean']:.4f}, "
            f"1st percentile {figures['cosine_p01']:.4f}")
    if figures.get("top1_agreement") is not None:
        line += f"; next-token top-1 agreement {figures['top1_agreement']:.4f}, KL {figures['kl_mean']:.4f}"
    return [line]


def runtime_lines(result: "CompressResult") -> list[str]:
    """Time per token measured side by side (--timing), or where to get it: MACs alone do not tell the time."""
    runtime = result.runtime
    if not runtime:
        return ["- time per token: not measured here; compress with --timing to measure the original and the "
                "result side by side on this machine"]
    if runtime.get("skipped"):
        return [f"- time per token: not measured ({runtime['skipped']})"]
    rows = "; ".join(f"n={row['tokens']}: {row['original_ms']:.3g} -> {row['collaborative_ms']:.3g} ms "
                     f"({row['ratio']:.2f}x)" for row in runtime["lengths"])
    return [f"- time per token, measured here ({runtime['measure']}; CPU, {runtime['threads']} threads, median of "
            f"{runtime['repeats']}): {rows}"]


def summary_lines(result: "CompressResult") -> list[str]:
    error = (f"- score energy lost (weighted by the queries that read the keys): {result.mean_relative_error:.4f}"
             if _rotary(result) else f"- mean relative error of the head products: {result.mean_relative_error:.4f}")
    return [rank_sentence(result), "", *cost_lines(result), *runtime_lines(result), *fidelity_lines(result), error]


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _short(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)
