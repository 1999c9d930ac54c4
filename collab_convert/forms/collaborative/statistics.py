"""What the CP form needs to know of the model beyond its weights: input statistics on calibration text, and
one rank per layer from a share of the energy of its (whitened) head products."""

from __future__ import annotations

from pathlib import Path

import torch

from ...architectures.source import SourceModel
from ...options import CompressOptions
from ...progress import Progress
from ...stages import text_name


def calibrate(source: SourceModel, options: CompressOptions, texts: list[str], progress: Progress,
              refine: bool = True, scratch: Path | None = None):
    """Input statistics of every layer on the calibration texts, and what the report says about them. With a
    `scratch` folder the model runs a block at a time and the statistics wait there (capture.py)."""
    from ...integration.capture import collect_statistics

    refines = refine and bool(options.refine_steps)
    metrics, batches = collect_statistics(
        source.folder, source.layout, source.family.position_bias, [layer.prefix for layer in source.layers], texts,
        options.calibration_max_length, progress, keep_samples=options.refine_samples if refines else 0,
        token_budget=options.calibration_tokens, scratch=scratch,
        width=source.width, device=options.device,
    )
    if refines:
        from ...decompose.refinement import BATCH_SEQUENCES, QUERY_ROWS

        refinement = (f"Adam on the attention KL, {options.refine_steps} steps per layer on average, shared out by "
                      f"each layer's KL before refinement; each step on {BATCH_SEQUENCES} of "
                      f"{min(options.refine_samples, len(texts))} sequences and {QUERY_ROWS} query positions in each, "
                      "stopped and chosen on a held-out tenth of them")
    else:
        refinement = "off"
    calibration = {
        "source": text_name(options.calibration),
        "examples": batches.texts,
        "tokens": batches.tokens,
        "max_length": options.calibration_max_length,
        # with kept sequences the key side is weighed by the original attention on them (fitting._key_metric)
        "objective": "logit error on the calibration inputs ("
                     + ("keys weighed by the original attention they get on the refinement's training sequences"
                        if refines else "keys centred per sequence") + ")"
                     + (", each head's weighted by how far its attention moves the layer's output (its value and "
                        "output projections)" if all(map(source.weighs_heads, source.layers)) else ""),
        "refinement": refinement,
    }
    return metrics, calibration


def head_weights_of(source: SourceModel, layer, metric):
    """With calibration, how much each head's attention moves the layer's output (decompose/calibrated.py), where
    the family names its value and output projections; None (the heads weigh alike) elsewhere."""
    if metric is None:
        return None
    head_outputs = source.read_head_outputs(layer)
    if head_outputs is None:
        return None
    from ...decompose.calibrated import head_weights

    return head_weights(head_outputs.value_heads, head_outputs.output_heads, metric.key.covariance)


def direction_energies(source: SourceModel, metrics) -> dict[str, torch.Tensor]:
    """Each layer's energy per shared direction, strongest first: the mean of the squared singular values of the
    query side and the key side of its (whitened, with calibration: logit) head products."""
    from ...decompose.calibrated import whiten
    from ...decompose.spectra import key_side_matrix, query_side_matrix

    energies = {}
    for layer in source.shard_by_shard():
        products = source.read_projections(layer).products(layer.shape.num_heads)
        if metrics is not None:
            metric = metrics[layer.prefix]
            products = whiten(products, metric.query, metric.key)
        query, key = (torch.linalg.svdvals(side(products)) ** 2 for side in (query_side_matrix, key_side_matrix))
        count = min(query.shape[0], key.shape[0])
        energies[layer.prefix] = (query[:count] + key[:count]) / 2
    return energies


def spread_ranks(source: SourceModel, options: CompressOptions, metrics) -> dict[str, int]:
    """--rank R --rank-spread energy: the same total as R in every layer, spread where the directions carry the
    most (logit, with --calibration) energy; each layer keeps at least one direction per head."""
    from ...decompose.spectra import spread_budget

    energies = direction_energies(source, metrics)
    layers = source.layers
    floors = [min(layer.shape.num_heads, layer.shape.key_dim) for layer in layers]
    ceilings = [layer.shape.key_dim for layer in layers]
    budget = sum(min(options.rank, layer.shape.key_dim) for layer in layers)
    ranks = spread_budget([energies[layer.prefix] for layer in layers], budget, floors, ceilings)
    return {layer.prefix: rank for layer, rank in zip(layers, ranks, strict=True)}


def energy_ranks(source: SourceModel, options: CompressOptions, metrics) -> dict[str, int]:
    """One rank per layer: the fewest shared dimensions holding `options.energy` of the energy of its (whitened,
    with calibration) products."""
    from ...decompose.calibrated import whiten
    from ...decompose.spectra import energy_rank, key_side_matrix, query_side_matrix

    ranks = {}
    for layer in source.shard_by_shard():
        products = source.read_projections(layer).products(layer.shape.num_heads)
        if metrics is not None:
            metric = metrics[layer.prefix]
            products = whiten(products, metric.query, metric.key)
        share = options.energy
        rank = max(
            energy_rank(torch.linalg.svdvals(query_side_matrix(products)), share),
            energy_rank(torch.linalg.svdvals(key_side_matrix(products)), share),
        )
        ranks[layer.prefix] = min(max(rank, 1), layer.shape.key_dim)
    return ranks
