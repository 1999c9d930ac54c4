"""What the shared-key form fits from: per layer, the energy of the queries and the second moments of the keys
(decompose/shared_key.py), from the weights alone (inputs taken as the norm in front of attention leaves them) or
from the model run on calibration text, with a few raw sequences kept for refinement."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch

from ...architectures.layouts import AttentionLayer
from ...architectures.source import SourceModel
from ...decompose.shared_key import HeadGeometry, KeyStatistics, projection_tokens, statistics_of
from ...decompose.shared_key_refinement import CHECK_EVERY, QUERY_ROWS
from ...format import HeadCounts
from ...io.spill import SpillFolder
from ...options import CompressOptions
from ...progress import Progress
from ...stages import text_name


def geometry_of(layer: AttentionLayer) -> HeadGeometry:
    return HeadGeometry(layer.shape.num_heads, layer.kv_heads, layer.shape.head_dim, layer.rotary_dim)


def key_norm(source: SourceModel) -> bool:
    return source.layout.keeps_key_projection(source.config)


def weight_statistics(source: SourceModel, layer: AttentionLayer) -> KeyStatistics:
    """From the weights alone, inputs taken as isotropic. Where a QK-norm sits before RoPE, its scale is applied
    to the projected tokens and each head's vectors are brought to unit mean square, as the norm does."""
    weights = source.layout.read(source.reader, layer)
    geometry = geometry_of(layer)
    scale, shift = input_norm(source, layer)
    d = geometry.head_dim
    queries = projection_tokens(*through_norm(weights.query_weight, weights.query_bias, scale, shift),
                                geometry.num_heads, d)
    keys = projection_tokens(*through_norm(weights.key_weight, weights.key_bias, scale, shift), geometry.kv_heads, d)
    layout = source.layout
    if layout.query_norm and key_norm(source):
        queries = _normalised(queries, _norm_scale(source, layer, layout.query_norm), layout.norm_over_heads)
        keys = _normalised(keys, _norm_scale(source, layer, layout.key_norm), layout.norm_over_heads)
    return statistics_of(queries, keys, geometry)


def model_weight_statistics(source: SourceModel, scratch: Path | None = None) -> MutableMapping[str, KeyStatistics]:
    """Weight-only statistics of every layer, one input shard mapped at a time, as when streaming. With a
    `scratch` folder they wait on disk: a layer without rotation holds a (G d)^2 key covariance, 8 MB at
    GPT-2-medium's width, which over all layers would grow the peak with depth."""
    statistics = SpillFolder(scratch / "key-statistics") if scratch is not None else {}
    for layer in source.shard_by_shard():
        statistics[layer.prefix] = weight_statistics(source, layer)
    return statistics


class StatisticsOf(Mapping):
    """Each layer's statistics, read from its calibration record when asked (the records may wait on disk:
    holding every layer's statistics at once would grow the peak with depth)."""

    def __init__(self, calibrations: Mapping):
        self.calibrations = calibrations

    def __getitem__(self, prefix: str) -> KeyStatistics:
        return self.calibrations[prefix].statistics

    def __iter__(self):
        return iter(self.calibrations)

    def __len__(self) -> int:
        return len(self.calibrations)


def input_norm(source: SourceModel, layer: AttentionLayer):
    """Scale and shift of the norm in front of the attention: a normalised hidden state has unit-scale channels,
    so the attention's inputs are about scale * unit + shift (decoders' channel scales differ by orders of
    magnitude, which an isotropic guess would miss)."""
    names = source.layout.input_norm_names(layer.prefix)
    if names is None or names[0] not in source.reader:
        return None, None
    scale = _effective_scale(source, source.reader.get(names[0]))
    shift = source.reader.get(names[1]).double() if names[1] in source.reader else None
    return scale, shift


def _effective_scale(source: SourceModel, weight: torch.Tensor) -> torch.Tensor:
    """What an RMSNorm's weight multiplies by: Gemma's multiplies by (1 + weight), as its model_type says."""
    scale = weight.double()
    return scale + 1 if str(source.config.get("model_type", "")).startswith("gemma") else scale


def through_norm(weight: torch.Tensor, bias: torch.Tensor | None, scale, shift):
    if scale is None:
        return weight, bias
    bias = bias.double() if bias is not None else None
    if shift is not None:
        moved = weight.double() @ shift
        bias = moved if bias is None else bias + moved
    return weight.double() * scale[None, :], bias


def _norm_scale(source: SourceModel, layer: AttentionLayer, norm: str) -> torch.Tensor | None:
    name = f"{layer.prefix}.{norm}.weight"
    if name not in source.reader:
        return None
    return _effective_scale(source, source.reader.get(name))


def _normalised(tokens: torch.Tensor, scale: torch.Tensor | None, over_heads: bool) -> torch.Tensor:
    span = tokens.flatten(1) if over_heads else tokens
    mean_square = (span**2).sum(0, keepdim=True).mean(-1, keepdim=True)  # per head (or all), over the tokens
    unit = (span / mean_square.clamp_min(1e-30).sqrt()).reshape(tokens.shape)
    if scale is None:
        return unit
    return unit * scale.reshape(-1, tokens.shape[-1]) if over_heads else unit * scale


SHARED_KEY_REFINE_SAMPLES = 64  # raw sequences kept per layer for refinement (float16 queries and keys)
# Of them, the sequences a refinement step draws. Steps of 4 (200 of them, the form's default) reached the held-out
# error of 160 steps of 8 in 12-20% less time on SmolLM2's layers at 50% and 75% of the key cache; the multi-query
# form, whose steps refine the value latent too, keeps 8 (its own STEP_SEQUENCES). docs/benchmarks.md, "Smaller
# shared-key refinement steps".
STEP_SEQUENCES = 4


def calibrated_statistics(source: SourceModel, options: CompressOptions, texts: list[str], progress: Progress,
                          scratch: Path | None = None, value_moments: bool = False,
                          step_sequences: int = STEP_SEQUENCES):
    """(statistics per layer, calibrations per layer with refinement samples, what the report says). With a
    `scratch` folder the model runs a block at a time and the calibrations wait there (model_runs.py). With
    `value_moments`, each calibration also holds its layer's value second moment (the multi-query form)."""
    from ...integration.shared_key_capture import collect_shared_key_statistics

    layers = {layer.prefix: (geometry_of(layer), HeadCounts(layer.shape.num_heads, layer.kv_heads), layer.causal)
              for layer in source.layers}
    keep = min(options.refine_samples, SHARED_KEY_REFINE_SAMPLES) if options.refine_steps else 0
    calibrations, batches = collect_shared_key_statistics(
        source.folder, source.layout, source.family.position_bias, layers, texts, options.calibration_max_length,
        progress, keep_samples=keep, token_budget=options.calibration_tokens, scratch=scratch, width=source.width,
        device=options.device, value_moments=value_moments)
    refinement = (f"up to {options.refine_steps} Adam steps per layer on the error of the attention output (through "
                  f"the output projection; attention KL reported), in coordinates preconditioned by the keys' "
                  f"(and values') second moment, each on {step_sequences} of "
                  f"{min(keep, len(texts))} sequences and {QUERY_ROWS} query positions in each, stopped and chosen "
                  f"on a held-out tenth of them, checked every {CHECK_EVERY} steps") if keep else "off"
    calibration = {
        "source": text_name(options.calibration),
        "examples": batches.texts,
        "tokens": batches.tokens,
        "max_length": options.calibration_max_length,
        "objective": "score energy on the calibration tokens: key second moments"
                     + (" per frequency" if source.layout.rotates else "") + ", weighted by "
                     "the energy of the queries that read them",
        "refinement": refinement,
    }
    return StatisticsOf(calibrations), calibrations, calibration
