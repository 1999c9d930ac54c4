"""The one summary of a compressed checkpoint that report.md and the model card both print, so they tell the
same story: the sizes kept, what they save (parameters, key cache), what they cost (query/key compute per token
at a few context lengths, and where it breaks even; time per token where it was measured), and the fidelity
measured, with what it was measured on. The form of the result (forms/) words what only it knows."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..decompose.costs import SEQUENCE_LENGTHS

if TYPE_CHECKING:
    from ..results import CompressResult


def _sum(result: "CompressResult", side: str, key: str) -> int:
    return sum(getattr(layer, side)[key] for layer in result.layers)


def cost_lines(result: "CompressResult", form) -> list[str]:
    terms = form.terms
    before, after = _sum(result, "cost_before", "parameters"), _sum(result, "cost_after", "parameters")
    cache_before = result.cache_before(terms.cache_key)
    cache_after = _sum(result, "cost_after", terms.cache_key)
    lines = [f"- {terms.parameters}: {before:,} -> {after:,} ({_share(after, before)} of the original)"]
    if cache_before:  # an encoder caches nothing: no cache line to print
        lines.append(f"- {terms.cache}, all layers: {cache_before:,} -> {cache_after:,} numbers "
                     f"({_share(cache_after, cache_before)})")
    if result.disk:
        lines.append(disk_line(result.disk))
    per_token = []
    for n in SEQUENCE_LENGTHS:
        b = sum(layer.cost_before["flops_per_token"][str(n)] for layer in result.layers)
        a = sum(layer.cost_after["flops_per_token"][str(n)] for layer in result.layers)
        per_token.append(f"n={n}: {short(b)} -> {short(a)} ({_share(a, b)})")
    lines.append(f"- {terms.compute}: " + "; ".join(per_token))
    lines.append(f"- {form.compute_line(result)}")
    return lines


def disk_line(disk: dict) -> str:
    """The whole model's weights on disk, before and after: what a user who wants a smaller file sees."""
    line = f"- weights on disk: {megabytes(disk['input_bytes'])} -> {megabytes(disk['output_bytes'])}"
    written = disk.get("written_dtype")
    if disk.get("input_gguf_bytes"):
        line += f" (the input was a {megabytes(disk['input_gguf_bytes'])} GGUF file, dequantised to compress it; "
        if written and written != "f32" and not disk.get("dtype_asked"):
            line += f"written in {written}, the precision the file stores its weights in; --dtype f32 keeps float32)"
        else:
            line += f"written in {written or 'f32'})"
    elif written and disk.get("dtype_asked"):
        line += f" (written in {written}, as --dtype asked)"
    return line


def megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"


def fidelity_lines(result: "CompressResult", texts: bool = True) -> list[str]:
    """The fidelity measured, and with `texts` the held-out texts served worst (report.md: the model card, which
    is published with the model, quotes none of the user's text)."""
    figures = result.fidelity
    if not figures:
        return ["- fidelity: not measured here (compress with --calibration measures it on held-out lines); run "
                "`collab-convert verify OUT --texts FILE` on your own text"]
    # the precision the two models ran in: a bfloat16 checkpoint runs in it where the device multiplies it natively
    computed = f" in {figures['computed_in']}" if figures.get("computed_in") else ""
    line = (f"- fidelity, measured on {figures['measured_on']}{computed}: embedding cosine mean "
            f"{figures['cosine_mean']:.4f}, 1st percentile {figures['cosine_p01']:.4f}")
    if figures.get("top1_agreement") is not None:
        line += f"; next-token top-1 agreement {figures['top1_agreement']:.4f}, KL {figures['kl_mean']:.4f}"
    # the held-out lines are the calibration text's own kind: across domains the figures fall (issue 34's
    # measurements, docs/benchmarks.md), so the figure says so and where to measure the text the model will serve
    line += (" (text like the calibration text; other text can score lower: measure yours with "
             "`collab-convert verify OUT --texts FILE`)")
    return [line, *(worst_lines(figures.get("worst_texts")) if texts else [])]


def worst_lines(worst: list[dict] | None, texts: str = "held-out texts") -> list[str]:
    """The texts the model serves worst, lowest cosine first: where a user sees it suffer."""
    if not worst:
        return []
    return [f"- the {len(worst)} {texts} with the lowest embedding cosine:",
            *(f"  - {text['cosine']:.4f}: {text['text']}" for text in worst)]


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


def summary_lines(result: "CompressResult", form, texts: bool = True) -> list[str]:
    """`form` (forms/, the result's form) words what only it knows: the sizes kept, the compute trade-off, the
    error its fits left. `texts`: quote the held-out texts served worst (not in the model card)."""
    return [form.rank_sentence(result), "", *cost_lines(result, form), *runtime_lines(result),
            *fidelity_lines(result, texts), form.error_line(result),
            *(f"- warning: {warning}" for warning in result.warnings or [])]


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def short(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)
