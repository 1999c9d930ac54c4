"""How the multi-query form's results read: the summary's sentences, its per-layer columns, and analyze's tables."""

from __future__ import annotations

from ...results import AnalysisResult, CompressResult, Table, layer_labels
from .serving import engines_sentence


def what_it_does() -> tuple[str, str]:
    return ("rewritten as stock multi-query attention",
            "one key/value head per layer holds a shared rotary key and a value latent that every query head reads; "
            "the checkpoint loads in transformers without collab-convert and exports to llama.cpp")


def rank_sentence(result: CompressResult) -> str:
    first = result.layers[0]
    width, before = first.rank, first.kv_heads * first.head_dim
    sentence = (f"Every attention layer ({len(result.layers)}) keeps one key/value head of {width} numbers per token "
                f"(it had {first.kv_heads} of {first.head_dim}): {width / before:.0%} of the KV cache. The key's "
                f"{width // 2} complex dimensions turn at the model's own RoPE frequencies "
                f"({_profile(first.frequency_ranks)}); every query head is {width} wide.")
    if width > first.head_dim:
        sentence += (f" The query and output projections grow by {width / first.head_dim:.2f}x (each head reads "
                     "the whole key and value), so the parameters may grow while the cache shrinks.")
    return sentence + f" {engines_sentence(width)}."


def _profile(ranks: list[int]) -> str:
    kept = [(j, r) for j, r in enumerate(ranks) if r]
    return f"{len(kept)} of {len(ranks)} frequencies kept, fastest first: " + " ".join(str(r) for r in ranks)


def error_line(result: CompressResult) -> str:
    layers = len(result.layers) or 1
    values = sum(layer.value_lost_energy for layer in result.layers) / layers
    return (f"- score energy of the keys lost: {result.mean_relative_error:.4f}; output energy of the values lost by "
            f"their PCA (before refinement): {values:.4f} (means over layers)")


def compute_line(result: CompressResult) -> str:
    saved = sum(l.cost_before["projection_flops_per_token"] - l.cost_after["projection_flops_per_token"]
                for l in result.layers)
    extra = sum(2 * l.num_heads * (l.rank - l.head_dim) for l in result.layers)
    if saved >= 0 and extra <= 0:
        return "compute: the attention block costs less per token than the original at every length"
    if saved <= 0 and extra >= 0:
        return ("compute: every head scores and averages values over the whole key/value head, so the attention "
                "block costs more per token than the original at every length; the gain is the KV cache")
    if extra <= 0:
        return (f"compute: the attention block costs more per token than the original below about "
                f"{-saved // -extra:,} tokens of context and less above")
    return (f"compute: the attention block costs less per token than the original below about {saved // extra:,} "
            "tokens of context and more above")


def layer_columns(result: CompressResult) -> tuple[list[str], list[list[str]]]:
    rows = [[str(layer.rank), f"{layer.relative_error:.4f}", f"{layer.value_lost_energy:.4f}"]
            for layer in result.layers]
    return ["head width", "key energy lost", "value energy lost"], rows


def report_notes(result: CompressResult) -> list[str]:
    first = result.layers[0]
    return ["", "A stock checkpoint: config.json says one key/value head (`num_key_value_heads` 1, `head_dim` "
            f"{first.rank}) and RoPE as `longrope` factors that turn each pair of the head at the frequency of the "
            "original it stands for; it has no quantization_config and loads with transformers alone. Its "
            "provenance is under config.json's `collab_convert`.",
            "", f"The key per RoPE frequency, fastest first (complex dimensions, 2 numbers each; every layer alike): "
            f"{' '.join(map(str, first.frequency_ranks))}.",
            "", "Key energy lost is the share of score energy (keys weighted by the queries that read them) the "
            "dropped key directions carried; value energy lost, the share of the values' energy through the output "
            "projection that the value latent's PCA dropped. Attention MACs per token count the query, key, value and "
            "output projections of one token and its scores and weighted values against n keys: every head is "
            f"{first.rank} wide, so long contexts can cost more than the original while the cache shrinks.", ""]


def analysis_tables(result: AnalysisResult) -> list[Table]:
    labels = layer_labels([layer.name for layer in result.layers])
    spread = Table(f"{result.model} ({result.family}): numbers per token holding 90/95/99% of the energy",
                   ["layer", "heads x d (kv heads)", "shared key", "values"])
    for layer in result.layers:
        spread.rows.append([labels[layer.name], f"{layer.num_heads} x {layer.head_dim} ({layer.kv_heads})",
                            "/".join(str(v) for v in layer.energy_ranks["shared_key"].values()),
                            "/".join(str(v) for v in layer.energy_ranks["values"].values())])
    candidates = Table(f"Head widths, all {len(result.layers)} layers together",
                       ["head width", "attention params", "KV cache/token", "key error", "value error",
                        "key per frequency", "vLLM (FlashAttention/FlashInfer)"])
    first = result.predictions[0] if result.predictions else None
    if first:
        candidates.rows.append(["original", f"{first.parameters_before:,}",
                                f"{first.key_cache_before + first.value_cache_before:,}", "0", "0", "-", "-"])
    for index, p in enumerate(result.predictions):
        candidate = result.layers[0].candidates[index]
        engines = candidate["engines"]
        candidates.rows.append([
            str(p.rank), f"{p.parameters:,} ({100 * p.parameters / p.parameters_before:.0f}%)",
            f"{p.key_cache_per_token + p.value_cache_per_token:,}", f"{p.mean_relative_error:.3f}",
            f"{p.mean_value_error:.3f}", " ".join(map(str, candidate["frequency_ranks"])),
            f"{'yes' if engines['vLLM FlashAttention'] else 'no'}/{'yes' if engines['vLLM FlashInfer'] else 'no'}"])
    return [spread, candidates]


def analysis_advice(result: AnalysisResult) -> str:
    return ("Head width = the one key/value head's numbers per token and layer: the key holds it as complex "
            "dimensions per RoPE frequency (one profile for the whole model, fastest first), the values as a latent. "
            "key error: share of score energy lost (keys weighted by the queries that read them); value error: share "
            "of the values' output energy lost; means over layers, before calibration and refinement.\n"
            f"Next: collab-convert compress {result.model} --kv-cache 0.5 --calibration FILE -o OUT, then "
            "collab-convert export OUT --format gguf -o OUT.gguf")


def spectra(layers) -> list[tuple[str, list[tuple[str, list[float]]]]]:
    """The plots' panels: each layer's key (and, from an analysis, its values)."""
    if layers and hasattr(layers[0], "key_spectrum"):
        return [("Shared key", [(layer.name, layer.key_spectrum) for layer in layers])]
    return [("Shared key", [(layer.name, layer.spectra["shared_key"]) for layer in layers]),
            ("Value latent", [(layer.name, layer.spectra["values"]) for layer in layers])]
