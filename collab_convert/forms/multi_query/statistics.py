"""What the multi-query form fits from: the shared-key form's key statistics (query energy and key moments per
RoPE frequency, forms/shared_key/statistics.py) and, per layer, the second moment of the values, from the weights
alone or from the model run on calibration text."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

import torch

from ...architectures.layouts import AttentionLayer
from ...architectures.source import SourceModel
from ...decompose.shared_key import projection_tokens
from ...decompose.value_latent import value_moment
from ...integration.shared_key_capture import SharedKeyCalibration
from ...io.spill import SpillFolder
from ...options import CompressOptions
from ...progress import Progress
from ..shared_key.statistics import StatisticsOf, calibrated_statistics, input_norm, through_norm, weight_statistics


STEP_SEQUENCES = 8  # sequences a refinement step draws: at 4 (x 200 steps) the value latent ended 1.6% worse


def weight_value_moment(source: SourceModel, layer: AttentionLayer) -> torch.Tensor:
    """The values' second moment from the weights alone, inputs as the norm in front of attention leaves them
    (unit channels, scaled): each input dimension's contribution is one token, and the bias one more."""
    weights = source.layout.read_all(source.reader, layer)
    scale, shift = input_norm(source, layer)
    tokens = projection_tokens(*through_norm(weights.value_weight, weights.value_bias, scale, shift),
                               layer.kv_heads, layer.shape.head_dim)
    return value_moment(tokens)


def model_weight_records(source: SourceModel, scratch: Path | None = None) -> MutableMapping[str, SharedKeyCalibration]:
    """Each layer's key statistics and value moment from the weights, one input shard mapped at a time; with a
    `scratch` folder they wait on disk."""
    records = SpillFolder(scratch / "kv-statistics") if scratch is not None else {}
    for layer in source.shard_by_shard():
        records[layer.prefix] = SharedKeyCalibration(weight_statistics(source, layer), [], None,
                                                     weight_value_moment(source, layer))
    return records


def statistics(source: SourceModel, options: CompressOptions, texts: list[str] | None, progress: Progress,
               scratch: Path | None = None):
    """(key statistics by layer, records by layer with value moments and refinement samples, what the report
    says of the calibration)."""
    if texts is None:
        records = model_weight_records(source, scratch)
        return StatisticsOf(records), records, None
    keys, records, calibration = calibrated_statistics(source, options, texts, progress, scratch, value_moments=True,
                                                       step_sequences=STEP_SEQUENCES)
    calibration["objective"] += "; values: their second moment, weighted by the output projection that reads them"
    return keys, records, calibration
