"""A model's RoPE as transformers builds it, and the stock `rope_parameters` that give any list of per-pair
frequencies: what the multi-query form needs to write its one wide key head as a stock checkpoint.

transformers (modeling_rope_utils.py) and vLLM (rotary_embedding/phi3_long_rope_scaled_rope.py) build `longrope`
for every family with one formula: inv_freq_i = 1 / (factor_i * theta^(2i/W)) over the W/2 pairs of a head of
width W, the short factors up to `original_max_position_embeddings` tokens and the long ones past it, and cos/sin
scaled by `attention_factor`. So factor_i = 1 / (target_i * theta^(2i/W)) reproduces any target frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInputError

# RoPE types whose frequencies do not change with the input: one frequency list says them (dynamic NTK rescales
# with the length of each input, which no fixed list can)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeFrequencies:
    """A model's RoPE: inverse frequencies per pair (fastest first), up to and past `original_max` tokens."""

    short: torch.Tensor  # (d/2,) float64
    long: torch.Tensor  # (d/2,): the same as short unless the model's RoPE switches (longrope)
    attention_factor: float  # cos and sin are scaled by it (yarn, longrope)
    theta: float
    original_max: int  # the longer list applies past this many tokens


def rope_frequencies(folder: Path) -> RopeFrequencies:
    """The RoPE of the model in `folder`, as transformers builds it; a one-line error for RoPE no fixed frequency
    list can say."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(folder)
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise BadInputError(f"its RoPE ('{rope_type}') changes its frequencies with the input length, which a stock "
                            f"checkpoint's fixed frequency list cannot say; the shared-key form keeps it (--key-cache)")
    theta = float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    maximum = int(getattr(config, "max_position_embeddings", 0) or 0)
    original = _position_count(parameters.get("original_max_position_embeddings"), maximum)
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        short, factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        long = short
    else:
        short, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        long = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=original + 1)[0] if rope_type == "longrope" \
            else short
    return RopeFrequencies(short.double(), long.double(), float(factor), theta, original)


def _position_count(value, fallback: int) -> int:
    """A RoPE field's position count: a positive whole number, or `fallback` where the field says none (the RoPE types
    that read it fail in transformers' own set-up on anything else, which the config check refuses first; the
    others ignore it, as transformers does)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
        return fallback
    return int(value) if float(value).is_integer() else fallback


def stock_rope_parameters(rope: RopeFrequencies, pair_frequencies: torch.Tensor) -> dict:
    """`rope_parameters` of a head whose pair i turns at the model's frequency `pair_frequencies[i]` (an index into
    its list): longrope factors that give exactly those frequencies."""
    width = 2 * pair_frequencies.shape[0]
    # transformers computes theta^(2i/W) in float32: the factors undo that very number
    powers = (rope.theta ** (torch.arange(0, width, 2, dtype=torch.int64).float() / width)).double()

    def factors(targets: torch.Tensor) -> list[float]:
        return (1.0 / (targets[pair_frequencies] * powers)).tolist()

    parameters = {"rope_type": "longrope", "rope_theta": rope.theta, "short_factor": factors(rope.short),
                  "long_factor": factors(rope.long), "factor": 1.0, "attention_factor": rope.attention_factor,
                  "original_max_position_embeddings": rope.original_max}
    if abs(rope.attention_factor - 1.0) > 1e-12:
        # vLLM's longrope scales cos/sin by short_mscale/long_mscale, not attention_factor (transformers warns of the
        # keys it does not know, and reads attention_factor)
        parameters.update(short_mscale=rope.attention_factor, long_mscale=rope.attention_factor)
    return parameters
