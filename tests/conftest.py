"""Tiny models built from configs (no downloads) and the real all-MiniLM-L6-v2 shipped on PyPI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import collab_convert  # noqa: F401 - registers the loader with transformers

# Our own sentences for fixtures: varied length, punctuation, and a few that pad heavily in a batch.
SENTENCES = [
    "The ferry left the harbour an hour late because of the fog.",
    "She planted tomatoes, basil and two rows of beans behind the shed.",
    "Why would anyone schedule a meeting at seven on a Friday evening?",
    "Interest rates rose again, and the housing market slowed through the spring.",
    "My grandfather repaired clocks in a narrow shop near the station.",
    "The committee postponed its decision until the auditors had finished their report.",
    "A small dog barked at the postman.",
    "Photosynthesis converts light energy into chemical energy stored in sugars.",
    "The orchestra rehearsed the second movement until the strings played it cleanly.",
    "He forgot his umbrella on the train, so he arrived soaked.",
    "Volunteers cleared the trail after the storm brought down several old pines.",
    "The recipe calls for a pinch of salt and a cup of warm milk.",
    "Engineers tested the bridge with loaded trucks before it opened to traffic.",
    "Snow fell quietly over the village all night.",
    "The museum's new wing displays maps drawn by sailors in the sixteenth century.",
    "If the battery runs low, the device switches to a power-saving mode automatically.",
    "Children laughed as the puppet show reached its silly ending.",
    "The senator's speech focused on rural hospitals and the cost of prescription drugs.",
    "Fresh bread smells wonderful early in the morning.",
    "After years of drought, the reservoir finally filled to the brim.",
    "The chess champion resigned after a surprising rook sacrifice on move thirty.",
    "Please return the library books before the end of the month.",
    "Researchers observed that the bees returned to the same flowers each day.",
    "The old lighthouse keeper wrote letters to his sister every week.",
    "Traffic was light, so we reached the airport with plenty of time to spare.",
    "The novel follows three generations of a family of fishermen on a remote island.",
    "Wind turbines on the ridge turned slowly in the evening breeze.",
    "He argued that the contract was void because it had never been signed.",
    "The kettle whistled, and she poured water over the tea leaves.",
    "Thunder rolled across the valley as the hikers hurried back to camp.",
    "Our neighbours painted their front door a bright shade of yellow.",
    "Students must submit their essays through the online portal by noon.",
]


def tiny_bert_config(**overrides):
    from transformers import BertConfig

    settings = dict(
        vocab_size=120,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    settings.update(overrides)
    return BertConfig(**settings)


def save_tiny(folder: Path, model_class_name: str = "BertModel", seed: int = 0, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class_name)(tiny_bert_config(**overrides)).eval()
    # Random init gives near-zero biases; real models have sizeable ones, which must survive exactly.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    # Non-weight files a real sentence-embedding checkpoint carries, to check they are copied.
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "x"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return folder


def save_tiny_tokenizer(folder: Path) -> None:
    """A 120-entry WordPiece vocabulary: specials, letters, word pieces and a few whole words."""
    from transformers import BertTokenizerFast

    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["the", "a", "of", "and", "to", "in", "was", "on", "at", "his", "her", "it", "is", "for", "with"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", "'", "-"] + letters
    vocab += ["##" + c for c in letters] + words
    vocab += [f"[unused{i}]" for i in range(120 - len(vocab))]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)


@pytest.fixture
def tiny_bert(tmp_path) -> Path:
    return save_tiny(tmp_path / "tiny-bert")


@pytest.fixture
def token_batch():
    torch.manual_seed(1)
    input_ids = torch.randint(1, 120, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # padding must be honoured
    attention_mask[2, 3:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(folder).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def calibration_file(tmp_path) -> Path:
    path = tmp_path / "calibration.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    from collab_convert.checkpoint import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)
