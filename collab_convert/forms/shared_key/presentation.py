"""How the shared-key form's results read: the summary's sentences, its per-layer columns, and analyze's tables."""

from __future__ import annotations

from ...results import AnalysisResult, CompressResult, Table, layer_labels
from ..base import candidate_table


def _rotates(layers) -> bool:
    return any(layer.frequency_ranks if hasattr(layer, "frequency_ranks") else layer.frequency_spectra
               for layer in layers)


def what_it_does() -> tuple[str, str]:
    return ("re-parametrized into the shared-key form",
            "each head keeps its query projection and all heads share one key, so the key cache shrinks")


def rank_sentence(result: CompressResult) -> str:
    widths = [layer.rank for layer in result.layers]
    full = max(layer.cost_before["key_cache_per_token"] for layer in result.layers)  # an encoder's layer caches 0
    spread = f"{min(widths)} to {max(widths)} per layer, " if min(widths) != max(widths) else ""
    how = ("one rotary key across its key heads, frequency by frequency (RoPE stays exact)"
           if _rotates(result.layers) else "one key across its key heads")
    sentence = (f"Every attention layer ({len(result.layers)}) keeps its per-head queries and shares {how}: {spread}"
                f"{sum(widths) / len(widths):.1f} numbers per token on average, of {full} in the original key cache.")
    before = sum(layer.cost_before["parameters"] for layer in result.layers)
    if sum(layer.cost_after["parameters"] for layer in result.layers) >= before:
        sentence += (" The parameters do not shrink (each head's core onto the shared key costs as much as the key "
                     "projection saves, or a QK-norm keeps the key projections): the gain is the key cache.")
    return sentence


def error_line(result: CompressResult) -> str:
    return f"- score energy lost (weighted by the queries that read the keys): {result.mean_relative_error:.4f}"


def compute_line(result: CompressResult) -> str:
    saved = sum(l.cost_before["projection_flops_per_token"] - l.cost_after["projection_flops_per_token"]
                for l in result.layers)
    extra = sum(l.num_heads * l.rank - l.num_heads * l.head_dim for l in result.layers)
    if saved <= 0:
        return ("compute: each head keeps its query projection and scores against the shared key, so the "
                "gains are the key cache and the key projection; scores cost "
                + ("less" if extra <= 0 else "more") + " per key than the original")
    if extra <= 0:
        return "compute: the query/key block costs less per token than the original at every length"
    return (f"compute: the query/key block costs less per token than the original below about {saved // extra:,} "
            "tokens of context and more above (each head scores against the whole shared key)")


def layer_columns(result: CompressResult) -> tuple[list[str], list[list[str]]]:
    rows = [[str(layer.rank), f"{layer.relative_error:.4f}"] for layer in result.layers]
    return ["shared key", "score energy lost"], rows


def report_notes(result: CompressResult) -> list[str]:
    lines = ["", "The shared key is the numbers each token caches per layer. Score energy lost is the share of score "
             "energy (keys weighted by the queries that read them) the dropped shared directions carried."]
    if _rotates(result.layers):
        lines += ["", "Shared complex dimensions per RoPE frequency, fastest frequency first (each costs 2 cached "
                  "numbers), and real pass-through dimensions:", "", "| layer | per frequency | pass-through |",
                  "|---|---|---:|"]
        lines += [f"| {layer.name} | {' '.join(map(str, layer.frequency_ranks))} | {layer.pass_rank} |"
                  for layer in result.layers]
    return lines + ["", "Q/K MACs per token are the multiply-adds of the query/key block for one token at context "
                    "length n: its projections plus its scores against n keys. Each head scores against the whole "
                    "shared key, so long contexts can cost more than the original while the key cache shrinks.", ""]


def analysis_tables(result: AnalysisResult) -> list[Table]:
    labels = layer_labels([layer.name for layer in result.layers])
    rotary = _rotates(result.layers)
    columns = ["layer", "heads x d (key heads)", "shared key"]
    columns += ["strongest frequencies (#0 fastest)"] if rotary else []
    table = Table(f"{result.model} ({result.family}, {'rotary' if rotary else 'absolute positions'}): shared key "
                  "numbers per token holding 90/95/99% of the score energy", columns)
    for layer in result.layers:
        strength = [sum(row) for row in layer.frequency_spectra]
        top = sorted(range(len(strength)), key=lambda j: -strength[j])[:3]
        row = [labels[layer.name], f"{layer.num_heads} x {layer.head_dim} ({layer.kv_heads})",
               "/".join(str(v) for v in layer.energy_ranks["shared_key"].values())]
        table.rows.append(row + ([", ".join(f"#{j} {100 * strength[j]:.0f}%" for j in top)] if rotary else []))
    return [table, candidate_table(result)]


def analysis_advice(result: AnalysisResult) -> str:
    spread = "layers and RoPE frequencies" if _rotates(result.layers) else "layers"
    return ("Rank = the shared key's numbers per token and layer, on average (the key cache); the budget is spread "
            f"over {spread} as compress spreads it. error: share of score energy lost (keys "
            "weighted by the queries that read them), mean over layers.\n"
            f"Next: collab-convert compress {result.model} --key-cache 0.5 --calibration FILE -o OUT")


def spectra(layers) -> list[tuple[str, list[tuple[str, list[float]]]]]:
    """The plots' one panel: each layer's shared key (the queries stay per head). Layer reports carry the kept
    key's scale per slot; an analysis, the score energy per cached number."""
    if layers and hasattr(layers[0], "key_spectrum"):
        return [("Shared key", [(layer.name, layer.key_spectrum) for layer in layers])]
    return [("Shared key", [(layer.name, layer.spectra["shared_key"]) for layer in layers])]
