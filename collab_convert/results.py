"""Plain result data: what analyze, compress (and its dry run) and verify return. No behaviour beyond views
of the data; the CLI prints them and report/ writes them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .version import __version__


def rounded(values) -> list[float]:
    """Numbers for a report: plain floats, six decimals."""
    values = values.tolist() if hasattr(values, "tolist") else values  # not one 0-d tensor per element
    return [round(float(v), 6) for v in values]


def layer_labels(names: list[str]) -> dict[str, str]:
    """Short, unambiguous labels for attention layers: the dotted prefix and suffix they all share are dropped,
    and a bare number reads "layer N" ("encoder.layer.3.attention.self" -> "layer 3")."""
    parts = [name.split(".") for name in names]
    if len(parts) < 2:
        return {name: _as_label(name.split(".")) for name in names}
    head = 0
    while all(len(p) > head + 1 and p[head] == parts[0][head] for p in parts):
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == parts[0][-1 - tail] for p in parts):
        tail += 1
    return {name: _as_label(p[head: len(p) - tail]) for name, p in zip(names, parts)}


def _as_label(parts: list[str]) -> str:
    text = ".".join(parts)
    return f"layer {text}" if text.replace(".", "").isdigit() else text


@dataclass
class Table:
    """A table for a renderer (the terminal, report.md): a title, column headers, and rows of cells."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)


class _Data:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerAnalysis(_Data):
    """One layer as analyze sees it in the CP form; the shared-key form's adds its frequencies."""

    name: str
    input_dim: int
    num_heads: int
    head_dim: int
    spectra: dict[str, list[float]]
    energy_ranks: dict[str, dict[str, int]]  # spectrum -> share -> dimensions
    original: dict[str, Any]
    # per candidate rank: its costs, and what a fit at that rank gives (relative error of the head products;
    # with calibration, the share of logit energy lost on the calibration inputs)
    candidates: list[dict[str, Any]]


@dataclass(kw_only=True)
class SharedKeyLayerAnalysis(LayerAnalysis):
    kv_heads: int
    # per RoPE frequency (fastest first), the score energy each shared key direction carries, as shares of the
    # layer's total (none where nothing rotates)
    frequency_spectra: list[list[float]] = field(default_factory=list)


@dataclass(kw_only=True)
class MultiQueryLayerAnalysis(LayerAnalysis):
    kv_heads: int
    # per RoPE frequency (fastest first), the score energy each shared key direction carries, as shares of the
    # layer's total
    frequency_spectra: list[list[float]] = field(default_factory=list)
    # the output energy each value latent direction carries, as shares of the layer's total, largest first
    value_spectrum: list[float] = field(default_factory=list)


@dataclass
class RankPrediction(_Data):
    """What the whole model gets at one rank."""

    rank: int
    parameters: int  # query/key parameters of all layers
    parameters_before: int
    key_cache_per_token: int  # all layers
    key_cache_before: int
    mean_relative_error: float
    mean_logit_error: float | None = None  # with calibration
    cosine_mean: float | None = None  # measured on probe texts, with calibration or a target
    cosine_p01: float | None = None
    # the multi-query form: the values' numbers per token (all layers), and the share of their output energy lost
    value_cache_per_token: int | None = None
    value_cache_before: int | None = None
    mean_value_error: float | None = None


@dataclass
class AnalysisResult(_Data):
    model: str
    family: str
    form: str  # the form analysed: "collaborative" or "shared-key"
    layers: list[LayerAnalysis]
    predictions: list[RankPrediction] = field(default_factory=list)
    probe: str | None = None  # the texts cosines were measured on
    # with a target: {"target_cosine", "rank", "cosine_mean", "cosine_p01"}, the smallest rank that reaches it
    target: dict[str, Any] | None = None
    forms: list[str] = field(default_factory=list)  # the forms the model can take (compress --form)
    tool_version: str = __version__


@dataclass
class LayerReport(_Data):
    """What every form reports of one compressed layer."""

    name: str
    rank: int  # the CP form's shared dimension R; the shared-key form's cached numbers per token
    num_heads: int
    head_dim: int
    input_dim: int
    # the CP form: relative error of the head products; the shared-key form: share of score energy lost
    relative_error: float
    # with calibration: the share of logit energy on the calibration inputs that the fit loses
    logit_error: float | None
    # with refinement: mean KL of the heads' attention to the original's, before and after
    refinement: dict[str, Any] | None
    parameters_before: int
    parameters_after: int
    seconds: float
    cost_before: dict[str, Any] = field(default_factory=dict)
    cost_after: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class CollaborativeLayerReport(LayerReport):
    """A layer in the CP form: how the fit went, and the spectra of its head products."""

    per_head_truncation_error: float
    initialisation: str
    iterations: int
    # singular values of the query- and key-side unfoldings, for the spectra plot
    query_spectrum: list[float] = field(default_factory=list)
    key_spectrum: list[float] = field(default_factory=list)


@dataclass(kw_only=True)
class SharedKeyLayerReport(LayerReport):
    """A layer in the shared-key form: how its shared key splits over RoPE frequencies."""

    kv_heads: int
    initialisation: str
    # complex shared dimensions per RoPE frequency (fastest first; none where nothing rotates), and real ones for
    # pass-through dimensions
    frequency_ranks: list[int] = field(default_factory=list)
    pass_rank: int = 0
    key_spectrum: list[float] = field(default_factory=list)  # the kept shared key's per-slot scale, largest first


@dataclass(kw_only=True)
class MultiQueryLayerReport(LayerReport):
    """A layer in the multi-query form: one key/value head of width `rank`; `relative_error` is the key's lost
    score energy."""

    kv_heads: int  # before: the layer's key/value heads
    # complex dimensions of the key per RoPE frequency (fastest first): the same in every layer
    frequency_ranks: list[int] = field(default_factory=list)
    value_lost_energy: float = 0.0  # share of the values' output energy the latent's PCA dropped, before refinement
    key_spectrum: list[float] = field(default_factory=list)  # the kept key's per-slot scale, largest first


@dataclass
class CompressResult(_Data):
    model: str
    output: str
    family: str
    form: str  # the form the layers were compressed into: "collaborative" or "shared-key"
    method: str | None  # the CP form's decomposition method; None for forms that have none
    layers: list[LayerReport]
    files: list[str]
    seconds: float
    tool_version: str = __version__
    schema_version: int = 2  # 2: layer reports carry their form's fields only, and the result its form
    calibration: dict[str, Any] | None = None  # what the calibrated fit saw: source and number of examples
    rank_choice: dict[str, Any] | None = None  # with --rank auto: how the ranks were chosen, and the estimate
    # measured on text the fit did not see (with calibration): cosine mean / 1st percentile, next-token agreement
    fidelity: dict[str, Any] | None = None
    # with --distill-steps: the whole-model tuning against the original's next-token distributions
    distillation: dict[str, Any] | None = None
    # seconds per stage (opening, calibrating, fitting, refining, writing, ...), as the progress display showed them
    stage_seconds: dict[str, float] | None = None
    threads: dict[str, Any] | None = None  # CPU threads the math ran on, and why that many (cpu.py)
    # with --timing: milliseconds per token of the original and the result, measured side by side (runtime.py)
    runtime: dict[str, Any] | None = None
    # the fidelity gates (--min-cosine, --min-top1, ...) the measured fidelity fails, one line each; [] where all pass
    failures: list[str] | None = None
    # bytes of weights on disk, input and output (and the GGUF file a dequantised input came from): io/folders.py
    disk: dict[str, Any] | None = None
    # what the user should know of how the run went, one line each (a decoder fitted from its weights alone)
    warnings: list[str] | None = None

    @property
    def parameters_before(self) -> int:
        return sum(layer.parameters_before for layer in self.layers)

    @property
    def parameters_after(self) -> int:
        return sum(layer.parameters_after for layer in self.layers)

    @property
    def mean_relative_error(self) -> float:
        return sum(layer.relative_error for layer in self.layers) / max(len(self.layers), 1)

    def cache_before(self, key: str = "key_cache_per_token") -> int:
        """The original's cache per token over all layers, in the cost figure `key` (a form's terms.cache_key): 0
        for an encoder, which caches nothing, so its reports print no cache."""
        return sum(layer.cost_before[key] for layer in self.layers)

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
    form: str
    method: str | None
    layers: list[dict[str, Any]]
    parameters_before: int
    parameters_after: int
    size: str = ""  # what the form keeps, in words: "rank 96", "50% of the key cache (...)"


@dataclass
class ExportResult(_Data):
    """An exported model and how closely its runtime reproduces PyTorch."""

    model: str
    output: str
    format: str
    kind: str  # "encoder: final hidden states" or "causal language model: logits, no cache"
    inputs: list[str]
    outputs: list[str]
    max_abs_difference: float  # runtime against PyTorch, over real tokens
    checked_on: str
    files: list[str]
    seconds: float
    tool_version: str = __version__
    # gguf: precision, head sizes, RoPE factors, where the tokenizer came from, next-token agreement with PyTorch
    details: dict[str, Any] | None = None


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
    # the texts with the lowest cosines, lowest first: [{"cosine", "text"}] (the text cut to one short line)
    worst_texts: list[dict] | None = None
