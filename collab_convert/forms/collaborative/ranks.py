"""The CP form's sizes: one rank per layer, fixed, from an energy share, or the smallest whose measured embedding
cosine reaches a target (`--rank auto`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...architectures.source import SourceModel
from ...decompose.costs import collaborative_cost, original_cost
from ...decompose.methods import method_named
from ...errors import BadInputError
from ...options import CompressOptions
from ...progress import Progress
from .fitting import convert_weights, write_format_config
from .statistics import energy_ranks, spread_ranks


def refuse_options(options: CompressOptions) -> None:
    """What the CP form refuses from the options alone."""
    if options.key_cache is not None or options.kv_cache is not None:
        flag, form = ("--key-cache", "shared-key") if options.key_cache is not None else ("--kv-cache", "multi-query")
        raise BadInputError(f"{flag} sizes the {form} form, which --form collaborative is not; give --rank")
    if options.rank is None:
        raise BadInputError("give --rank R (the shared query/key dimension), or --rank auto")
    if options.rank_spread == "energy" and options.rank == "auto":
        raise BadInputError("--rank-spread energy spreads a number given to --rank; --rank auto sizes every layer "
                            "from its target: drop one of them")
    if options.calibration is not None and not method_named(options.method).calibrates:
        raise BadInputError(f"--calibration does not work with the {options.method} method")


def plan_layers(source: SourceModel, options: CompressOptions) -> list[dict]:
    """Each layer's rank (or "auto") and query/key parameters before and after; refuses what the CP form cannot
    honour."""
    refuse_options(options)
    layers = []
    for layer in source.layers:
        rank = options.rank
        if rank != "auto":
            layer.check_rank(rank)
        before = original_cost(layer.shape, has_bias=layer.has_query_bias).parameters
        keeps_bias = layer.stores_content_bias(options.calibration is not None)
        after = collaborative_cost(layer.shape, rank, keeps_bias).parameters if rank != "auto" else None
        layers.append({"name": layer.prefix, "rank": rank, "parameters_before": before, "parameters_after": after})
    return layers


def searches(options: CompressOptions) -> bool:
    """Whether the ranks come from a fidelity target, measured: `--rank auto` without `--energy`."""
    return options.rank == "auto" and options.energy is None


def estimator(source: SourceModel, options: CompressOptions, metrics, held_out):
    """The one fidelity estimator a run needs, built only if something will be measured: the rank search of
    `--rank auto`, or the finished checkpoint on held-out calibration lines. None for models that cannot be run
    on text."""
    from ...predict import FidelityEstimator, can_measure, default_probe

    if not can_measure(source) or not (searches(options) or held_out is not None):
        return None
    # Estimates skip refinement: the final compression refines, which only lowers the error.
    settings = options.model_copy(update={"refine_steps": 0})
    key_metrics: dict = {}  # each layer's, computed at the first rank tried (fitting._key_metric)

    def write(folder: Path, ranks: dict[str, int], progress: Progress) -> None:
        reports, _ = convert_weights(source, settings, folder, progress, ranks, metrics, key_metrics=key_metrics)
        write_format_config(source, reports, folder, settings.method, calibrated=metrics is not None)

    return FidelityEstimator(source, settings, held_out or default_probe(), write)


def choose_ranks(source: SourceModel, options: CompressOptions, metrics, estimator,
                 progress: Progress) -> tuple[dict[str, int], dict[str, Any] | None]:
    """One rank per layer, and how it was chosen (for the report).

    A fixed rank is taken as given. `--rank auto` aims at a fidelity target (`--target-cosine`, default 0.99):
    the smallest rank whose measured embedding cosine on probe texts reaches it. It falls back to an energy
    share of the head products where the model cannot be run on text, or where `--energy` was asked for.
    """
    if options.rank != "auto" and options.spread == "energy":
        ranks = spread_ranks(source, options, metrics)
        return ranks, {"mode": "energy spread", "total": sum(ranks.values()),
                       "energy": "logit energy on the calibration text" if metrics else "energy of the weights"}
    if options.rank != "auto":
        return {layer.prefix: options.rank for layer in source.layers}, None
    from ...predict import DEFAULT_TARGET_COSINE

    if options.energy is not None or estimator is None:
        share = options.energy if options.energy is not None else 0.95
        reason = "asked for" if options.energy is not None else "the model cannot be run on text to measure fidelity"
        return energy_ranks(source, options.model_copy(update={"energy": share}), metrics), {
            "mode": "energy", "energy": share, "why": reason,
        }
    target = options.target_cosine or DEFAULT_TARGET_COSINE
    estimate = estimator.smallest_rank(target, progress)
    choice = {"mode": "fidelity target", "target_cosine": target, "probe": estimator.probe.description,
              "estimated_cosine_mean": estimate.cosine_mean, "estimated_cosine_p01": estimate.cosine_p01}
    return {layer.prefix: min(estimate.rank, layer.shape.key_dim) for layer in source.layers}, choice
