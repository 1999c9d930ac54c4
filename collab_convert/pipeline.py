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
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import __version__
from .architectures import Family, family_for
from .checkpoint import (
    ShardWriter,
    TensorReader,
    copy_non_weight_files,
    parse_size,
    read_config,
    resolve_model,
)
from .costs import LayerShape, QueryKeyCost, candidate_ranks, collaborative_cost, original_cost
from .decomposition import (
    HeadProducts,
    content_bias,
    energy_rank,
    fit_collaborative,
    fit_reference_parafac,
    spectra,
)
from .errors import BadInputError, OutputExistsError
from .integration import FORMAT_VERSION, QUANT_METHOD
from .modeling import COLLABORATIVE_TENSORS

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
    query_weight: str
    key_weight: str
    query_bias: str | None
    key_bias: str | None


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
    reader = TensorReader(folder)
    layers = find_attention_layers(reader, family, config)
    if not layers:
        raise BadInputError(f"{model}: no {family.name} attention layers found among its weights")
    return LoadedModel(model, folder, config, family, reader, layers)


def find_attention_layers(reader: TensorReader, family: Family, config: dict[str, Any]) -> list[AttentionLayer]:
    num_heads = family.num_heads(config)
    suffix = f".{family.query}.weight"
    layers = []
    for name in reader.names():
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]
        if not family.is_attention(prefix):
            continue
        key_weight = f"{prefix}.{family.key}.weight"
        if key_weight not in reader:
            raise BadInputError(f"{prefix} has a query projection but no key projection ({key_weight})")
        query = reader.get(name)
        if query.ndim != 2 or query.shape[0] % num_heads:
            raise BadInputError(f"{name} has shape {tuple(query.shape)}, which does not split into {num_heads} heads")
        shape = LayerShape(input_dim=query.shape[1], num_heads=num_heads, head_dim=query.shape[0] // num_heads)
        bias = lambda n: n if n in reader else None  # noqa: E731
        layers.append(
            AttentionLayer(
                prefix=prefix,
                shape=shape,
                query_weight=name,
                key_weight=key_weight,
                query_bias=bias(f"{prefix}.{family.query}.bias"),
                key_bias=bias(f"{prefix}.{family.key}.bias"),
            )
        )
    return sorted(layers, key=lambda layer: _natural_key(layer.prefix))


def _natural_key(text: str) -> list:
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _finite(reader: TensorReader, name: str) -> torch.Tensor:
    tensor = reader.get(name)
    if not torch.isfinite(tensor).all():
        raise BadInputError(f"{name} contains NaN or Inf values; the model's weights are corrupt")
    return tensor


def layer_products(model: LoadedModel, layer: AttentionLayer) -> HeadProducts:
    return HeadProducts.from_projections(
        _finite(model.reader, layer.query_weight), _finite(model.reader, layer.key_weight), layer.shape.num_heads
    )


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
        products = layer_products(loaded, layer)
        spec = spectra(products)
        views = {
            "query_projection": spec.query_projection,
            "key_projection": spec.key_projection,
            "query_unfolding": spec.query_unfolding,
            "key_unfolding": spec.key_unfolding,
            "head_unfolding": spec.head_unfolding,
        }
        has_bias = layer.query_bias is not None
        layer_ranks = ranks or candidate_ranks(layer.shape)
        results.append(
            LayerAnalysis(
                name=layer.prefix,
                input_dim=layer.shape.input_dim,
                num_heads=layer.shape.num_heads,
                head_dim=layer.shape.head_dim,
                spectra={k: [round(float(x), 6) for x in v] for k, v in views.items()},
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

    rank: int = Field(description="shared query/key dimension D~ for every attention layer")
    output: Path
    seed: int = 0
    max_iterations: int = Field(500, ge=0)
    tolerance: float = Field(1e-7, gt=0)
    max_shard_size: int | str = "5GB"
    overwrite: bool = False
    method: str = "tucker-cp-als"

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {value!r}")
        return value

    @field_validator("rank")
    @classmethod
    def _positive_rank(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"rank must be a positive integer, got {value}")
        return value


@dataclass
class LayerReport:
    name: str
    rank: int
    num_heads: int
    head_dim: int
    input_dim: int
    relative_error: float
    per_head_truncation_error: float
    initialisation: str
    iterations: int
    parameters_before: int
    parameters_after: int
    seconds: float
    cost_before: dict[str, Any] = field(default_factory=dict)
    cost_after: dict[str, Any] = field(default_factory=dict)


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


def compress(model: str, options: CompressOptions, progress: Progress = _no_progress) -> CompressResult:
    """Re-parametrize every attention layer into collaborative form and write a complete checkpoint."""
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    max_shard = parse_size(options.max_shard_size)
    loaded = open_model(model)
    output = options.output.expanduser().resolve()
    _check_output(output, loaded.folder, options.overwrite)
    for layer in loaded.layers:
        if options.rank > layer.shape.key_dim:
            raise BadInputError(
                f"rank {options.rank} exceeds the full rank of {layer.prefix} "
                f"({layer.shape.num_heads} heads x {layer.shape.head_dim} = {layer.shape.key_dim})"
            )

    staging = output.parent / f".{output.name}.collab-tmp-{os.getpid()}"
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.mkdir()
        reports, new_tensors = _fit_layers(loaded, options, progress)
        files = _write_weights(loaded, new_tensors, staging, max_shard)
        files += copy_non_weight_files(loaded.folder, staging)
        result = CompressResult(
            model=model,
            output=str(output),
            family=loaded.family.name,
            method=options.method,
            layers=reports,
            files=[],
            seconds=0.0,
        )
        _write_config(loaded, reports, staging, options.method)
        from .report import write_model_card, write_reports

        result.seconds = time.perf_counter() - started
        files += ["config.json"] + write_reports(result, staging) + write_model_card(result, loaded, staging)
        result.files = sorted(files)
        _move_into_place(staging, output)
    finally:
        loaded.reader.close()
        if staging.exists():
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


def _fit_layers(loaded: LoadedModel, options: CompressOptions, progress: Progress):
    reports, tensors = [], {}
    total = len(loaded.layers)
    for index, layer in enumerate(loaded.layers):
        progress("decomposing", index, total)
        t0 = time.perf_counter()
        products = layer_products(loaded, layer)
        if options.method == "reference-parafac":
            fit = fit_reference_parafac(products, options.rank, seed=options.seed)
        else:
            fit = fit_collaborative(products, options.rank, options.max_iterations, options.tolerance)
        query_bias = _finite(loaded.reader, layer.query_bias) if layer.query_bias else None
        dtype = loaded.reader.dtype_of(layer.query_weight)
        factors = fit.factors
        values = {
            "shared_query.weight": factors.shared_query.T,
            "shared_key.weight": factors.shared_key.T,
            "mixing": factors.mixing,
            "content_bias": content_bias(loaded.reader.get(layer.key_weight), query_bias, layer.shape.num_heads),
        }
        for suffix in COLLABORATIVE_TENSORS:
            tensors[f"{layer.prefix}.{suffix}"] = values[suffix].to(dtype).contiguous()
        before = original_cost(layer.shape, has_bias=query_bias is not None)
        after = collaborative_cost(layer.shape, options.rank)
        reports.append(
            LayerReport(
                name=layer.prefix,
                rank=options.rank,
                num_heads=layer.shape.num_heads,
                head_dim=layer.shape.head_dim,
                input_dim=layer.shape.input_dim,
                relative_error=fit.relative_error,
                per_head_truncation_error=_truncation_error(fit),
                initialisation=fit.initialisation,
                iterations=fit.iterations,
                parameters_before=before.parameters,
                parameters_after=after.parameters,
                seconds=time.perf_counter() - t0,
                cost_before=before.as_dict(),
                cost_after=after.as_dict(),
            )
        )
    progress("decomposing", total, total)
    return reports, tensors


def _truncation_error(fit) -> float:
    return fit.initial_error if fit.initialisation == "per-head truncation" else float("nan")


def _write_weights(loaded: LoadedModel, new_tensors: dict[str, torch.Tensor], staging: Path, max_shard: int):
    replaced = set()
    for layer in loaded.layers:
        replaced.update(n for n in (layer.query_weight, layer.key_weight, layer.query_bias, layer.key_bias) if n)
    writer = ShardWriter(staging, max_shard)
    # Each layer's collaborative tensors go where its query weight stood, keeping the file order natural.
    by_layer = {layer.query_weight: layer.prefix for layer in loaded.layers}
    for name in loaded.reader.names():
        if name in by_layer:
            prefix = by_layer[name]
            for suffix in COLLABORATIVE_TENSORS:
                writer.add(f"{prefix}.{suffix}", new_tensors[f"{prefix}.{suffix}"])
        if name not in replaced:
            writer.add(name, loaded.reader.get(name))
    return writer.finish()


def _write_config(loaded: LoadedModel, reports: list[LayerReport], staging: Path, method: str) -> None:
    config = dict(loaded.config)  # architectures and model_type stay as they are
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "method": method,
        "family": loaded.family.name,
        "layers": {r.name: {"rank": r.rank, "num_heads": r.num_heads} for r in reports},
    }
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _move_into_place(staging: Path, output: Path) -> None:
    """The finished folder appears at OUT in one rename; a replaced OUT is removed only after that."""
    if output.exists() and any(output.iterdir()):
        retired = output.parent / f".{output.name}.collab-old-{os.getpid()}"
        output.rename(retired)
        staging.rename(output)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        if output.exists():
            output.rmdir()
        staging.rename(output)
