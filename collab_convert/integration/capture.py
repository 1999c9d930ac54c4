"""Statistics of real attention inputs for the CP form: the original model run on calibration text.

For every attention layer the query-side inputs x and key-side inputs y are caught on their way into the
query and key projections (forward pre-hooks, where the family's layout says they pass). What is kept is small
and enough for a calibrated fit: the mean and covariance of x, and the covariance of y around each sequence's
own mean (what a softmax over keys can see); and, for refinement, a few raw sequences. The run itself (batches,
whole or a block at a time) is model_runs.py's.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decompose.calibrated import InputMetric
from ..devices import HOST, Device, host_copy
from ..errors import BadInputError
from ..modeling.collaborative import strip_prefix
from .batches import CalibrationBatches, CurrentBatch
from .model_runs import CalibrationRun, observe_calibration, position_bias_of


@dataclass
class LayerCalibration:
    query: InputMetric
    key: InputMetric
    query_samples: list  # per sequence (n, D) float16, for refinement
    key_samples: list
    # the module's own score scale (transformers' `scaling`: 1/sqrt(d_k), or GPT-2's per-layer and optional
    # scalings), read from the module the statistics came from; None where the module has none
    scaling: float | None = None
    # (H, N, N): a relative position bias the module adds to its scores (MPNet), for the longest sequence seen;
    # a shorter sequence's is its top-left corner (the bias depends only on j - i). None where there is none
    position_bias: torch.Tensor | None = None


@dataclass
class Moments:
    """Running sums of one layer's inputs. Rows are shifted by the first batch's mean before they are summed,
    which leaves the covariance unchanged and keeps E[xx^T] - mu mu^T from cancelling away its small
    directions; each batch's product runs in float32 (one GEMM), the sums are kept in float64."""

    keep: int = 0  # raw sequences to keep for refinement
    scaling: float | None = None
    position_bias: torch.Tensor | None = None
    query_shift: torch.Tensor | None = None
    query_sum: torch.Tensor | None = None
    query_outer: torch.Tensor | None = None
    query_count: int = 0
    key_outer: torch.Tensor | None = None
    key_count: int = 0
    query_samples: list = field(default_factory=list)
    key_samples: list = field(default_factory=list)
    _last_query: list | None = None  # the inputs the query side saw last, to share them with the key side
    _last_query_outer: torch.Tensor | None = None  # their shifted rows' Gram matrix (float64)

    def add_query(self, sequences: list[torch.Tensor]) -> None:
        self._last_query = sequences
        for x in sequences[: max(self.keep - len(self.query_samples), 0)]:
            self.query_samples.append(host_copy(x, torch.float16))
        rows = torch.cat(sequences).float()
        if self.query_shift is None:  # the sums live where the inputs do: one copy to the host, at the end
            self.query_shift = rows.mean(0)
            self.query_sum = rows.new_zeros(rows.shape[1], dtype=torch.float64)
            self.query_outer = rows.new_zeros(rows.shape[1], rows.shape[1], dtype=torch.float64)
        rows = rows - self.query_shift
        self.query_sum += rows.sum(0).double()
        self._last_query_outer = (rows.T @ rows).double()
        self.query_outer += self._last_query_outer
        self.query_count += rows.shape[0]

    def add_key(self, sequences: list[torch.Tensor]) -> None:
        same = self._last_query is not None and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in zip(sequences, self._last_query))
        for index, y in enumerate(sequences[: max(self.keep - len(self.key_samples), 0)]):
            # self-attention: the key side saw the very tensor the query side did; keep it once
            self.key_samples.append(self.query_samples[len(self.key_samples)] if same and index < len(
                self.query_samples) else host_copy(y, torch.float16))
        # each sequence centred on its own mean: a shift shared by every key of a sequence is lost in softmax
        if same and self._last_query_outer is not None:
            outer = self._centred_query_outer(sequences)
        else:
            centred = torch.cat([y.float() - y.float().mean(0, keepdim=True) for y in sequences])
            outer = (centred.T @ centred).double()
        self.key_outer = outer if self.key_outer is None else self.key_outer + outer
        self._last_query_outer = None  # a D x D float64 per layer: held only from one hook to the next
        self.key_count += sum(max(y.shape[0] - 1, 0) for y in sequences)

    def _centred_query_outer(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        """Self-attention: the key side's per-sequence-centred Gram matrix from the query side's, with no second
        GEMM over the rows (a sixth of a MiniLM layer's forward). Centring each sequence s of n_s rows z (any
        shift) takes n_s mean_s mean_s^T off its sum of z z^T; the ridge of the calibrated fit (1e-3 of the mean
        variance) is far above the float32 Gram's rounding that this subtraction can expose."""
        means = torch.stack([y.float().mean(0) for y in sequences]) - self.query_shift
        counts = torch.tensor([y.shape[0] for y in sequences], dtype=torch.float64, device=means.device)
        means = means.double()
        return self._last_query_outer - (means.T * counts) @ means

    def result(self) -> LayerCalibration:
        mean = self.query_sum / self.query_count
        query_cov = (self.query_outer / self.query_count - torch.outer(mean, mean)).to(HOST)
        key_cov = (self.key_outer / max(self.key_count, 1)).to(HOST)
        key_metric = InputMetric(key_cov, torch.zeros(key_cov.shape[0], dtype=key_cov.dtype))
        return LayerCalibration(InputMetric(query_cov, (mean + self.query_shift.double()).to(HOST)), key_metric,
                                self.query_samples, self.key_samples, self.scaling, self.position_bias)

    def add_position_bias(self, bias: torch.Tensor) -> None:
        if self.position_bias is None or bias.shape[-1] > self.position_bias.shape[-1]:
            self.position_bias = host_copy(bias[0], torch.float32)


def collect_statistics(
    folder: Path,
    layout,
    position_bias,
    prefixes: list[str],
    texts: list[str],
    max_length: int = 128,
    progress=None,
    keep_samples: int = 0,
    token_budget: int | None = None,
    scratch: Path | None = None,
    width: int | None = None,
    device: Device = HOST,
) -> tuple[Mapping[str, LayerCalibration], CalibrationBatches]:
    """Run the original model on `texts` (at most `token_budget` tokens); return input statistics (and up to
    `keep_samples` raw sequences) for each attention prefix, and the batches that ran. `layout` says where the
    query- and key-side inputs pass (hook_points); `position_bias` reads a relative position bias from a module's
    arguments (a family's, or None). With a `scratch` folder a block at a time (model_runs.py); `width`: the
    hidden size, to size batches by."""
    current = CurrentBatch()
    observer = _InputObserver(layout, position_bias, keep_samples, current)
    run = CalibrationRun(max_length, token_budget, width, scratch, device)
    return observe_calibration(folder, prefixes, texts, observer, current, run, progress)


class _InputObserver:
    """Forward pre-hooks where the layout says the query- and key-side inputs pass, summing them per layer."""

    def __init__(self, layout, position_bias, keep_samples: int, current: CurrentBatch):
        self.layout, self.position_bias, self.keep, self.current = layout, position_bias, keep_samples, current
        self.moments: dict[str, Moments] = {}

    def attach(self, model, prefixes: list[str]) -> list:
        base = getattr(model, "base_model_prefix", None)
        wanted = {strip_prefix(p, base): p for p in prefixes}
        handles = []
        for name, module in model.named_modules():
            prefix = wanted.get(strip_prefix(name, base))
            if prefix is None:
                continue
            moments = self.moments.setdefault(prefix, Moments(keep=self.keep))
            scaling = getattr(module, "scaling", None)
            moments.scaling = float(scaling) if isinstance(scaling, (int, float)) else None
            adders = {"query": moments.add_query, "key": moments.add_key}
            for point, sides in self.layout.hook_points(module):
                handles.append(point.register_forward_pre_hook(_hook(self.current, *(adders[s] for s in sides))))
            if moments.keep and self.position_bias is not None:
                hook = _position_bias_hook(module, self.position_bias, moments)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        if not handles:
            raise BadInputError("no attention module of the model could be observed for calibration")
        return handles

    def finished(self, prefix: str) -> LayerCalibration:
        moments = self.moments.pop(prefix, None)
        if moments is None or moments.query_count == 0 or moments.key_outer is None:
            raise BadInputError(f"calibration never reached {prefix}")
        return moments.result()


def _position_bias_hook(module, read_bias, moments: Moments):
    """The relative position bias the module adds to its scores (family.position_bias reads it from the
    module's arguments), for refinement to add as the module does."""
    signature = inspect.signature(module.forward)

    def hook(module, args, kwargs):
        bias = position_bias_of(module, read_bias, signature, args, kwargs)
        if bias is not None:
            moments.add_position_bias(bias)

    return hook


def _hook(current: CurrentBatch, *adders):
    def hook(module, args):
        sequences = current.sequences(args[0].detach())
        for add in adders:
            add(sequences)
        current.observed_one()

    return hook
