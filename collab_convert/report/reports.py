"""report.json and report.md of a compressed checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..decompose.costs import SEQUENCE_LENGTHS
from .summary import short, summary_lines

if TYPE_CHECKING:
    from ..results import CompressResult


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def result_json(result: "CompressResult", indent: int | None = 2) -> str:
    return json.dumps(_json_safe(result.to_dict()), indent=indent)


def write_reports(result: "CompressResult", form, folder: Path) -> list[str]:
    (folder / "report.json").write_text(result_json(result) + "\n", encoding="utf-8")
    (folder / "report.md").write_text(markdown_report(result, form), encoding="utf-8")
    return ["report.json", "report.md"]


def _recounted(threads: dict) -> str:
    """The time line's note where the threads followed the idle cores during the run (threads.ThreadGovernor)."""
    if not threads.get("changes"):
        return ""
    used = threads["counts_used"]
    return (f", then {used[0]} to {used[-1]} as other jobs came and went ({threads['changes']} "
            f"change{'s' if threads['changes'] > 1 else ''})")


def _huge_pages(threads: dict) -> str:
    """The time line's note on torch's huge pages, where its allocator took the setting (cpu.huge_pages_on)."""
    if not threads.get("huge_pages"):
        return ""
    kernel = threads.get("huge_pages_kernel")
    given = f"; the kernel's setting: {kernel}" if kernel else ""
    if kernel == "never":
        given += ", so none are given"
    return f"; huge pages asked for (torch's THP_MEM_ALLOC_ENABLE, taken by its allocator{given})"


def markdown_report(result: "CompressResult", form) -> str:
    """report.md; `form` (forms/, the result's form) gives its own per-layer columns and notes."""
    lines = [
        f"# Collaborative attention report: {result.model}",
        "",
        *summary_lines(result, form),
        f"- {_how(result)} (collab-convert {result.tool_version}); family: {result.family}",
        f"- time: {result.seconds:.1f} s" + _stages(result.stage_seconds)
        + (f"; CPU threads: {result.threads['threads']} ({result.threads['why']}){_recounted(result.threads)}"
           if result.threads else "")
        + _huge_pages(result.threads or {}),
    ]
    if result.calibration:
        lines += _calibration_lines(result)
    columns, cells = form.layer_columns(result)
    terms = form.terms
    cached = bool(result.cache_before(terms.cache_key))
    lines += [
        "",
        "| layer | " + " | ".join(columns) + " | params before | params after | "
        + " | ".join(f"{terms.compute_short} n={n} before/after" for n in SEQUENCE_LENGTHS)
        + (f" | {terms.cache_short} before/after |" if cached else " |"),
        "|---|" + "---:|" * (len(columns) + 2 + len(SEQUENCE_LENGTHS) + cached),
    ]
    for layer, own in zip(result.layers, cells, strict=True):
        scores = [
            f"{short(layer.cost_before['flops_per_token'][str(n)])} / "
            f"{short(layer.cost_after['flops_per_token'][str(n)])}"
            for n in SEQUENCE_LENGTHS
        ]
        lines.append(
            f"| {layer.name} | " + " | ".join(own) + f" | {layer.parameters_before:,} | {layer.parameters_after:,} | "
            + " | ".join(scores)
            + (f" | {layer.cost_before[terms.cache_key]} / {layer.cost_after[terms.cache_key]} |" if cached else " |")
        )
    return "\n".join(lines + form.report_notes(result))


def _calibration_lines(result: "CompressResult") -> list[str]:
    tokens = result.calibration.get("tokens")
    lines = [
        f"- calibration: {result.calibration['examples']} examples"
        + (f" ({tokens:,} tokens)" if tokens else "") + f" from {result.calibration['source']}"
        + (f" ({repeats} repeated lines read once)" if (repeats := result.calibration.get("repeated_lines_dropped"))
           else "") + f"; fitted to the {result.calibration['objective']}",
        f"- refinement: {result.calibration.get('refinement', 'off')}",
    ]
    lines += _distillation_lines(result.distillation)
    lines += ["", "| layer | logit error | attention KL before / after refinement | refinement steps |",
              "|---|---:|---:|---:|"]
    for layer in result.layers:
        kl = layer.refinement
        shown = f"{kl['kl_before']:.4f} / {kl['kl_after']:.4f}" if kl else "-"
        logit = "-" if layer.logit_error is None else f"{layer.logit_error:.4f}"
        lines.append(f"| {layer.name} | {logit} | {shown} | {kl['steps'] if kl else '-'} |")
    return lines


def _how(result: "CompressResult") -> str:
    return f"method: {result.method}" if result.method else f"form: {result.form}"


def _stages(seconds: dict[str, float] | None) -> str:
    if not seconds:
        return ""
    return " (" + ", ".join(f"{stage} {value:.1f} s" for stage, value in seconds.items() if value >= 0.05) + ")"


def _distillation_lines(distillation: dict | None) -> list[str]:
    if not distillation:
        return []
    d = distillation
    return [f"- distillation (every layer together, {d['objective']}): {d['held_out_measure']} on "
            f"{d['held_out_sequences']} held-out calibration texts {d['before']:.4f} -> {d['after']:.4f}; best of "
            f"{d['steps']} Adam steps at step {d['best_step']}, {d['parameters_tuned']:,} parameters tuned on "
            f"{d['sequences']} texts" + (f", {d['seconds_per_step']:.2f} s a step" if "seconds_per_step" in d else "")]
