"""Calibration texts as token batches, and the batch running now: what every calibration pass shares.

Texts run in batches of similar length, padded on the right; observers cut each sequence back to its real
tokens (CurrentBatch.sequences), so no padding token is ever counted. The cost is bounded by a token budget,
not by the number or length of the texts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BATCH_TOKENS = 4096  # padded tokens per forward pass: the activations of one batch stay small
BATCH_SEQUENCES = 64
# a batch's activations inside one block, roughly: wide models get fewer tokens. At 96 MiB the calibrating stage
# of a 12-layer GPT-2-medium-shaped checkpoint peaked at 205-209 MB above the imports, at 64 MiB 175 MB
ACTIVATION_BYTES = 64 << 20
# a block's activations per token and hidden unit: the 4x-wide feed-forward twice, queries, keys, values (about 16
# float32 numbers)
ACTIVATION_BYTES_PER_UNIT = 64


def batch_tokens(width: int | None) -> int:
    """Padded tokens per batch for a model of hidden size `width`: a block's activations
    (ACTIVATION_BYTES_PER_UNIT a token and hidden unit) within ACTIVATION_BYTES. all-MiniLM-L6-v2 (384): 2730
    tokens; SmolLM2 (576): 1820; GPT-2-medium (1024): 1024. BATCH_TOKENS where the width is unknown."""
    if not width:
        return BATCH_TOKENS
    return max(256, min(BATCH_TOKENS, ACTIVATION_BYTES // (ACTIVATION_BYTES_PER_UNIT * width)))


@dataclass
class CalibrationBatches:
    """Calibration texts as token batches: each (input_ids, attention_mask, lengths), right-padded, sequences of
    similar length together; `tokens`: real tokens in all, at most the budget."""

    batches: list
    tokens: int
    texts: int


def token_batches(tokenizer, texts: list[str], max_length: int, token_budget: int | None,
                  most_tokens: int = BATCH_TOKENS) -> CalibrationBatches:
    """Tokenise `texts` (each cut at `max_length` tokens), keep them in order until `token_budget` real tokens
    (the last one cut to fit), and group them into length-sorted batches of at most `most_tokens` padded tokens."""
    encoded = tokenizer(texts, truncation=True, max_length=max_length, padding=False)["input_ids"]
    kept, tokens = [], 0
    for ids in encoded:
        if token_budget is not None and tokens + len(ids) > token_budget:
            ids = ids[: token_budget - tokens]
        if len(ids) < 1:
            break
        kept.append(ids)
        tokens += len(ids)
    pad = pad_id(tokenizer)
    order = sorted(range(len(kept)), key=lambda i: len(kept[i]))
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        # sorted ascending: the last sequence of a batch is its longest, so padded size = count x its length
        while (end < len(order) and end - start < BATCH_SEQUENCES
               and (end + 1 - start) * len(kept[order[end]]) <= most_tokens):
            end += 1
        chosen = [kept[i] for i in order[start:end]]
        batches.append((*right_padded(chosen, pad), [len(ids) for ids in chosen]))
        start = end
    return CalibrationBatches(batches, tokens, len(kept))


def pad_id(tokenizer) -> int:
    """The id padding takes: the tokenizer's pad token, or 0 where it has none (padding is masked either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def right_padded(sequences: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token id lists, padded on the right to the longest."""
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


@dataclass
class ProbeBatches:
    """Held-out texts as the fidelity check runs them: each text's ids (`encoded`), consecutive texts grouped
    (`chosen`), and each group right-padded into (input_ids, attention_mask) (`batches`)."""

    encoded: list[list[int]]
    chosen: list[list[list[int]]]
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def probe_batches(tokenizer, texts: list[str], max_length: int, config, share: float = 1.0) -> ProbeBatches:
    """The fidelity check's batches of `texts`: the calibration pass runs the same ones through the original
    where it keeps its states for the check (model_runs.KeptStates), so both see equal tensors. `share`: what the
    tokens of a batch are scaled by (model_runs.pass_share, the same on both sides)."""
    encoded = [ids or [pad_id(tokenizer)] for ids in tokenizer(texts, truncation=True, max_length=max_length)
               ["input_ids"]]
    longest = max(map(len, encoded), default=1)
    chosen = _consecutive(encoded, max(longest, int(_body_tokens(config, longest) * share)))
    return ProbeBatches(encoded, chosen, [right_padded(group, pad_id(tokenizer)) for group in chosen])


def _body_tokens(config, longest: int) -> int:
    """Padded tokens per batch of bodies: within calibration's budget, and with activations about what the heads
    hold anyway for one text (both models' float32 logits), so batching adds little to the peak (SmolLM2, 32 texts:
    +119 MB anonymous against +100 MB a text at a time, benchmarks/fidelity_check.py). SmolLM2 (576 wide, 49k
    words): 1365 tokens; GPT-2-medium 785; a 4096-wide model with a 128k vocabulary 256 (calibration's)."""
    width, vocabulary = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
    if not width or not vocabulary:
        return longest  # a text at a time
    logits = 2 * 4 * longest * vocabulary
    return max(longest, min(batch_tokens(width), logits // (ACTIVATION_BYTES_PER_UNIT * width)))


def _consecutive(encoded: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Consecutive texts, as many to a batch as keep its padded size within `budget` tokens (one at least)."""
    batches, current = [], []
    for ids in encoded:
        if current and (len(current) + 1) * max(len(ids), *map(len, current)) > budget:
            batches.append(current)
            current = []
        current.append(ids)
    return batches + ([current] if current else [])


class SeenEverything(Exception):
    """Raised by the last hook of a forward pass: what runs after it is never observed."""


class CurrentBatch:
    """The real length of each sequence in the batch running now, for hooks to cut the padding off; and how
    many observations a forward pass makes, so later passes stop at the last one (the layers after the last
    attention input, e.g. the last feed-forward block, need not run)."""

    def __init__(self):
        self.lengths: list[int] = []
        self.observed = 0
        self.observations: int | None = None  # per forward pass, counted on the first

    def sequences(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """(batch, n, ...) right-padded -> each sequence's real rows."""
        return [hidden[row, :length] for row, length in enumerate(self.lengths)]

    def observed_one(self, stop: bool = True) -> None:
        """One more observation; the last one stops the pass, unless `stop` is False: then `stop_if_seen` does,
        where the observer has heard what it waits for (an attention module's output, for the samples it kept)."""
        self.observed += 1
        if stop:
            self.stop_if_seen()

    def stop_if_seen(self) -> None:
        if self.observed == self.observations:
            raise SeenEverything

    def forward(self, model, inputs: dict, lengths: list[int]) -> None:
        self.lengths, self.observed = lengths, 0
        try:
            model(**inputs)
        except SeenEverything:
            return
        if self.observations is None:
            self.observations = self.observed
