"""analyze() and compress(): pure functions from a model and options to a result object.

The CLI and the Python API both call these; they print nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import __version__
from .architectures import Family, family_for
from .checkpoint import (
    ShardWriter,
    TensorReader,
    TensorSpec,
    copy_non_weight_files,
    parse_size,
    read_config,
    resolve_model,
)
from .costs import LayerShape, candidate_ranks, collaborative_cost, original_cost
from .decomposition import (
    HeadProducts,
    content_bias,
    energy_rank,
    fit_calibrated,
    fit_collaborative,
    fit_reference_parafac,
    key_side_matrix,
    query_side_matrix,
    relative_error,
    spectra,
)
from .errors import BadInputError, OutputExistsError
from .integration import FORMAT_VERSION, QUANT_METHOD
from .modeling import COLLABORATIVE_TENSORS, FUSED_VALUE
from .naming import model_renamer

ENERGY_SHARES = (0.90, 0.95, 0.99)
# "tucker-cp-als": ours. "reference-parafac": the paper's dense TensorLy CP with a random start, kept so
# anyone can reproduce the comparison.
METHODS = ("tucker-cp-als", "reference-parafac")

Progress = Callable[[str, int, int], None]  # (what, done, total)


def _no_progress(what: str, done: int, total: int) -> None:
    pass


# ----------------------------------------------------------------------------------------------------------
# Finding the attention layers of a checkpoint


@dataclass
class AttentionLayer:
    prefix: str  # tensor-name prefix of the attention module, e.g. "encoder.layer.0.attention.self"
    shape: LayerShape
    anchor: str  # the tensor whose place in the file the collaborative tensors take
    replaced: list[str]  # tensors the collaborative form removes
    has_query_bias: bool
    kv_heads: int  # key/value heads: fewer than the query heads under grouped-query attention

    @property
    def key_rows(self) -> int:
        return self.kv_heads * self.shape.head_dim


@dataclass
class Projections:
    """One layer's query/key projections in nn.Linear layout, and tensors that replace a fused projection."""

    query_weight: torch.Tensor
    key_weight: torch.Tensor
    query_bias: torch.Tensor | None
    kept: dict[str, torch.Tensor]  # e.g. the value part of GPT-2's c_attn, under its new name


@dataclass
class LoadedModel:
    source: str
    folder: Path
    config: dict[str, Any]
    family: Family
    reader: TensorReader
    layers: list[AttentionLayer]


def open_model(model: str) -> LoadedModel:
    folder = resolve_model(model)
    config = read_config(folder)
    if config.get("quantization_config", {}).get("quant_method") == QUANT_METHOD:
        raise BadInputError(f"{model} is already collaborative; compress the original model instead")
    family = family_for(config)
    reader = TensorReader(folder, rename=model_renamer(folder, config))
    layers = find_attention_layers(reader, family, config)
    if not layers:
        raise BadInputError(f"{model}: no {family.name} attention layers found among its weights")
    return LoadedModel(model, folder, config, family, reader, layers)


def find_attention_layers(reader: TensorReader, family: Family, config: dict[str, Any]) -> list[AttentionLayer]:
    projection = family.fused or family.query
    suffix = f".{projection}.weight"
    layers = []
    for name in reader.names():
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]
        site = family.site_of(prefix)
        if site is None:
            continue
        num_heads = family.num_heads(config, site)
        kv_heads = family.num_kv_heads(config, site)
        bias = lambda n: [n] if n in reader else []  # noqa: E731
        # Shapes come from the file header: nothing is loaded until the layer is fitted.
        shape = reader.spec(name).shape
        if len(shape) != 2:
            raise BadInputError(f"{name} has shape {shape}, which does not split into {num_heads} heads")
        if family.fused:
            replaced = [name, *bias(f"{prefix}.{family.fused}.bias")]
            d_in, width = shape if family.fused_layout == "conv1d" else shape[::-1]
            # [queries (N_h d_k) | keys (N_kv d_k) | values (N_kv d_k)]
            query_width = num_heads * (width // (num_heads + 2 * kv_heads))
        else:
            key_weight = f"{prefix}.{family.key}.weight"
            if key_weight not in reader:
                raise BadInputError(f"{prefix} has a query projection but no key projection ({key_weight})")
            replaced = [
                name, key_weight, *bias(f"{prefix}.{family.query}.bias"), *bias(f"{prefix}.{family.key}.bias")
            ]
            query_width, d_in = shape
            kv_heads = num_heads  # separate projections: one key head per query head
        if query_width == 0 or query_width % num_heads:
            raise BadInputError(f"{name} has shape {shape}, which does not split into {num_heads} heads")
        layers.append(
            AttentionLayer(
                prefix=prefix,
                shape=LayerShape(input_dim=d_in, num_heads=num_heads, head_dim=query_width // num_heads),
                anchor=name,
                replaced=replaced,
                has_query_bias=f"{prefix}.{family.fused or family.query}.bias" in reader,
                kv_heads=kv_heads,
            )
        )
    return sorted(layers, key=lambda layer: _natural_key(layer.prefix))


def read_projections(loaded: "LoadedModel", layer: AttentionLayer) -> Projections:
    family, reader = loaded.family, loaded.reader
    if not family.fused:
        query_bias = f"{layer.prefix}.{family.query}.bias"
        return Projections(
            query_weight=_finite(reader, f"{layer.prefix}.{family.query}.weight"),
            key_weight=_finite(reader, f"{layer.prefix}.{family.key}.weight"),
            query_bias=_finite(reader, query_bias) if query_bias in reader else None,
            kept={},
        )
    conv1d = family.fused_layout == "conv1d"
    weight = _finite(reader, layer.anchor)
    linear = weight.T if conv1d else weight  # (3 widths, D_in)
    width, key_end = layer.shape.key_dim, layer.shape.key_dim + layer.key_rows
    bias_name = f"{layer.prefix}.{family.fused}.bias"
    bias = _finite(reader, bias_name) if bias_name in reader else None
    value = linear[key_end:]
    kept = {f"{layer.prefix}.{FUSED_VALUE}.weight": (value.T if conv1d else value).contiguous()}
    if bias is not None:
        kept[f"{layer.prefix}.{FUSED_VALUE}.bias"] = bias[key_end:].contiguous()
    return Projections(
        query_weight=linear[:width],
        key_weight=_per_query_head(linear[width:key_end], layer),
        query_bias=bias[:width] if bias is not None else None,
        kept=kept,
    )


def _per_query_head(key_weight: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """Grouped keys repeated so that row block i is the key of query head i."""
    if layer.kv_heads == layer.shape.num_heads:
        return key_weight
    groups = layer.shape.num_heads // layer.kv_heads
    blocks = key_weight.reshape(layer.kv_heads, layer.shape.head_dim, -1)
    return blocks.repeat_interleave(groups, dim=0).reshape(layer.shape.key_dim, -1)


def _natural_key(text: str) -> list:
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _finite(reader: TensorReader, name: str) -> torch.Tensor:
    tensor = reader.get(name)
    if not torch.isfinite(tensor).all():
        raise BadInputError(f"{name} contains NaN or Inf values; the model's weights are corrupt")
    return tensor


def layer_products(projections: Projections, layer: AttentionLayer) -> HeadProducts:
    return HeadProducts.from_projections(projections.query_weight, projections.key_weight, layer.shape.num_heads)


# ----------------------------------------------------------------------------------------------------------
# analyze


@dataclass
class LayerAnalysis:
    name: str
    input_dim: int
    num_heads: int
    head_dim: int
    spectra: dict[str, list[float]]
    energy_ranks: dict[str, dict[str, int]]  # spectrum -> share -> dimensions
    original: dict[str, Any]
    candidates: list[dict[str, Any]]


@dataclass
class AnalysisResult:
    model: str
    family: str
    layers: list[LayerAnalysis]
    tool_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def analyze(model: str, ranks: list[int] | None = None, progress: Progress = _no_progress) -> AnalysisResult:
    """PCA redundancy analysis of every attention layer's query/key block."""
    loaded = open_model(model)
    results = []
    for index, layer in enumerate(loaded.layers):
        progress("analyzing", index, len(loaded.layers))
        products = layer_products(read_projections(loaded, layer), layer)
        spec = spectra(products)
        views = {
            "query_projection": spec.query_projection,
            "key_projection": spec.key_projection,
            "query_unfolding": spec.query_unfolding,
            "key_unfolding": spec.key_unfolding,
            "head_unfolding": spec.head_unfolding,
        }
        has_bias = layer.has_query_bias
        layer_ranks = ranks or candidate_ranks(layer.shape)
        results.append(
            LayerAnalysis(
                name=layer.prefix,
                input_dim=layer.shape.input_dim,
                num_heads=layer.shape.num_heads,
                head_dim=layer.shape.head_dim,
                spectra={k: _rounded(v) for k, v in views.items()},
                energy_ranks={
                    k: {f"{share:.2f}": energy_rank(v, share) for share in ENERGY_SHARES}
                    for k, v in views.items()
                    if k != "head_unfolding"
                },
                original=original_cost(layer.shape, has_bias).as_dict(),
                candidates=[collaborative_cost(layer.shape, r).as_dict() for r in layer_ranks],
            )
        )
    progress("analyzing", len(loaded.layers), len(loaded.layers))
    return AnalysisResult(model=model, family=loaded.family.name, layers=results)


# ----------------------------------------------------------------------------------------------------------
# compress


class CompressOptions(BaseModel):
    """Options shared by the CLI and the Python API."""

    model_config = ConfigDict(extra="forbid")

    rank: int | Literal["auto"] = Field(description="shared query/key dimension R, or 'auto' (see energy)")
    output: Path
    # With rank="auto": each layer gets the fewest shared dimensions holding this share of the energy of its
    # head products (of the logits on the calibration text, when there is one).
    energy: float = Field(0.95, gt=0, le=1)
    # Plain text, one example per line (or a folder of .txt files): fit the logits on real inputs.
    calibration: Path | None = None
    calibration_samples: int = Field(512, ge=1)
    calibration_max_length: int = Field(128, ge=2)
    # With calibration: refine each layer against the original's attention distributions (KL), this many
    # Adam steps on up to refine_samples calibration sequences. 0 turns refinement off.
    refine_steps: int = Field(100, ge=0)
    refine_samples: int = Field(256, ge=1)
    seed: int = 0
    max_iterations: int = Field(500, ge=0)
    tolerance: float = Field(1e-3, gt=0)
    max_shard_size: int | str = "5GB"
    overwrite: bool = False
    method: str = "tucker-cp-als"
    # Where the ALS runs: "cpu", "cuda" or "cuda:N". Reading, writing and the small SVDs stay on the CPU.
    device: str = "cpu"

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {value!r}")
        return value

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {value!r}")
        return value

    @field_validator("rank")
    @classmethod
    def _positive_rank(cls, value):
        if value != "auto" and value < 1:
            raise ValueError(f"rank must be a positive integer or 'auto', got {value}")
        return value


@dataclass
class LayerReport:
    name: str
    rank: int
    num_heads: int
    head_dim: int
    input_dim: int
    relative_error: float
    # with calibration: the share of logit energy on the calibration inputs that the fit loses
    logit_error: float | None
    # with refinement: mean KL of the heads' attention to the original's, before and after
    refinement: dict[str, Any] | None
    per_head_truncation_error: float
    initialisation: str
    iterations: int
    parameters_before: int
    parameters_after: int
    seconds: float
    cost_before: dict[str, Any] = field(default_factory=dict)
    cost_after: dict[str, Any] = field(default_factory=dict)
    # singular values of the query- and key-side unfoldings, for the spectra plot
    query_spectrum: list[float] = field(default_factory=list)
    key_spectrum: list[float] = field(default_factory=list)


@dataclass
class CompressResult:
    model: str
    output: str
    family: str
    method: str
    layers: list[LayerReport]
    files: list[str]
    seconds: float
    tool_version: str = __version__
    schema_version: int = 1
    calibration: dict[str, Any] | None = None  # what the calibrated fit saw: source and number of examples

    @property
    def parameters_before(self) -> int:
        return sum(layer.parameters_before for layer in self.layers)

    @property
    def parameters_after(self) -> int:
        return sum(layer.parameters_after for layer in self.layers)

    @property
    def mean_relative_error(self) -> float:
        return sum(layer.relative_error for layer in self.layers) / max(len(self.layers), 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["totals"] = {
            "parameters_before": self.parameters_before,
            "parameters_after": self.parameters_after,
            "mean_relative_error": self.mean_relative_error,
        }
        return data


@dataclass
class CompressPlan:
    """What compress would do, checked without the heavy work (--dry-run)."""

    model: str
    output: str
    family: str
    method: str
    layers: list[dict[str, Any]]
    parameters_before: int
    parameters_after: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(model: str, options: CompressOptions) -> CompressPlan:
    """Check the model, the ranks and the output location; decompose nothing, write nothing."""
    loaded = open_model(model)
    try:
        return _plan(loaded, model, options)
    finally:
        loaded.reader.close()


def _plan(loaded: LoadedModel, model: str, options: CompressOptions, ranks: dict[str, int] | None = None) -> CompressPlan:
    parse_size(options.max_shard_size)
    output = options.output.expanduser().resolve()
    _check_output(output, loaded.folder, options.overwrite)
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInputError(f"--device {options.device} was asked for, but torch sees no CUDA device here")
    if options.calibration is not None and options.method != "tucker-cp-als":
        raise BadInputError("--calibration works with the tucker-cp-als method only")
    layers = []
    for layer in loaded.layers:
        rank = (ranks or {}).get(layer.prefix, options.rank)
        if rank != "auto" and rank > layer.shape.key_dim:
            raise BadInputError(
                f"rank {rank} exceeds the full rank of {layer.prefix} "
                f"({layer.shape.num_heads} heads x {layer.shape.head_dim} = {layer.shape.key_dim})"
            )
        before = original_cost(layer.shape, has_bias=layer.has_query_bias).parameters
        after = collaborative_cost(layer.shape, rank).parameters if rank != "auto" else None
        layers.append({"name": layer.prefix, "rank": rank, "parameters_before": before,
                       "parameters_after": after})
    return CompressPlan(
        model=model,
        output=str(output),
        family=loaded.family.name,
        method=options.method,
        layers=layers,
        parameters_before=sum(layer["parameters_before"] for layer in layers),
        parameters_after=sum(layer["parameters_after"] or 0 for layer in layers),
    )


def compress(model: str, options: CompressOptions, progress: Progress = _no_progress) -> CompressResult:
    """Re-parametrize every attention layer into collaborative form and write a complete checkpoint."""
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    loaded = open_model(model)
    staging = None
    try:
        _plan(loaded, model, options)  # refuse bad input before the costly calibration
        metrics, calibration = None, None
        if options.calibration is not None:
            from .calibration import collect_statistics, read_texts

            texts = read_texts(options.calibration, options.calibration_samples)
            calibration = {
                "source": str(options.calibration),
                "examples": len(texts),
                "max_length": options.calibration_max_length,
                "objective": "logit error on the calibration inputs (keys centred per sequence)",
            }
            metrics = collect_statistics(
                loaded.folder, loaded.family, [layer.prefix for layer in loaded.layers], texts,
                options.calibration_max_length, progress,
                keep_samples=options.refine_samples if options.refine_steps and loaded.family.refinable else 0,
            )
            calibration["refinement"] = (
                f"{options.refine_steps} Adam steps per layer on the attention KL over "
                f"{min(options.refine_samples, len(texts))} sequences"
                if options.refine_steps and loaded.family.refinable
                else "off" if not options.refine_steps else f"not available for {loaded.family.name} (position bias or scaling)"
            )
        ranks = _layer_ranks(loaded, options, metrics)
        checked = _plan(loaded, model, options, ranks)
        output = Path(checked.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = output.parent / f".{output.name}.collab-tmp-{os.getpid()}"
        staging.mkdir()
        reports, files = _convert_weights(loaded, options, staging, progress, ranks, metrics)
        files += copy_non_weight_files(loaded.folder, staging)
        result = CompressResult(
            model=model,
            output=str(output),
            family=loaded.family.name,
            method=options.method,
            layers=reports,
            files=[],
            seconds=0.0,
            calibration=calibration,
        )
        _write_config(loaded, reports, staging, result.method + ("+calibrated" if calibration else ""))
        from .report import write_model_card, write_plots, write_reports

        files += ["config.json"] + write_plots(result, staging)
        result.seconds = time.perf_counter() - started
        files += write_reports(result, staging) + write_model_card(result, loaded, staging)
        result.files = sorted(files)
        _move_into_place(staging, output)
    finally:
        loaded.reader.close()
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return result


def _check_output(output: Path, source: Path, overwrite: bool) -> None:
    source = source.resolve()
    if output == source or source in output.parents or output in source.parents:
        raise BadInputError(f"output {output} overlaps the input model folder; choose another location")
    if output.exists():
        if not output.is_dir():
            raise OutputExistsError(f"output {output} exists and is a file")
        if any(output.iterdir()) and not overwrite:
            raise OutputExistsError(f"output {output} exists and is not empty; pass --overwrite to replace it")


def _layer_ranks(loaded: LoadedModel, options: CompressOptions, metrics) -> dict[str, int]:
    """One rank per layer: the fixed one, or with rank="auto" the energy rank of the (whitened) products."""
    if options.rank != "auto":
        return {layer.prefix: options.rank for layer in loaded.layers}
    from .decomposition import whiten

    ranks = {}
    for layer in loaded.layers:
        products = layer_products(read_projections(loaded, layer), layer)
        if metrics is not None:
            products = whiten(products, metrics[layer.prefix].query, metrics[layer.prefix].key)
        share = options.energy
        rank = max(
            energy_rank(torch.linalg.svdvals(query_side_matrix(products)), share),
            energy_rank(torch.linalg.svdvals(key_side_matrix(products)), share),
        )
        ranks[layer.prefix] = min(max(rank, 1), layer.shape.key_dim)
    return ranks


def _convert_weights(loaded: LoadedModel, options: CompressOptions, staging: Path, progress: Progress,
                     ranks: dict[str, int], metrics):
    """Stream every tensor to the output in input order; at each attention layer, fit it and write its
    collaborative tensors in place of the ones it replaces. One layer and one tensor in memory at a time."""
    by_anchor = {layer.anchor: layer for layer in loaded.layers}
    replaced = {name for layer in loaded.layers for name in layer.replaced}
    specs = _output_specs(loaded, ranks, by_anchor, replaced)
    writer = ShardWriter(staging, specs, parse_size(options.max_shard_size))
    reader, reports = loaded.reader, []
    for name in reader.names():
        reader.release_all_but(name)  # keep one input shard mapped at a time
        if name in by_anchor:
            progress("decomposing", len(reports), len(loaded.layers))
            layer = by_anchor[name]
            metric = metrics[layer.prefix] if metrics else None
            report, tensors = _fit_layer(loaded, layer, options, ranks[layer.prefix], metric)
            reports.append(report)
            for new_name, tensor in tensors.items():
                writer.add(new_name, tensor)
        if name not in replaced:
            writer.add(name, reader.get(name))
    progress("decomposing", len(reports), len(loaded.layers))
    return reports, writer.finish()


def _output_specs(loaded: LoadedModel, ranks: dict[str, int], by_anchor, replaced) -> list[TensorSpec]:
    """Names, dtypes and shapes of every output tensor, in writing order, before anything is computed."""
    specs = []
    for name in loaded.reader.names():
        if name in by_anchor:
            specs += _collaborative_specs(loaded, by_anchor[name], ranks[by_anchor[name].prefix])
        if name not in replaced:
            specs.append(loaded.reader.spec(name))
    return specs


def _collaborative_specs(loaded: LoadedModel, layer: AttentionLayer, rank: int) -> list[TensorSpec]:
    anchor = loaded.reader.spec(layer.anchor)
    family = loaded.family
    heads, d_in = layer.shape.num_heads, layer.shape.input_dim
    key_in = d_in if family.fused else loaded.reader.spec(f"{layer.prefix}.{family.key}.weight").shape[1]
    shapes = {
        "shared_query.weight": (rank, d_in),
        "shared_key.weight": (rank, key_in),
        "mixing": (heads, rank),
        "content_bias": (heads, key_in),
    }
    specs = [TensorSpec(f"{layer.prefix}.{suffix}", anchor.dtype, shapes[suffix]) for suffix in COLLABORATIVE_TENSORS]
    if family.fused:  # the value third of the fused projection stays, in the fused layout
        used = layer.shape.key_dim + layer.key_rows  # query and key rows; the rest are values
        if family.fused_layout == "conv1d":
            value_shape = (anchor.shape[0], anchor.shape[1] - used)
        else:
            value_shape = (anchor.shape[0] - used, anchor.shape[1])
        specs.append(TensorSpec(f"{layer.prefix}.{FUSED_VALUE}.weight", anchor.dtype, value_shape))
        bias = f"{layer.prefix}.{family.fused}.bias"
        if bias in loaded.reader:
            bias_spec = loaded.reader.spec(bias)
            specs.append(
                TensorSpec(f"{layer.prefix}.{FUSED_VALUE}.bias", bias_spec.dtype, (bias_spec.shape[0] - used,))
            )
    return specs


def _fit_layer(loaded: LoadedModel, layer: AttentionLayer, options: CompressOptions, rank: int, metric):
    t0 = time.perf_counter()
    projections = read_projections(loaded, layer)
    products = layer_products(projections, layer)
    bias_correction, logit_error = None, None
    if options.method == "reference-parafac":
        fit = fit_reference_parafac(products, rank, seed=options.seed)
    elif metric is not None:
        # The ALS is cheap next to calibration, so calibrated fits run it to a tight tolerance.
        fit, bias_correction = fit_calibrated(
            products, rank, metric.query, metric.key, options.max_iterations, min(options.tolerance, 1e-5),
            device=options.device,
        )
        logit_error = fit.relative_error
        fit.relative_error = relative_error(products, fit.factors)
    else:
        fit = fit_collaborative(products, rank, options.max_iterations, options.tolerance, options.device)
    query_bias = projections.query_bias
    dtype = projections.query_weight.dtype
    factors = fit.factors
    bias = content_bias(projections.key_weight, query_bias, layer.shape.num_heads)
    if bias_correction is not None:
        bias = bias + bias_correction
    refinement = None
    if metric is not None and metric.query_samples and rank < layer.shape.key_dim:
        from .refinement import refine_attention

        site = loaded.family.site_of(layer.prefix)
        refined = refine_attention(
            metric.query_samples, metric.key_samples, projections.query_weight, query_bias,
            projections.key_weight, factors, bias, layer.shape.num_heads, layer.shape.head_dim**-0.5,
            causal=site.causal, steps=options.refine_steps,
        )
        factors, bias = refined.factors, refined.content_bias.to(bias.dtype)
        refinement = {"kl_before": refined.kl_before, "kl_after": refined.kl_after, "steps": refined.steps}
        fit.relative_error = relative_error(products, factors)
    values = {
        "shared_query.weight": factors.shared_query.T,
        "shared_key.weight": factors.shared_key.T,
        "mixing": factors.mixing,
        "content_bias": bias,
    }
    tensors = {
        f"{layer.prefix}.{suffix}": values[suffix].to(dtype).contiguous() for suffix in COLLABORATIVE_TENSORS
    }
    tensors.update(projections.kept)
    before = original_cost(layer.shape, has_bias=layer.has_query_bias)
    after = collaborative_cost(layer.shape, rank)
    report = LayerReport(
        name=layer.prefix,
        rank=rank,
        num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim,
        input_dim=layer.shape.input_dim,
        relative_error=fit.relative_error,
        logit_error=logit_error,
        refinement=refinement,
        # calibrated fits start from the truncation of the whitened products: not comparable, not shown
        per_head_truncation_error=_truncation_error(fit) if metric is None else float("nan"),
        initialisation=fit.initialisation,
        iterations=fit.iterations,
        parameters_before=before.parameters,
        parameters_after=after.parameters,
        seconds=time.perf_counter() - t0,
        cost_before=before.as_dict(),
        cost_after=after.as_dict(),
        query_spectrum=_rounded(_spectrum(fit.query_spectrum, products, query_side_matrix)),
        key_spectrum=_rounded(_spectrum(fit.key_spectrum, products, key_side_matrix)),
    )
    return report, tensors


def _spectrum(known: torch.Tensor | None, products: HeadProducts, side) -> torch.Tensor:
    return known if known is not None else torch.linalg.svdvals(side(products))


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 6) for v in values]


def _truncation_error(fit) -> float:
    return fit.initial_error if fit.initialisation == "per-head truncation" else float("nan")


def _write_config(loaded: LoadedModel, reports: list[LayerReport], staging: Path, method: str) -> None:
    config = dict(loaded.config)  # architectures and model_type stay as they are
    kv = {layer.prefix: layer.kv_heads for layer in loaded.layers}
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "method": method,
        "family": loaded.family.name,
        "layers": {
            r.name: {"rank": r.rank, "num_heads": r.num_heads, **({"kv_heads": kv[r.name]} if kv[r.name] != r.num_heads else {})}
            for r in reports
        },
    }
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _move_into_place(staging: Path, output: Path) -> None:
    """The finished folder appears at OUT in one rename; a replaced OUT is removed only after that.

    Ctrl-C and SIGTERM are held back for these few renames, so no interrupt leaves OUT half-swapped.
    """
    import signal

    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        _swap_into_place(staging, output)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _swap_into_place(staging: Path, output: Path) -> None:
    if output.exists() and any(output.iterdir()):
        retired = output.parent / f".{output.name}.collab-old-{os.getpid()}"
        output.rename(retired)
        staging.rename(output)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        if output.exists():
            output.rmdir()
        staging.rename(output)
