"""The multi-query form's layers: one key/value head of width W in every layer. The key is the shared-key form's
shared rotary key, with one frequency profile for the whole model (a stock checkpoint has one RoPE frequency
list); the value is a latent every head averages (decompose/value_latent.py). Each query head's core folds into its
query projection, with the change of scale from 1/sqrt(d) to 1/sqrt(W); each head's value up-projection folds into
its block of the output projection. Refined together against the original's attention output where calibration
kept samples, and written in stock shapes as the checkpoint streams past."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ...architectures.layouts import AttentionLayer
from ...architectures.source import SourceModel
from ...decompose.costs import attention_cost
from ...decompose.rotary_ops import query_basis_matrix
from ...decompose.shared_key import KeyRanks, KeySpectrum, allocate, fit_shared_key, key_spectrum, slot_frequencies
from ...decompose.value_latent import fit_value_latent, head_up_projections, output_metric
from ...options import CompressOptions
from ...progress import DETAIL, Progress
from ...results import MultiQueryLayerReport, rounded
from ...streaming import FoldedFits, fit_workers, layer_labels, stream_weights
from ..shared_key.fitting import refine_layers, score_shares, shape_of
from ..shared_key.statistics import geometry_of
from .statistics import STEP_SEQUENCES


def key_profile(source: SourceModel, statistics: Mapping, width: int) -> KeyRanks:
    """One frequency profile for every layer (RoPE factors are global): shared complex dimensions per frequency
    where the score energy of all layers together, each judged as a share of its own, is largest."""
    summed = None
    for layer in source.layers:
        shares = score_shares(key_spectrum(statistics[layer.prefix], geometry_of(layer)))
        summed = shares.frequency_losses if summed is None else summed + shares.frequency_losses
    return allocate([KeySpectrum(summed, torch.zeros(0))], width)[0]


def convert_weights(source: SourceModel, options: CompressOptions, folder: Path, progress: Progress, width: int,
                    profile: KeyRanks, records: Mapping, finished=None, refining: bool = False):
    """Every tensor to the output in input order; at each attention layer, its stock query, key, value and output
    projections (fitted, and refined where calibration kept samples, there) in place of the original's."""
    labels = layer_labels(source)

    def specs(layer: AttentionLayer):
        return source.layout.stock_specs(source.reader, layer, width)

    def start(layer: AttentionLayer, announce) -> _Fitted:
        return _start(source, layer, width, profile, records[layer.prefix], options, announce)

    def finish(layer: AttentionLayer, fitted: _Fitted):
        return _finish(source, layer, width, profile, fitted)

    if not refining:
        def fit(layer: AttentionLayer, progress: Progress):
            def announce(stage: str):
                progress(f"{stage}{DETAIL}{labels[layer.prefix]}", source.layers.index(layer), len(source.layers))

            return finish(layer, start(layer, announce))

        return stream_weights(source, folder, options, progress, specs, fit, finished, workers=fit_workers(),
                              passing=source.layout.passing)
    # refined layers one at a time, or --refine-together of them in the same steps, as the shared-key form's
    order = [layer for layer in source.layers if not (finished and finished.has(layer))]
    fits = FoldedFits(order, start, lambda group, announce: _refine(group, options, announce), finish,
                      joins=lambda fitted: fitted.samples is not None, size=options.refine_together,
                      labels=labels)
    return stream_weights(source, folder, options, progress, specs, fits, finished, workers=0,
                          passing=source.layout.passing)


@dataclass
class _Fitted:
    """A layer between its fit and its tensors: its projections, the fitted key and value latent, and what its
    refinement needs and says."""

    weights: object
    geometry: object
    factors: object
    latent: object
    weighting: str
    scaling: float
    calibrated: bool
    samples: list | None
    setting: object
    seconds: float
    refinement: dict | None = None

    def to_refine(self):
        from ...decompose.shared_key_refinement import LayerToRefine

        return LayerToRefine(self.samples, self.factors, self.geometry, self.setting, self.latent)


def _start(source: SourceModel, layer: AttentionLayer, width: int, profile: KeyRanks, record,
           options: CompressOptions, announce) -> _Fitted:
    started = time.perf_counter()
    refined = bool(record.samples and options.refine_steps and width != layer.full_rank)
    announce("refining" if record.samples and options.refine_steps else "fitting")
    weights = source.layout.read_all(source.reader, layer)
    geometry = geometry_of(layer)
    factors = fit_shared_key(record.statistics, geometry, profile)
    latent, weighting = _value_start(record, weights, geometry, width, factors, options)
    scaling = record.setting.scaling if record.setting is not None else layer.shape.head_dim ** -0.5
    return _Fitted(weights, geometry, factors, latent, weighting, scaling, record.setting is not None,
                   record.samples if refined else None, record.setting if refined else None,
                   time.perf_counter() - started)


def _refine(group: list[_Fitted], options: CompressOptions, announce) -> list[_Fitted]:
    """The group's layers refined in the same steps, key and value latent together; each one's time is its share."""
    layers = [fitted.to_refine() for fitted in group]
    for fitted in group:  # the refinement lets the samples go as it stacks them (consume)
        fitted.samples = fitted.setting = None
    for fitted, (refined, record, share) in zip(group, refine_layers(layers, options, announce, STEP_SEQUENCES),
                                                strict=True):
        fitted.factors, fitted.latent, fitted.seconds = refined.factors, refined.values, fitted.seconds + share
        fitted.refinement = {**record, "value_start": fitted.weighting}
    return group


def _finish(source: SourceModel, layer: AttentionLayer, width: int, profile: KeyRanks, fitted: _Fitted):
    started, factors, latent = time.perf_counter(), fitted.factors, fitted.latent
    tensors = _stock_tensors(source, layer, fitted.weights, factors, latent, profile, fitted.scaling)
    # the start's lost energy, which the refined latent carries on
    report = _report(source, layer, width, factors, latent.lost_energy, fitted.seconds + time.perf_counter() - started)
    if fitted.calibrated:
        report.logit_error, report.refinement = factors.lost_energy, fitted.refinement
    return report, tensors


# The value latent's start is scored on every fourth calibration sample: on SmolLM2 (`--kv-cache 0.5`, 100
# documents) that picked as all 64 did in 29 layers of 30, the 30th a tie (0.02% apart), at a quarter of the cost
# (scoring on all of them was 13% of the refining stage)
START_SAMPLES_STRIDE = 4


def _value_start(record, weights, geometry, width: int, factors, options: CompressOptions):
    """(the value latent refinement starts from, which weighting made it): the output-weighted PCA with a group's
    heads counted apart or summed (decompose/value_latent.py), whichever leaves the smaller attention-output error
    on a quarter of the calibration samples; from the weights alone, counted apart."""
    def fitted(summed: bool):
        metric = output_metric(weights.output_weight, geometry, summed=summed)
        return fit_value_latent(record.value_moment, metric, width, geometry.kv_heads)

    if not record.samples or width == geometry.full_width:
        return fitted(False), "per head"
    from ...decompose.shared_key_refinement import attention_output_errors

    candidates = {"per head": fitted(False), "summed over a group's heads": fitted(True)}
    errors = attention_output_errors(record.samples[::START_SAMPLES_STRIDE], factors, geometry, record.setting,
                                     list(candidates.values()), options.device)
    best = min(zip(errors, candidates), key=lambda pair: pair[0])[1]  # the first on a tie, as before
    return candidates[best], best


def _stock_tensors(source: SourceModel, layer: AttentionLayer, weights, factors, latent, profile: KeyRanks,
                   scaling: float) -> dict[str, torch.Tensor]:
    """The fitted key, value latent and cores as stock projections, in float64, then in the checkpoint's dtype."""
    d, heads, groups = layer.shape.head_dim, layer.shape.num_heads, geometry_of(layer).group_of_head
    width = latent.width
    basis = query_basis_matrix(factors.query_core.double(), factors.pass_core.double(), slot_frequencies(profile),
                               d, d)  # (N_h, d, W): each head's query into the shared key's coordinates
    # the stock model scores with 1/sqrt(W): the original's scale is folded into the queries
    basis = basis * (scaling * math.sqrt(width))
    query = torch.einsum("hdw,hde->hwe", basis, weights.query_weight.double().reshape(heads, d, -1)).flatten(0, 1)
    query_bias = None
    if weights.query_bias is not None:
        query_bias = torch.einsum("hdw,hd->hw", basis, weights.query_bias.double().reshape(heads, d)).flatten()

    def through(mixing: torch.Tensor, weight: torch.Tensor, bias):
        mixing = mixing.double()
        return mixing @ weight.double(), None if bias is None else mixing @ bias.double()

    output = weights.output_weight.double().reshape(weights.output_weight.shape[0], heads, d)
    output = torch.einsum("ohd,hdw->ohw", output, head_up_projections(latent, groups).double()).flatten(1)
    tensors = source.layout.stock_tensors(layer, (query, query_bias),
                                          through(factors.key_mixing, weights.key_weight, weights.key_bias),
                                          through(latent.down, weights.value_weight, weights.value_bias), output)
    dtype = weights.query_weight.dtype
    return {name: tensor.to(dtype if name != f"{layer.prefix}.{source.layout.output}.weight"
                            else weights.output_weight.dtype).contiguous() for name, tensor in tensors.items()}


def _report(source: SourceModel, layer: AttentionLayer, width: int, factors, value_lost: float,
            seconds: float) -> MultiQueryLayerReport:
    has_bias = layer.has_query_bias
    before = attention_cost(shape_of(source, layer), has_bias=has_bias)
    after = attention_cost(shape_of(source, layer), width, has_bias=has_bias)
    return MultiQueryLayerReport(
        name=layer.prefix, rank=width, num_heads=layer.shape.num_heads, head_dim=layer.shape.head_dim,
        input_dim=layer.shape.input_dim, relative_error=factors.lost_energy, logit_error=None, refinement=None,
        parameters_before=before.parameters, parameters_after=after.parameters, seconds=seconds,
        cost_before=before.as_dict(), cost_after=after.as_dict(), kv_heads=layer.kv_heads,
        frequency_ranks=list(factors.ranks.frequency_ranks), value_lost_energy=round(value_lost, 6),
        key_spectrum=rounded(sorted(factors.key_mixing.norm(dim=1).tolist(), reverse=True)),
    )
