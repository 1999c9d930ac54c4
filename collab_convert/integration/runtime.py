"""Time per token of a collaborative checkpoint against its original, measured side by side on this machine.

Encoders: one forward pass of a single sequence of n tokens, divided by n. Language models: one greedy decode
step with the KV cache holding n tokens (what generation costs per token at that context). Both models are timed
interleaved (A B A B ...) and the medians compared, so machine noise hits both alike; the numbers hold for this
machine, its threads and the lengths shown, not for others.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

LENGTHS = (128, 512)


def why_not_timed(config: dict) -> str | None:
    """Why a model cannot be timed on token ids alone (None: it can)."""
    if config.get("is_encoder_decoder"):
        return "encoder-decoder models are not timed yet (a decode step needs the encoder's output)"
    if not config.get("vocab_size"):
        return "the model does not read token ids"
    return None


def time_per_token(original: Path, compressed: Path, language_model: bool, lengths=LENGTHS,
                   repeats: int = 5) -> dict:
    from transformers import AutoModel, AutoModelForCausalLM

    from .loading import for_measuring

    auto = AutoModelForCausalLM if language_model else AutoModel
    models = {"original": auto.from_pretrained(original), "collaborative": auto.from_pretrained(compressed)}
    for name, model in models.items():
        for_measuring(model)
        model.config.use_cache = language_model  # decode steps read the cache; encoders have none
    limit = getattr(models["original"].config, "max_position_embeddings", None) or max(lengths)
    vocabulary = models["original"].config.vocab_size
    rows = []
    with torch.inference_mode():
        for length in [n for n in lengths if n <= limit] or [limit]:
            tokens = torch.randint(min(3, vocabulary - 1), vocabulary, (1, length),
                                   generator=torch.Generator().manual_seed(length))
            calls = {name: _decode_step(model, tokens) if language_model else _forward(model, tokens)
                     for name, model in models.items()}
            seconds = interleaved(calls, repeats)
            per_token = {name: value / (1 if language_model else length) for name, value in seconds.items()}
            rows.append({"tokens": length, "original_ms": round(per_token["original"] * 1000, 4),
                         "collaborative_ms": round(per_token["collaborative"] * 1000, 4),
                         "ratio": round(per_token["collaborative"] / per_token["original"], 3)})
    return {"measure": "one decode step with the cache holding n tokens" if language_model
            else "one forward pass of n tokens, divided by n",
            "device": "cpu", "threads": torch.get_num_threads(), "repeats": repeats, "lengths": rows}


def _forward(model, tokens: torch.Tensor):
    mask = torch.ones_like(tokens)
    return lambda: model(input_ids=tokens, attention_mask=mask)


def _decode_step(model, tokens: torch.Tensor):
    """A cache of n - 1 prompt tokens, then the n-th token through it; the cache is cut back after each step, so
    every timed step is the same step."""
    cache = model(input_ids=tokens[:, :-1], use_cache=True).past_key_values
    last = tokens[:, -1:]

    def step():
        model(input_ids=last, cache=cache, use_cache=True)
        cache.crop(-1)  # drop the step's token

    return step


def interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call, run A B A B ... after one warm-up each (benchmarks/ time the same way)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up: first-call allocations and kernel choices are not what a user's steady state sees
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}
