"""report.json, report.md and the model card of a compressed checkpoint."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint import EMBEDDED_MODELS, readme_front_matter
from .costs import SEQUENCE_LENGTHS

if TYPE_CHECKING:
    from .pipeline import CompressResult, LoadedModel


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
        f"- method: {result.method} (collab-convert {result.tool_version})",
        f"- family: {result.family}; {len(result.layers)} attention layers",
        f"- query/key parameters: {result.parameters_before:,} -> {result.parameters_after:,} "
        f"({_percent(result.parameters_after, result.parameters_before)} of the original)",
        f"- mean relative error of the head products: {result.mean_relative_error:.4f}",
        f"- time: {result.seconds:.1f} s",
    ]
    if result.calibration:
        lines += [
            f"- calibration: {result.calibration['examples']} examples from {result.calibration['source']}; "
            f"fitted to the {result.calibration['objective']}",
            f"- refinement: {result.calibration.get('refinement', 'off')}",
        ]
        lines += ["", "| layer | logit error | attention KL before / after refinement |", "|---|---:|---:|"]
        for layer in result.layers:
            kl = layer.refinement
            shown = f"{kl['kl_before']:.4f} / {kl['kl_after']:.4f}" if kl else "-"
            lines.append(f"| {layer.name} | {layer.logit_error:.4f} | {shown} |")
    lines += [
        "",
        "| layer | rank | relative error | per-head truncation | params before | params after | "
        + " | ".join(f"score MACs n={n} before/after" for n in SEQUENCE_LENGTHS)
        + " | key cache / token before/after |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(SEQUENCE_LENGTHS) + "---:|",
    ]
    for layer in result.layers:
        scores = [
            f"{_short(layer.cost_before['score_flops'][str(n)])} / {_short(layer.cost_after['score_flops'][str(n)])}"
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
    lines += [
        "",
        "Relative error is ||T - T~||_F / ||T||_F over the stacked per-head products T[i] = W_Q^(i) W_K^(i)^T. "
        "Score MACs are multiply-adds for all heads' attention scores at sequence length n: collaborative heads "
        "score in R+1 dimensions each, so long sequences can cost more than the original.",
        "",
    ]
    return "\n".join(lines)


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _short(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def write_model_card(result: "CompressResult", loaded: "LoadedModel", folder: Path) -> list[str]:
    original = readme_front_matter(loaded.folder)
    base = _base_model_id(result.model, loaded)
    front = {
        "base_model": base,
        # The Hub knows adapter/merge/quantized/finetune; the transform loads through a quantization config.
        "base_model_relation": "quantized",
        "library_name": original.get("library_name", "transformers"),
        "tags": sorted(set((original.get("tags") or []) + ["collaborative-attention", "collab-convert"])),
    }
    if original.get("license") or loaded.config.get("license"):
        front["license"] = original.get("license") or loaded.config.get("license")
    if original.get("pipeline_tag"):
        front["pipeline_tag"] = original["pipeline_tag"]
    import yaml

    command = " ".join(shlex.quote(a) for a in ["collab-convert", *sys.argv[1:]]) if _from_cli() else None
    body = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {base or result.model} with collaborative attention",
        "",
        f"Every attention layer of `{result.model}` was re-parametrized into collaborative multi-head attention "
        "(Cordonnier, Loukas and Jaggi, 2020) by collab-convert "
        f"{result.tool_version}: heads share one query and one key projection and each head keeps a mixing "
        "vector.",
        "",
        f"- query/key parameters: {result.parameters_before:,} -> {result.parameters_after:,}",
        f"- mean relative error of the head products: {result.mean_relative_error:.4f}",
        "",
        "Load it after `import collab_convert` with the usual Auto classes, or with `collab_convert.load_model`.",
        "Details per layer are in report.md.",
        "",
    ]
    if command:
        body += ["Produced by:", "", "```", command, "```", ""]
    (folder / "README.md").write_text("\n".join(body), encoding="utf-8")
    return ["README.md"]


def _from_cli() -> bool:
    return Path(sys.argv[0]).name in ("collab-convert", "collab_convert") or sys.argv[0].endswith("__main__.py")


def _base_model_id(model: str, loaded: "LoadedModel") -> str | None:
    if model in EMBEDDED_MODELS or (not Path(model).expanduser().exists() and "/" in model):
        return model
    name = loaded.config.get("_name_or_path")
    return name if isinstance(name, str) and name and not Path(name).is_absolute() else None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def plot_spectra(layers: list[tuple[str, list[float], list[float]]], path: Path, rank: int | None = None) -> None:
    """Cumulative energy of the query- and key-side spectra per layer, with the chosen rank marked."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, side, index in ((axes[0], "query side", 1), (axes[1], "key side", 2)):
        for layer in layers:
            energy = [v * v for v in layer[index]]
            total = sum(energy) or 1.0
            running, cumulative = 0.0, []
            for value in energy:
                running += value
                cumulative.append(running / total)
            axis.plot(range(1, len(cumulative) + 1), cumulative, label=layer[0], linewidth=1.2)
        for share in (0.90, 0.95, 0.99):
            axis.axhline(share, color="grey", linewidth=0.6, linestyle=":")
        if rank is not None:
            axis.axvline(rank, color="black", linewidth=1.0, linestyle="--", label=f"rank {rank}")
        axis.set_title(f"Stacked head products, {side}")
        axis.set_xlabel("shared dimensions")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("share of energy")
    axes[1].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_errors(result: "CompressResult", path: Path) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(5, 0.6 * len(result.layers) + 2), 3.8))
    positions = range(len(result.layers))
    truncation = [layer.per_head_truncation_error for layer in result.layers]
    axis.bar([p - 0.2 for p in positions], [layer.relative_error for layer in result.layers], 0.4, label=result.method)
    if not all(math.isnan(t) for t in truncation):
        axis.bar([p + 0.2 for p in positions], truncation, 0.4, label="per-head truncation", color="lightgrey")
    axis.set_xticks(list(positions))
    axis.set_xticklabels([_short_name(layer.name) for layer in result.layers], rotation=45, ha="right", fontsize=7)
    axis.set_ylabel("relative error of head products")
    axis.set_title(f"Per-layer error at rank {result.layers[0].rank if result.layers else '-'}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _short_name(name: str) -> str:
    import re

    numbers = re.findall(r"\d+", name)
    return f"layer {'.'.join(numbers)}" if numbers else name


def write_plots(result: "CompressResult", folder: Path) -> list[str]:
    layers = [(_short_name(layer.name), layer.query_spectrum, layer.key_spectrum) for layer in result.layers]
    plot_spectra(layers, folder / "spectra.png", rank=result.layers[0].rank if result.layers else None)
    plot_errors(result, folder / "errors.png")
    return ["spectra.png", "errors.png"]
