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

from .decomposition import InputMetric
from .errors import BadInputError
from .modeling import strip_prefix


def read_texts(path: Path, limit: int | None = None) -> list[str]:
    """One example per line, from a text file or every .txt file in a folder (sorted); blank lines skipped."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise BadInputError(f"{path} holds no .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise BadInputError(f"calibration text {path} does not exist")
    texts = []
    for file in files:
        try:
            content = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise BadInputError(f"{file} is not readable UTF-8 text: {error}") from None
        texts += [line.strip() for line in content.splitlines() if line.strip()]
    if not texts:
        raise BadInputError(f"{path} holds no text")
    return texts[:limit] if limit else texts


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
    base = getattr(model, "base_model_prefix", None)
    wanted = {strip_prefix(p, base): p for p in prefixes}
    moments = {p: _Moments(keep=keep_samples) for p in prefixes}
    handles = []
    for name, module in model.named_modules():
        prefix = wanted.get(strip_prefix(name, base))
        if prefix is None:
            continue
        stats = moments[prefix]
        if family.fused:
            fused = getattr(module, family.fused)
            handles.append(fused.register_forward_pre_hook(_hook(stats.add_query, stats.add_key)))
        else:
            handles.append(getattr(module, family.query).register_forward_pre_hook(_hook(stats.add_query)))
            handles.append(getattr(module, family.key).register_forward_pre_hook(_hook(stats.add_key)))
    if len({h for h in handles}) == 0:
        raise BadInputError("no attention module of the model could be observed for calibration")
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    try:
        with torch.no_grad():
            for index, text in enumerate(texts):
                if progress:
                    progress("calibrating", index, len(texts))
                batch = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
                inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
                if encoder_decoder:
                    inputs["decoder_input_ids"] = batch["input_ids"]
                model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    if progress:
        progress("calibrating", len(texts), len(texts))
    missing = [p for p, m in moments.items() if m.query_count == 0 or m.key_outer is None]
    if missing:
        raise BadInputError(f"calibration never reached {missing[0]}")
    return {p: m.result() for p, m in moments.items()}


def _hook(*adders):
    def hook(module, args):
        for add in adders:
            add(args[0].detach())

    return hook
