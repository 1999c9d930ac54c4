"""report.json and report.md of a compressed checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..decompose.costs import SEQUENCE_LENGTHS
from .summary import _short, summary_lines

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


def write_reports(result: "CompressResult", folder: Path) -> list[str]:
    (folder / "report.json").write_text(result_json(result) + "\n", encoding="utf-8")
    (folder / "report.md").write_text(markdown_report(result), encoding="utf-8")
    return ["report.json", "report.md"]


def markdown_report(result: "CompressResult") -> str:
    lines = [
        f"# Collaborative attention report: {result.model}",
        "",
        *summary_lines(result),
        f"- {_how(result)} (collab-convert {result.tool_version}); family: {result.family}",
        f"- time: {result.seconds:.1f} s" + _stages(result.stage_seconds)
        + (f"; CPU threads: {result.threads['threads']} ({result.threads['why']})" if result.threads else ""),
    ]
    if result.calibration:
        tokens = result.calibration.get("tokens")
        lines += [
            f"- calibration: {result.calibration['examples']} examples"
            + (f" ({tokens:,} tokens)" if tokens else "") + f" from {result.calibration['source']}; "
            f"fitted to the {result.calibration['objective']}",
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
    lines += [
        "",
        "| layer | rank | relative error | per-head truncation | params before | params after | "
        + " | ".join(f"Q/K MACs per token n={n} before/after" for n in SEQUENCE_LENGTHS)
        + " | key cache / token before/after |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(SEQUENCE_LENGTHS) + "---:|",
    ]
    for layer in result.layers:
        scores = [
            f"{_short(layer.cost_before['flops_per_token'][str(n)])} / "
            f"{_short(layer.cost_after['flops_per_token'][str(n)])}"
            for n in SEQUENCE_LENGTHS
        ]
        truncation = layer.per_head_truncation_error
        lines.append(
            f"| {layer.name} | {layer.rank} | {layer.relative_error:.4f} | "
            f"{'-' if math.isnan(truncation) else f'{truncation:.4f}'} | {layer.parameters_before:,} | "
            f"{layer.parameters_after:,} | "
            + " | ".join(scores)
            + f" | {layer.cost_before['key_cache_per_token']} / {layer.cost_after['key_cache_per_token']} |"
        )
    lines += _rotary_lines(result)
    shared_key = all(layer.frequency_ranks is not None for layer in result.layers)
    lines += [
        "",
        ("" if shared_key else "Relative error is ||T - T~||_F / ||T||_F over the stacked per-head products "
         "T[i] = W_Q^(i) W_K^(i)^T. ")
        + "Q/K MACs per token are the multiply-adds of the query/key block for one token at context length n: its "
        "projections plus its scores against n keys. "
        + ("Each head scores against the R-wide shared key, so long contexts can cost more than the original while "
           "the key cache shrinks." if shared_key else "Collaborative heads score in R+1 dimensions each, so long "
           "contexts can cost more than the original while parameters and the key cache shrink."),
        "",
    ]
    return "\n".join(lines)


def _how(result: "CompressResult") -> str:
    return f"method: {result.method}" if result.method else f"form: {result.form}"


def _stages(seconds: dict[str, float] | None) -> str:
    if not seconds:
        return ""
    return " (" + ", ".join(f"{stage} {value:.1f} s" for stage, value in seconds.items() if value >= 0.05) + ")"


def _rotary_lines(result: "CompressResult") -> list[str]:
    """Rotary layers: how each layer's shared key splits over RoPE frequencies (fastest first)."""
    rotary = [layer for layer in result.layers if layer.frequency_ranks is not None]
    if not rotary:
        return []
    if not any(layer.frequency_ranks for layer in rotary):  # absolute positions: one real shared subspace
        return ["", "For shared-key layers, relative error is the share of score energy (keys weighted by the "
                "queries that read them) the dropped shared directions carried; the rank is the shared key's "
                "numbers per token."]
    lines = ["", "For rotary layers, relative error is the share of score energy (keys weighted by the queries that "
             "read them) the dropped shared directions carried. Shared complex dimensions per RoPE frequency, "
             "fastest frequency first (each costs 2 cached numbers), and real pass-through dimensions:", "",
             "| layer | per frequency | pass-through |", "|---|---|---:|"]
    for layer in rotary:
        lines.append(f"| {layer.name} | {' '.join(map(str, layer.frequency_ranks))} | {layer.pass_rank} |")
    return lines


def _distillation_lines(distillation: dict | None) -> list[str]:
    if not distillation:
        return []
    d = distillation
    return [f"- distillation (every layer together, next-token KL against the original on {d['held_out_sequences']} "
            f"held-out calibration texts): {d['kl_before']:.4f} -> {d['kl_after']:.4f} nats per token; best of "
            f"{d['steps']} Adam steps at step {d['best_step']}, {d['parameters_tuned']:,} parameters tuned on "
            f"{d['sequences']} texts"]
