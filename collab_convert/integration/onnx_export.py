"""ONNX export of a loaded transformers model, collaborative or not, and the check that onnxruntime computes
what PyTorch does.

torch.onnx's exporter (torch.export underneath) traces the model's own forward and, for collaborative layers,
our score path (modeling/attention.py), with batch size and sequence length left dynamic. Encoders give their
final hidden states; causal language models their logits, without a cache (each call sees the whole prefix).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import BadInputError

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


def require_onnx() -> None:
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise BadInputError(f"ONNX export needs {', '.join(missing)}: pip install 'collab-convert[onnx]'")


class EncoderOutputs(nn.Module):
    """Final hidden states: what sentence-embedding pipelines pool."""

    output_name = "last_hidden_state"
    input_names = INPUT_NAMES

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state


class LanguageModelOutputs(nn.Module):
    """Next-token logits over the whole prefix, without a cache."""

    output_name = "logits"
    input_names = ("input_ids", "attention_mask")

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


@dataclass
class OnnxCheck:
    max_abs_difference: float
    inputs: str  # what the check ran on


def export_onnx(wrapper: nn.Module, example: dict[str, torch.Tensor], path: Path) -> None:
    """Write `wrapper` (EncoderOutputs or LanguageModelOutputs) to `path`, batch and sequence dynamic."""
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    names = [name for name in INPUT_NAMES if name in example]
    with torch.no_grad(), _exporter_quiet():
        torch.onnx.export(
            wrapper, tuple(example[name] for name in names), str(path), dynamo=True, input_names=names,
            output_names=[wrapper.output_name], dynamic_shapes={name: {0: batch, 1: sequence} for name in names},
            verbose=False, external_data=False,
        )


@contextlib.contextmanager
def _exporter_quiet():
    """The exporter narrates its passes on stdout and warns on stderr; stdout belongs to --json and stderr to
    our progress and errors."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def onnx_session(path: Path, threads: int | None = None):
    import onnxruntime

    settings = onnxruntime.SessionOptions()
    if threads:
        settings.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(str(path), settings, providers=["CPUExecutionProvider"])


@torch.no_grad()
def check_onnx(path: Path, wrapper: nn.Module, inputs: dict[str, torch.Tensor], description: str) -> OnnxCheck:
    """Largest absolute difference between onnxruntime and PyTorch over the real positions of `inputs` (padding
    rows compute nothing anyone reads)."""
    session = onnx_session(path)
    names = [i.name for i in session.get_inputs()]
    ours = torch.from_numpy(session.run(None, {name: inputs[name].numpy() for name in names})[0])
    theirs = wrapper(**{name: inputs[name] for name in names}).float()
    real = inputs["attention_mask"].bool()
    return OnnxCheck(float((ours - theirs)[real].abs().max()), description)
