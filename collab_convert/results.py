"""Plain result data: what analyze, compress (and its dry run) and verify return. No behaviour beyond views
of the data; the CLI prints them and report/ writes them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .version import __version__


def rounded(values) -> list[float]:
    """Numbers for a report: plain floats, six decimals."""
    return [round(float(v), 6) for v in values]


class _Data:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerAnalysis(_Data):
    name: str
    input_dim: int
    num_heads: int
    head_dim: int
    spectra: dict[str, list[float]]
    energy_ranks: dict[str, dict[str, int]]  # spectrum -> share -> dimensions
    original: dict[str, Any]
    candidates: list[dict[str, Any]]


@dataclass
class AnalysisResult(_Data):
    model: str
    family: str
    layers: list[LayerAnalysis]
    tool_version: str = __version__


@dataclass
class LayerReport(_Data):
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
class CompressResult(_Data):
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
class CompressPlan(_Data):
    """What compress would do, checked without the heavy work (--dry-run)."""

    model: str
    output: str
    family: str
    method: str
    layers: list[dict[str, Any]]
    parameters_before: int
    parameters_after: int


@dataclass
class VerifyResult(_Data):
    """Fidelity of a compressed checkpoint to its base on real text."""

    model: str
    against: str
    texts: int
    cosine_mean: float
    cosine_p01: float
    cosine_min: float
    # language models only: next-token top-1 agreement and mean KL(base || compressed), over real tokens
    top1_agreement: float | None = None
    kl_mean: float | None = None
    failures: list[str] | None = None
