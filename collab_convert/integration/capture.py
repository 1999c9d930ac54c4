"""Statistics of real attention inputs: the original model run on calibration text.

For every attention layer the query-side inputs x and key-side inputs y are caught on their way into the
query and key projections (forward pre-hooks), one sequence at a time so no padding token is counted. What
is kept is small and enough for a calibrated fit: the mean and covariance of x, and the covariance of y
around each sequence's own mean (what a softmax over keys can see).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decompose.calibrated import InputMetric
from ..errors import BadInputError
from ..modeling.collaborative import strip_prefix


@dataclass
class LayerCalibration:
    query: InputMetric
    key: InputMetric
    query_samples: list  # per sequence (n, D) float32, for refinement
    key_samples: list


@dataclass
class _Moments:
    query_sum: torch.Tensor | None = None
    query_outer: torch.Tensor | None = None
    query_count: int = 0
    key_outer: torch.Tensor | None = None
    key_count: int = 0
    keep: int = 0  # raw sequences to keep for refinement
    query_samples: list = field(default_factory=list)
    key_samples: list = field(default_factory=list)

    def add_query(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        if len(self.query_samples) < self.keep:
            self.query_samples.append(x.float().clone())
        x = x.double()
        if self.query_sum is None:
            self.query_sum = x.sum(0)
            self.query_outer = x.T @ x
        else:
            self.query_sum += x.sum(0)
            self.query_outer += x.T @ x
        self.query_count += x.shape[0]

    def add_key(self, y: torch.Tensor) -> None:
        # one sequence per call (batch size 1): centre on this sequence's own mean
        y = y.reshape(-1, y.shape[-1])
        if len(self.key_samples) < self.keep:
            self.key_samples.append(y.float().clone())
        y = y.double()
        centred = y - y.mean(0, keepdim=True)
        outer = centred.T @ centred
        self.key_outer = outer if self.key_outer is None else self.key_outer + outer
        self.key_count += max(y.shape[0] - 1, 0)

    def result(self) -> LayerCalibration:
        mean = self.query_sum / self.query_count
        query_cov = self.query_outer / self.query_count - torch.outer(mean, mean)
        key_cov = self.key_outer / max(self.key_count, 1)
        key_metric = InputMetric(key_cov, torch.zeros(key_cov.shape[0], dtype=key_cov.dtype))
        return LayerCalibration(InputMetric(query_cov, mean), key_metric, self.query_samples, self.key_samples)


def collect_statistics(
    folder: Path,
    family,
    prefixes: list[str],
    texts: list[str],
    max_length: int = 128,
    progress=None,
    keep_samples: int = 0,
) -> dict[str, LayerCalibration]:
    """Run the original model on `texts`; return input statistics (and up to `keep_samples` raw sequences)
    for each attention prefix."""
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - many ways for a tokenizer to be missing or broken
        raise BadInputError(f"calibration needs the model's tokenizer, which could not be loaded: {error}") from None
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    moments = {p: _Moments(keep=keep_samples) for p in prefixes}
    handles = _attach_hooks(model, family, moments)
    try:
        _run(model, tokenizer, texts, max_length, progress)
    finally:
        for handle in handles:
            handle.remove()
    missing = [p for p, m in moments.items() if m.query_count == 0 or m.key_outer is None]
    if missing:
        raise BadInputError(f"calibration never reached {missing[0]}")
    return {p: m.result() for p, m in moments.items()}


def _attach_hooks(model, family, moments: dict[str, _Moments]) -> list:
    """Forward pre-hooks where the family's layout says the query- and key-side inputs pass."""
    base = getattr(model, "base_model_prefix", None)
    wanted = {strip_prefix(p, base): p for p in moments}
    handles = []
    for name, module in model.named_modules():
        prefix = wanted.get(strip_prefix(name, base))
        if prefix is None:
            continue
        adders = {"query": moments[prefix].add_query, "key": moments[prefix].add_key}
        for point, sides in family.layout.hook_points(module):
            handles.append(point.register_forward_pre_hook(_hook(*(adders[side] for side in sides))))
    if not handles:
        raise BadInputError("no attention module of the model could be observed for calibration")
    return handles


@torch.no_grad()
def _run(model, tokenizer, texts: list[str], max_length: int, progress) -> None:
    """One text at a time: no padding token is ever counted in the statistics."""
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    for index, text in enumerate(texts):
        if progress:
            progress("calibrating", index, len(texts))
        batch = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if encoder_decoder:
            inputs["decoder_input_ids"] = batch["input_ids"]
        model(**inputs)
    if progress:
        progress("calibrating", len(texts), len(texts))


def _hook(*adders):
    def hook(module, args):
        for add in adders:
            add(args[0].detach())

    return hook


@dataclass
class RotaryCalibration:
    """One rotary layer on calibration text: its statistics, and for refinement a few raw sequences and how
    the layer turns scores into attention."""

    statistics: object  # decompose.rotary.KeyStatistics, means per token
    samples: list  # decompose.rotary_refinement.RotarySample, float16 to halve their memory
    setting: object | None  # decompose.rotary_refinement.AttentionSetting


def collect_rotary_statistics(folder: Path, family, layers: dict, texts: list[str], max_length: int = 128,
                              progress=None, keep_samples: int = 0) -> dict:
    """Query energy and key second moments of every rotary layer on real text (decompose/rotary.py), as means
    per token, and up to `keep_samples` raw sequences per layer. `layers` maps a prefix to (geometry, head
    counts). The queries and keys are the module's own, after any QK-norm and before RoPE, computed from the
    hidden states it receives; RoPE tables, scale and soft-capping are read from the same call."""
    from transformers import AutoModel, AutoTokenizer

    from ..decompose.rotary import statistics_of
    from ..decompose.rotary_refinement import AttentionSetting, RotarySample

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - many ways for a tokenizer to be missing or broken
        raise BadInputError(f"calibration needs the model's tokenizer, which could not be loaded: {error}") from None
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    found = {prefix: RotaryCalibration(None, [], None) for prefix in layers}
    tokens = {prefix: 0 for prefix in layers}
    base = getattr(model, "base_model_prefix", None)
    wanted = {strip_prefix(p, base): p for p in layers}

    def observer(prefix):
        geometry, heads = layers[prefix]
        record = found[prefix]

        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            queries, keys = family.layout.original_queries_keys(module, hidden, heads)
            values = family.layout.original_values(module, hidden, heads) if keep_samples else queries
            for query, key, value in zip(queries, keys, values, strict=True):  # one sequence per text: no padding
                more = statistics_of(query.float(), key.float(), geometry)
                record.statistics = more if record.statistics is None else record.statistics + more
                tokens[prefix] += query.shape[0]
                if len(record.samples) < keep_samples:
                    record.samples.append(RotarySample(query.half().clone(), key.half().clone(), value.half().clone()))
            cos, sin = kwargs["position_embeddings"]
            if record.setting is None or record.setting.cos.shape[0] < cos.shape[1]:
                output = family.layout.output_projection(module).weight
                record.setting = AttentionSetting(float(module.scaling), cos[0].float().clone(), sin[0].float().clone(),
                                                  getattr(module, "attn_logit_softcapping", None),
                                                  output.detach().float().clone())

        return hook

    handles = [module.register_forward_pre_hook(observer(wanted[strip_prefix(name, base)]), with_kwargs=True)
               for name, module in model.named_modules() if strip_prefix(name, base) in wanted]
    if len(handles) != len(layers):
        raise BadInputError("not every attention module of the model could be observed for calibration")
    try:
        _run(model, tokenizer, texts, max_length, progress)
    finally:
        for handle in handles:
            handle.remove()
    for prefix, record in found.items():
        record.statistics = record.statistics.scaled(1 / tokens[prefix])
    return found
