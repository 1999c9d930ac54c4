"""The options of each job, in one place: names, defaults, validation and help texts.

The Python API takes these models; the CLI generates its flags from them (cli.py), so a default or a help text
is written once. A field's `json_schema_extra` may name its flags (`flags`) and the type the command line reads
it as (`cli_type`, for values the CLI parses itself, like `--rank auto`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from .decompose.methods import METHODS

DEFAULT_METHOD = "tucker-cp-als"
DEFAULT_CALIBRATION_TOKENS = 131072  # 512 texts of 256 tokens: second moments of a 4096-wide layer settle well before


def misnamed_device(device: str) -> str | None:
    """What is wrong with `device` as a --device value, in a line; None for "cpu", "cuda" and "cuda:N". A rule
    on the name alone: whether torch can use it is devices.unavailable's question, asked when a job starts."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return None
    return f"device must be cpu or cuda[:N], got {device!r}"


def _known_device(value: str) -> str:
    if misnamed_device(value):
        raise ValueError(misnamed_device(value))
    return value


DeviceName = Annotated[str, AfterValidator(_known_device)]  # every job's --device, checked by one rule


def _named(value):
    # an empty -o would read as the current folder: never what was meant
    if isinstance(value, str) and not value.strip():
        raise ValueError("give a name to write to (an empty path would mean the current folder)")
    return value


OutputPath = Annotated[Path, BeforeValidator(_named)]  # every job's -o

# NaN passes no comparison, so a bound like `le=1` would name the wrong fault; every float option must be finite
OPTIONS = ConfigDict(extra="forbid", allow_inf_nan=False)


# gate -> (the measured figure it reads, passes(value, threshold)); the figures are those of fidelity measurements
# (compress's `fidelity`, verify's result)
_GATES = {
    "min_cosine": ("cosine_mean", lambda v, t: v >= t),
    "min_cosine_p01": ("cosine_p01", lambda v, t: v >= t),
    "min_top1": ("top1_agreement", lambda v, t: v is not None and v >= t),
    "max_kl": ("kl_mean", lambda v, t: v is not None and v <= t),
}


class FidelityGates(BaseModel):
    """Thresholds on measured fidelity (exit 1 where one fails): verify measures on --texts, compress on held-out
    --calibration lines."""

    model_config = OPTIONS

    # Bounded to what the figures can be: a gate no result can pass (a cosine of 2) is a typo, not a gate.
    min_cosine: float | None = Field(None, ge=-1, le=1, description="Exit 1 if the mean cosine of final hidden "
                                     "states to the original's is below this (measured on held-out lines).")
    min_cosine_p01: float | None = Field(None, ge=-1, le=1, description="Exit 1 if the 1st-percentile cosine is "
                                         "below this.")
    min_top1: float | None = Field(None, ge=0, le=1, description="Language models: exit 1 if next-token top-1 "
                                   "agreement with the original is below this.")
    max_kl: float | None = Field(None, ge=0, description="Language models: exit 1 if the mean next-token KL to the "
                                 "original exceeds this.")

    @property
    def thresholds(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in _GATES}

    @property
    def gated(self) -> bool:
        return any(value is not None for value in self.thresholds.values())


def gate_failures(figures: dict, thresholds: dict[str, float | None]) -> list[str]:
    """One line per threshold the measured `figures` fail, in the words of the CLI flag."""
    failures = []
    for name, threshold in thresholds.items():
        if threshold is None:
            continue
        field, passes = _GATES[name]
        value = figures.get(field)
        if not passes(value, threshold):
            shown = "n/a (not a language model)" if value is None else f"{value:.4f}"
            failures.append(f"{field} {shown} fails --{name.replace('_', '-')} {threshold}")
    return failures


class _ModelInputs(BaseModel):
    """Options shared by analyze and compress: the form to compress into, and the real inputs a job may run the
    model on."""

    model_config = OPTIONS

    # architectures/families.py: rotary decoders take the shared-key form only; GPT-2, OPT, GPTBigCode, BART and
    # T5 offer it
    form: Literal["auto", "collaborative", "shared-key", "multi-query"] = Field(
        "auto",
        description="collaborative: heads share one query and one key, each with a mixing vector (fewest "
        "parameters). shared-key: heads keep their queries and share one key (decoders: the most fidelity per "
        "key-cache number; rotary decoders take it; GPT-2, OPT, GPTBigCode, BART and T5 offer it too). "
        "multi-query: rotary decoders (llama, mistral, qwen2, phi3) as a stock checkpoint with one key/value head, "
        "keys and values compressed, that serving engines run. auto: shared-key for rotary decoders and with "
        "--key-cache, multi-query with --kv-cache, else collaborative.",
    )

    threads: int | None = Field(
        None, ge=1, description="CPU threads for the math (default: the cores idle when the run starts, so a busy "
        "shared machine is not oversubscribed).",
    )
    calibration: Path | None = Field(
        None,
        description="Text file (one example per line) or folder of .txt files: fit the logits on real inputs and "
        "refine against the original attention.",
    )
    calibration_samples: int = Field(512, ge=1, description="Examples to read from --calibration at most.")
    calibration_max_length: int = Field(128, ge=2, description="Tokens per calibration example at most.")
    # The cost of calibrating grows with the tokens it runs, not with how many texts or how long they are.
    calibration_tokens: int = Field(
        DEFAULT_CALIBRATION_TOKENS, ge=2,
        description="Calibration tokens in all at most: texts are read in order until this many.",
    )
    # compress --rank auto: the smallest rank whose measured embedding cosine reaches it (0.99 unless given),
    # on held-out calibration lines or built-in sentences; analyze names that rank.
    target_cosine: float | None = Field(
        None, gt=0, le=1,
        description="The smallest rank whose embedding cosine to the original reaches this (compress --rank auto: "
        "default 0.99), measured on held-out --calibration lines or built-in sentences.",
    )
    # Where the math runs (devices.py). Reading, writing, the small SVDs and the rotary fits stay on the CPU.
    device: DeviceName = Field("cpu", description="Run the math on cpu or cuda[:N]: the fits, and with --calibration the "
                        "model's calibration passes and everything that runs the model or refines after them.")


class CompressOptions(_ModelInputs, FidelityGates):
    """Options shared by the CLI and the Python API."""

    rank: int | Literal["auto"] | None = Field(
        None,
        description="Shared query/key dimension R for every layer, or 'auto': the smallest rank reaching "
        "--target-cosine. The shared-key form: the shared key's numbers per token and layer, on average.",
        json_schema_extra={"flags": ["--rank", "-r"], "cli_type": str},
    )
    # The shared-key form: the key cache as a share of the original's, spread over layers (and frequencies).
    key_cache: float | None = Field(
        None, gt=0, le=1,
        description="Decoders in the shared-key form: keep this share of the key cache (e.g. 0.5), spread over "
        "layers (and rotary frequencies) where it keeps the most score energy. Instead of --rank.",
    )
    # The multi-query form: keys and values together, as a share of the original's KV cache.
    kv_cache: float | None = Field(
        None, gt=0, le=1,
        description="Rotary decoders as a stock multi-query checkpoint: keep this share of the whole KV cache "
        "(keys and values, e.g. 0.5) in one key/value head per layer, whose width serving engines are told. "
        "Instead of --rank.",
    )
    # The CP form: one total of shared dimensions, spread over the layers (forms/collaborative/statistics.py).
    rank_spread: Literal["auto", "uniform", "energy"] = Field(
        "auto", description="With a number for --rank, the CP form: uniform gives every layer that rank; energy "
        "gives the layers the same total (rank x layers), spread where the shared directions carry the most "
        "energy (the logit energy on the calibration text, with --calibration), at least one per head. auto: "
        "energy with --calibration (measured across domains: docs/benchmarks.md), uniform without.",
    )

    @property
    def spread(self) -> str:
        """How a numeric --rank is spread over the layers: uniform or energy (auto resolved)."""
        if self.rank_spread != "auto":
            return self.rank_spread
        return "energy" if self.calibration is not None else "uniform"
    energy: float | None = Field(
        None, gt=0, le=1,
        description="With --rank auto: instead of a fidelity target, keep this share of each layer's (logit, "
        "with --calibration) energy, e.g. 0.95.",
    )
    # With calibration: refine each layer against the original's attention distributions (KL), this many Adam
    # steps on up to refine_samples calibration sequences. 0 turns refinement off.
    refine_steps: int | None = Field(
        None, ge=0, description="With --calibration: Adam steps per layer against the original attention (the "
        "collaborative form: on average, layers with more error get more; each step on 4 sequences x 64 query "
        "positions; the shared-key form's on 4 x 32, the multi-query form's on 8 x 32; a layer stops early when a "
        "held-out slice stops improving; 0: off). Default: 200, 130 for the multi-query form.",
    )
    refine_samples: int = Field(256, ge=1, description="With --calibration: sequences the refinement looks at.")
    # The shared-key and multi-query forms: layers whose refinements share each step (streaming.FoldedFits). Each
    # layer added holds its calibration samples, stacked, for the group's whole refinement. A default that grouped as
    # many layers as fit in an eighth of the checkpoint grouped a 24-layer Llama-shaped checkpoint's and not its
    # 12-layer twin's, so the peak grew with depth (90 -> 156 MB; 95 MB one at a time) for 8% less refining time;
    # narrow layers gain the most (four SmolLM2-135M layers in 0.62-0.73 of the time), and there each layer added
    # holds 50 MB, past the bound of half the checkpoint. docs/benchmarks.md, "A rotary shape under the memory bound"
    refine_together: int = Field(
        1, ge=1, le=16, description="With --calibration, the shared-key and multi-query forms: layers refined in "
        "the same steps. More is faster on a CPU where layers are narrow (a step is a few hundred small "
        "operations, whatever its layers: four SmolLM2-135M layers refine in 0.62-0.73 of the time), and holds "
        "each layer's calibration samples at once (about 50 MB a layer for SmolLM2-135M at 300 documents). "
        "Default: 1, so that memory does not grow with the model's depth.",
    )
    # After every layer is fitted on its own: every layer's collaborative tensors tuned together on the model's
    # own output (integration/distillation.py). Off by default: it loads the original and the result whole, and on
    # encoders it costs several times the calibration for a small gain (docs/benchmarks.md, issue 34).
    distill_steps: int = Field(
        0, ge=0, description="With --calibration: then tune every layer's collaborative tensors together, up to "
        "this many Adam steps, so the next-token distributions (language models; 4 texts a step) or the token "
        "states and sentence embeddings (encoders; 16 texts a step) match the original's; the best state on "
        "held-out texts is kept. Loads both models whole. E.g. 100; 0: off.",
    )
    # Encoders: calibration texts mixed to cover lengths and styles (calibration_mix.py), so the fit holds on text
    # unlike the calibration's own.
    calibration_mix: Literal["auto", "as-given", "lengths", "lengths+built-in"] = Field(
        "auto", description="Encoders: what the fit sees of --calibration. as-given: the lines as they are; "
        "lengths: each line, one of its sentences, and windows past its first; lengths+built-in: also built-in "
        "English lines of many styles. auto: as-given (language models always).",
    )
    output: OutputPath = Field(
        description="Folder to write the collaborative checkpoint to.",
        # read as typed: as a Path, an empty -o would already be "."
        json_schema_extra={"flags": ["--output", "-o"], "cli_type": str, "metavar": "PATH"},
    )
    # Language models calibrate on built-in English text unless given --calibration (stages.decoder_calibration)
    weight_only: bool = Field(False, description="Language models: fit from the weights alone instead of on the "
                              "built-in English text they calibrate on by default (much faster; a decoder loses "
                              "much more, and the run says so).")
    seed: int = Field(0, description="Seed for anything random (the default fit has no random step).")
    max_iterations: int = Field(500, ge=0, description="ALS iterations per layer at most.")
    tolerance: float = Field(
        1e-3, gt=0, description="Stop when an iteration improves the error by less than this share."
    )
    max_shard_size: int | str = Field(
        "5GB", description="Largest safetensors shard, e.g. 500MB.", json_schema_extra={"cli_type": str}
    )
    # The dequantiser of a GGUF input works in float32; the output goes back to the file's own precision.
    dtype: Literal["auto", "f32", "f16", "bf16"] = Field(
        "auto", description="Precision the output's weights are written in. auto: the input's own (each tensor as "
        "stored; a GGUF input: the precision the file stored its weight matrices in, f16 for quantised ones, "
        "rather than the float32 it was dequantised to); f32, f16, bf16: every floating tensor in that one.",
    )
    method: str = Field(
        DEFAULT_METHOD, description=" or ".join(f"{name} ({m.description.split(':')[0]})" for name, m in METHODS.items()) + "."
    )
    overwrite: bool = Field(False, description="Replace OUTPUT if it exists and is not empty.")
    timing: bool = Field(False, description="Measure time per token of the original and the result on this machine "
                         "(encoders: a forward pass; language models: a decode step) at 128 and 512 tokens, for the "
                         "report and model card. Loads both models whole.")
    plots: bool = Field(True, description="Draw spectra.svg and errors.svg beside the reports (--no-plots skips "
                        "them).",
                        json_schema_extra={"flags": ["--plots/--no-plots"]})
    resume: bool = Field(False, description="Continue a run that was killed (SIGKILL, a crash) writing OUTPUT: "
                         "layers it finished are not fitted again; the result is byte-identical.")

    @property
    def requested_form(self) -> str:
        """The form asked for: --key-cache alone asks for the shared-key form, --kv-cache alone for the multi-query
        form, whose caches they size."""
        if self.form == "auto" and self.kv_cache is not None:
            return "multi-query"
        return "shared-key" if self.form == "auto" and self.key_cache is not None else self.form

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {value!r}")
        return value

    @field_validator("rank", mode="before")
    @classmethod
    def _rank(cls, value):
        if value is None:
            return value
        if isinstance(value, str) and value != "auto":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"'{value}' is neither an integer nor 'auto'") from None
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise ValueError(f"rank must be a positive integer or 'auto', got {value}")
        return value


class AnalyzeOptions(_ModelInputs):
    """What analyze looks at beyond the model itself."""

    ranks: list[int] | None = Field(
        None,
        description="Comma-separated candidate ranks to cost, e.g. 64,128,192.",
        json_schema_extra={"cli_type": str},
    )
    plot: Path | None = Field(None, description="Also draw the spectra into this SVG file (opens in any browser).")

    @field_validator("plot")
    @classmethod
    def _plot(cls, value):
        if value is not None and value.suffix.lower() != ".svg":
            raise ValueError(f"plots are SVG: name the file with .svg, not '{value.name}'")
        return value

    @field_validator("ranks", mode="before")
    @classmethod
    def _ranks(cls, value):
        if isinstance(value, str):
            try:
                value = [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ValueError(f"'{value}' is not a comma-separated list of integers") from None
        if value is not None and (not value or any(v < 1 for v in value)):
            raise ValueError("ranks must be positive integers")
        return value


class ExportOptions(BaseModel):
    """What `export` writes: a runtime format of a compressed checkpoint (or of any model it can load)."""

    model_config = OPTIONS

    format: Literal["onnx", "gguf"] = Field(
        "onnx", description="onnx (a folder: model.onnx and the tokenizer, checked in onnxruntime), or gguf (one .gguf "
        "file for llama.cpp: stock llama, mistral and qwen2 checkpoints, such as compress --kv-cache writes).")
    output: OutputPath = Field(
        description="Where to write: a folder for onnx, a .gguf file for gguf.",
        # read as typed: as a Path, an empty -o would already be "."
        json_schema_extra={"flags": ["--output", "-o"], "cli_type": str, "metavar": "PATH"},
    )
    overwrite: bool = Field(False, description="Replace OUTPUT if it exists (and, for a folder, is not empty).")
    # the runtime against PyTorch on the built-in sentences; a larger difference is an error, never a silent file
    tolerance: float = Field(1e-4, gt=0, description="Largest absolute difference from PyTorch accepted (onnx; gguf "
                             "in f32: relative to the largest logit).")
    dtype: Literal["f32", "f16", "bf16"] = Field("f16", description="gguf: the precision of its weight matrices "
                                                 "(norms and biases stay f32).")


class VerifyOptions(FidelityGates):
    """What `verify` measures a compressed checkpoint on, against which base, and the thresholds it gates on."""

    against: str | None = Field(None, description="The base model it came from (default: the one the checkpoint "
                                "records in report.json or config.json).")
    texts: Path = Field(description="Text file (one example per line) or folder of .txt files.")
    samples: int = Field(1000, ge=1, description="Examples to read at most.")
    device: DeviceName = Field("cpu", description="Run both models on cpu or cuda[:N].")
