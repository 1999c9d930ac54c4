"""A language model's head kept in low precision, computing float32 logits: offloaded passes (layerwise.py) give
their heads this forward, so the next-token figures are float32 math whatever the checkpoint stores."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..devices import training_products
from ..io.mapped import drop_read_pages, unwritten_file_mapping

# Output rows of a head converted to float32 at a time: 8 MB at a width of 1024. At 4096 rows (16 MB) the slice sat
# on the fidelity check's peak beside both models' logits; a text's head took the same time (13 and 26 ms at
# SmolLM2's and GPT-2-medium's shapes).
SLICE_ROWS = 2048


def float32_in_slices(linear: nn.Linear) -> None:
    """The Linear computes in float32 from its low-precision weight, converting SLICE_ROWS rows at a time: a
    50k-word head in bfloat16 is slow on CPUs without bfloat16 units (measured: 4.7 GFLOP/s), and converting it
    whole would hold 200 MB. Each slice's outputs go straight into the logits (joining the slices at the end held
    the logits twice: 26 MB more for a text of 128 tokens and 50k words). accelerate's hook still loads the weight
    around the call."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = linear.weight, linear.bias
        exact = _bfloat16_exact(hidden, weight)
        hidden = hidden.float()
        logits = hidden.new_empty(*hidden.shape[:-1], weight.shape[0])
        # one float32 slice, filled again for each: a new one per slice was mapped and zeroed page by page
        converted = hidden.new_empty(min(SLICE_ROWS, weight.shape[0]), weight.shape[1])
        # a weight read straight from its shard's mapping (an offloaded head) would hold every page of it in
        # resident memory until the call ends (103 MB for GPT-2's head): each slice's pages go once converted
        mapped = unwritten_file_mapping(weight) is not None
        with _bfloat16_products(exact):
            for start in range(0, weight.shape[0], SLICE_ROWS):
                rows = slice(start, start + SLICE_ROWS)
                part = converted[: weight[rows].shape[0]]
                part.copy_(weight[rows])
                if mapped:
                    drop_read_pages(weight[rows])
                logits[..., rows] = nn.functional.linear(hidden, part, None if bias is None else bias[rows].float())
        return logits

    if hasattr(linear, "_old_forward"):  # accelerate's hook calls this one between loading and dropping weights
        linear._old_forward = forward
    else:
        linear.forward = forward


def _bfloat16_exact(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a float32 product of these two loses nothing when oneDNN takes its inputs as bfloat16: both hold
    bfloat16 values, on a CPU that multiplies bfloat16 natively (devices.training_products)."""
    return (hidden.dtype == weight.dtype == torch.bfloat16 and hidden.device.type == "cpu"
            and training_products(hidden.device) == torch.bfloat16)


@contextlib.contextmanager
def _bfloat16_products(exact: bool):
    """Within, where `exact`: float32 matrix products take their inputs as bfloat16 (oneDNN's bf16 math mode) and
    still add and return float32. Inputs that are bfloat16 values lose nothing, and a SmolLM2 head's product on a
    text took 38 ms instead of 56 (2 cores with AVX512-BF16). The setting is process-wide: restored on the way
    out."""
    setting = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if not exact or setting is None or not hasattr(setting, "fp32_precision"):
        yield
        return
    before = setting.fp32_precision
    setting.fp32_precision = "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before
