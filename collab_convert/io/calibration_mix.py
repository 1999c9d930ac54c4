"""Calibration texts that cover lengths and styles: what an encoder is fitted on, from what the user gave.

An encoder calibrated on one kind of text (news documents, say) is then used on everything else: short queries,
chat lines, fiction. Its attention on a ten-token line is not its attention on a 128-token window, and the fit
only sees what the calibration shows it. So the user's texts are mixed (`mixed`):
  - each text as given (cut at the token limit later, as before);
  - a single sentence of it, the sentences taken in turn: short sequences, where [CLS]/[SEP] weigh most;
  - its words past the first window, as further windows (`windows`), so long documents are seen beyond their
    start;
  - with `built_in`, lines of the built-in English text (news, fiction, science, instructions, letters, chat)
    and single sentences of them, spread through the user's texts.
The pieces are interleaved text by text, so whatever reads the first N (the refinement's samples, the token
budget) sees every kind. Pure text work: nothing here knows a tokenizer or a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WORDS_PER_TOKEN = 0.7  # English words per subword token, roughly: where a text passes the token limit
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
MIXES = ("as-given", "lengths", "lengths+built-in")


@dataclass
class Mixed:
    texts: list[str]
    description: str  # what the mix was, for the report
    counts: dict[str, int]


def sentences(text: str) -> list[str]:
    """The sentences of a text, split after . ! ? before a capital or digit (a rough cut: good enough to make
    short sequences of real text)."""
    return [part.strip() for part in SENTENCE_END.split(text) if part.strip()]


def windows(text: str, max_length: int) -> list[str]:
    """The text's words past its first window, in further windows of about `max_length` tokens."""
    words = text.split()
    size = max(int(max_length * WORDS_PER_TOKEN), 8)
    return [" ".join(words[start : start + size]) for start in range(size, len(words), size)
            if len(words[start : start + size]) >= size // 4]


def mixed(texts: list[str], max_length: int, mix: str, built_in: list[str] | None = None) -> Mixed:
    """The calibration texts for `mix` (one of MIXES); `built_in`: the built-in lines, for lengths+built-in."""
    if mix == "as-given":
        return Mixed(list(texts), "the texts as given", {"texts": len(texts)})
    extra = list(built_in or []) if mix == "lengths+built-in" else []
    result, counts = [], {"texts": 0, "windows": 0, "sentences": 0, "built-in lines": 0}
    every = max(len(texts) // max(len(extra), 1), 1) if extra else 0
    for index, text in enumerate(texts):
        result.append(text)
        counts["texts"] += 1
        pieces = sentences(text)
        if len(pieces) > 1:
            result.append(pieces[index % len(pieces)])
            counts["sentences"] += 1
        for window in windows(text, max_length):
            result.append(window)
            counts["windows"] += 1
        if extra and index % every == 0:
            line = extra.pop(0)
            result.append(line)
            counts["built-in lines"] += 1
            short = sentences(line)
            if len(short) > 1:
                result.append(short[0])
                counts["sentences"] += 1
    description = (f"{counts['texts']} texts as given, {counts['windows']} further windows of their long texts, "
                   f"{counts['sentences']} single sentences" + (f", {counts['built-in lines']} built-in lines"
                                                              if mix == "lengths+built-in" else ""))
    return Mixed(result, description, counts)
