"""How close a compressed model stays to its base on real text: embedding cosines, next-token agreement."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..devices import HOST, Device, moved, unavailable
from ..errors import BadInputError
from ..options import gate_failures
from ..results import VerifyResult


@torch.no_grad()
def sentence_embeddings(model, tokenizer, texts: list[str], batch_size: int = 64, max_length: int = 128,
                        progress=None, what: str = "embedding", device: Device = HOST):
    """Mean-pooled final hidden states over real tokens (the sentence-transformers recipe), L2-normalised, in
    host memory; the model runs on `device`."""
    model.eval()
    chunks = []
    for start in range(0, len(texts), batch_size):
        if progress:
            progress(what, start, len(texts))
        batch = tokenizer(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batch = moved(text_inputs(model.config, dict(batch)), device)
        pooled = mean_pooled(model(**batch).last_hidden_state, batch["attention_mask"])
        chunks.append(torch.nn.functional.normalize(pooled, dim=-1).to(HOST))
    if progress:
        progress(what, len(texts), len(texts))
    return torch.cat(chunks)


def text_inputs(config, batch: dict) -> dict:
    """A tokenised batch as the model takes it: an encoder-decoder's decoder reads the text too, as in calibration."""
    if getattr(config, "is_encoder_decoder", False):
        return {**batch, "decoder_input_ids": batch["input_ids"], "decoder_attention_mask": batch["attention_mask"]}
    return batch


def mean_pooled(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of each sequence's final states over its real tokens (in float32): the sentence embedding before
    normalising (the sentence-transformers recipe)."""
    mask = attention_mask.unsqueeze(-1).float()
    return (states.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)


@dataclass
class CosineStats:
    mean: float
    p01: float  # 1st percentile: the worst sentences
    minimum: float
    count: int
    worst: list[tuple[int, float]] = field(default_factory=list)  # (index of the text, its cosine), lowest first


WORST_SHOWN = 5  # the texts a report names where the model suffers most


def cosine_stats(reference: torch.Tensor, candidate: torch.Tensor) -> CosineStats:
    cos = torch.nn.functional.cosine_similarity(reference.double(), candidate.double(), dim=-1)
    lowest = torch.argsort(cos)[:WORST_SHOWN].tolist()
    return CosineStats(
        mean=float(cos.mean()),
        p01=float(torch.quantile(cos, 0.01)),
        minimum=float(cos.min()),
        count=int(cos.numel()),
        worst=[(index, float(cos[index])) for index in lowest],
    )


def worst_texts(stats: CosineStats, texts: list[str], width: int = 100) -> list[dict]:
    """The texts with the lowest cosines, each cut to `width` characters on one line, for reports."""
    shown = []
    for index, cosine in stats.worst:
        text = " ".join(texts[index].split())
        shown.append({"cosine": cosine, "text": text if len(text) <= width else text[: width - 3] + "..."})
    return shown


def is_language_model(architectures: list[str] | None) -> bool:
    """Whether a config's architectures predict next tokens (then next-token agreement is measured too)."""
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures or [])


LOGIT_BYTES = 16 << 20  # a batch's float32 logits: a 50k vocabulary at 128 tokens is 26 MB a text (then one at a time)


@dataclass
class LanguageModelFidelity:
    cosine: CosineStats  # sentence embeddings (mean-pooled final states of the base model)
    top1_agreement: float
    kl_mean: float


@torch.no_grad()
def compare_language_models(model, base, tokenizer, texts: list[str], max_length: int = 128, progress=None,
                            device: Device = HOST) -> LanguageModelFidelity:
    """Sentence-embedding cosines, next-token top-1 agreement and mean KL(base || model), from one forward pass of
    each model per batch: the embedding is read off the base model's final states (a hook) while the head computes
    the logits, so neither model runs twice. Texts run right-padded (a causal model's real positions never see the
    padding after them), as many in a batch as keep its logits within LOGIT_BYTES."""
    from .batches import right_padded

    encoded = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    longest = max((len(ids) for ids in encoded), default=1)
    batch_size = max(1, LOGIT_BYTES // (4 * longest * base.config.get_text_config().vocab_size))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pooled = {"model": [], "base": []}
    agree, total, kl_sum = 0, 0, 0.0
    for start in range(0, len(encoded), batch_size):
        if progress:
            progress("measuring fidelity", start, len(encoded))
        chosen = [ids or [pad] for ids in encoded[start : start + batch_size]]
        input_ids, attention_mask = moved(right_padded(chosen, pad), device)
        logits = {}
        for name, which in (("base", base), ("model", model)):
            states, logits[name] = _states_and_logits(which, input_ids, attention_mask)
            embedding = mean_pooled(states, attention_mask)
            pooled[name].append(torch.nn.functional.normalize(embedding, dim=-1).to(HOST))
            del states
        real = attention_mask.bool()  # every real position's next-token distribution
        base_rows, model_rows = logits["base"][real], logits["model"][real]
        del logits
        same, divergence = _next_token_agreement(base_rows, model_rows)
        agree, kl_sum, total = agree + same, kl_sum + divergence, total + base_rows.shape[0]
    if progress:
        progress("measuring fidelity", len(encoded), len(encoded))
    cosine = cosine_stats(torch.cat(pooled["base"]), torch.cat(pooled["model"]))
    return LanguageModelFidelity(cosine, agree / max(total, 1), kl_sum / max(total, 1))


# Positions whose float32 next-token distributions are formed at once: 32 rows of a 50k vocabulary are 6 MB a
# tensor, where a text's whole (128 positions) were 26 MB, six times over (two models, exp, difference, product).
DISTRIBUTION_ROWS = 32


def _next_token_agreement(base_logits: torch.Tensor, model_logits: torch.Tensor) -> tuple[int, float]:
    """(positions where the two models' most likely next token agrees, the summed KL(base || model)) of two
    (positions, vocabulary) logit matrices, a few rows at a time."""
    agree, kl_sum = 0, 0.0
    for first in range(0, base_logits.shape[0], DISTRIBUTION_ROWS):
        p = torch.log_softmax(base_logits[first : first + DISTRIBUTION_ROWS].float(), -1)
        q = torch.log_softmax(model_logits[first : first + DISTRIBUTION_ROWS].float(), -1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl_sum += float((p.exp() * (p - q)).sum())
    return agree, kl_sum


def _states_and_logits(model, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(the base model's final states, the logits) of a ...ForCausalLM, from one forward pass."""
    body = getattr(model, model.base_model_prefix)
    seen = {}
    handle = body.register_forward_hook(lambda module, args, output: seen.update(states=output[0]))
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        handle.remove()
    return seen["states"], logits


# What two checkpoints must share for their outputs to be compared: the width of the states, and the vocabulary
# the next-token distributions range over.
COMPARED_SIZES = ("hidden_size", "vocab_size")


def check_same_shape(model: str, config, against: str, base_config) -> None:
    """One line, before either model is loaded, where the two cannot be compared."""
    for key in COMPARED_SIZES:
        mine, theirs = getattr(config, key, None), getattr(base_config, key, None)
        if mine != theirs:
            raise BadInputError(f"{model} and {against} differ in {key} ({mine} and {theirs}), so their outputs "
                                "cannot be compared; verify a compressed model --against the model it came from")


def verify(model: str, against: str | None, texts: list[str], thresholds: dict[str, float] | None = None,
           max_length: int = 128, progress=None, device: str = "cpu") -> VerifyResult:
    """Load both checkpoints on `device` and compare them on `texts`; list every threshold that fails. `against`
    None: the base the checkpoint records."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from ..architectures.lookup import within_positions
    from ..format import recorded_base
    from ..io.folders import resolve_model
    from .loading import for_measuring, load_tokenizer, register

    if unavailable(device):
        raise BadInputError(unavailable(device))
    register()
    folder = resolve_model(model)
    against = against or recorded_base(folder)
    if against is None:
        raise BadInputError(f"{model} records no base model (no report.json of collab-convert's); give --against "
                            "MODEL")
    base_folder = resolve_model(against)
    tokenizer = load_tokenizer(folder, f"verifying {model}")
    config = AutoConfig.from_pretrained(base_folder)
    check_same_shape(model, AutoConfig.from_pretrained(folder), against, config)
    causal = is_language_model(config.architectures)
    max_length = within_positions(config.to_dict(), max_length)
    # On a CPU both run in float32 whatever they store (compress --dtype f16, a bf16 original): the figures then
    # measure the weights, not half-precision arithmetic (which CPUs also run several times slower).
    dtype = torch.float32 if str(device).startswith("cpu") else "auto"
    if causal:  # one pass of each model gives the embeddings and the next-token figures
        measured = compare_language_models(
            for_measuring(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)).to(device),
            for_measuring(AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype)).to(device),
            tokenizer, texts, max_length, progress, device)
        cos = measured.cosine
    else:
        base = for_measuring(AutoModel.from_pretrained(base_folder, dtype=dtype)).to(device)
        compressed = for_measuring(AutoModel.from_pretrained(folder, dtype=dtype)).to(device)
        cos = cosine_stats(
            sentence_embeddings(base, tokenizer, texts, max_length=max_length, progress=progress,
                                what="embedding (base)", device=device),
            sentence_embeddings(compressed, tokenizer, texts, max_length=max_length, progress=progress,
                                what="embedding (compressed)", device=device),
        )
    result = VerifyResult(model, against, len(texts), cos.mean, cos.p01, cos.minimum,
                          worst_texts=worst_texts(cos, texts))
    if causal:
        result.top1_agreement, result.kl_mean = measured.top1_agreement, measured.kl_mean
    result.failures = gate_failures(result.to_dict(), thresholds or {})
    return result


