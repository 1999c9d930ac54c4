"""How close a compressed model stays to its base on real text: embedding cosines, next-token agreement."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cpu import BoundedHeap, bound_primitive_cache, release_unreachable, return_freed_heap, reused_heap
from ..devices import HOST, Device, moved, unavailable
from ..errors import BadInputError
from ..options import gate_failures
from ..results import VerifyResult
from .bodies import block_names, bodies_by_block, body_output, finished_bodies
from .model_runs import FREE_HEAP_BOUND, KeptStates, pass_share


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


@dataclass
class LanguageModelFidelity:
    cosine: CosineStats  # sentence embeddings (mean-pooled final states of the base model)
    top1_agreement: float
    kl_mean: float


@torch.no_grad()
def compare_language_models(model, base, tokenizer, texts: list[str], max_length: int = 128, progress=None,
                            device: Device = HOST, prefixes: list[str] | None = None,
                            kept: KeptStates | None = None, share: float = 1.0) -> LanguageModelFidelity:
    """Sentence-embedding cosines, next-token top-1 agreement and mean KL(base || model), from one pass of each
    model's body per batch of texts and one of its head per text.

    The bodies run on several texts at once (_body_tokens), right-padded (a causal model's real positions never see
    the padding after them): an offloaded model reloads every block for each batch, which per text was a quarter of
    this check's time on SmolLM2. Where the models are one stack of blocks holding the attention layers `prefixes`
    (layerwise.block_stack), the bodies run a block at a time over all the batches (bodies.bodies_by_block). The
    embedding is the mean of the final states; the head then runs a text at a time (a text's logits over a 50k
    vocabulary are 26 MB) through the model's own forward, its body standing in with the states already computed,
    so whatever the model does after its body (logit soft-capping, scaling) is its own code. Where the calibration
    pass kept the base's stack output on these texts (`kept`, model_runs.KeptStates), its blocks do not run here.
    `share`: the batches' tokens scaled by it (model_runs.pass_share of the original)."""
    from .batches import probe_batches

    probe = probe_batches(tokenizer, texts, max_length, base.config.get_text_config(), share)
    encoded, chosen = probe.encoded, probe.chosen
    release_unreachable()  # what the work before let go: the first pass should not pile on it either
    batches = [moved(batch, device) for batch in probe.batches]
    stack = block_names(base, prefixes)
    reused = kept is not None and kept.serve(texts, max_length, stack, len(batches))
    steps = _Steps(progress, (1 if reused else 2) * (len(stack) if stack else len(batches)) + len(encoded))
    bodies = {"base": finished_bodies(base, batches, stack, [moved(states, device) for states in kept.states],
                                      kept.as_tuple) if reused else _bodies(base, batches, stack, steps),
              "model": _bodies(model, batches, stack, steps)}
    pooled = {name: torch.cat([torch.nn.functional.normalize(mean_pooled(output[0], mask), dim=-1).to(HOST)
                               for output, (_, mask) in zip(outputs, batches)]) for name, outputs in bodies.items()}
    agree, total, kl_sum = 0, 0, 0.0
    # the texts' logits and distributions, the same few sizes text after text, on a reused and bounded heap (mapped
    # and zeroed afresh, SmolLM2's heads took 6-8 s instead of 4). The heads' weights still load at each call:
    # both held at once were 206 MB on a GPT-2-sized vocabulary (benchmarks/memory.py's fidelity peak, +167 MB)
    with reused_heap():
        heap = BoundedHeap(FREE_HEAP_BOUND)
        for batch, ((input_ids, _), group) in enumerate(zip(batches, chosen)):
            for row, ids in enumerate(group):
                logits = {name: head_logits(which, _output_of(type(bodies[name][batch]),
                                                              bodies[name][batch][0][row : row + 1, : len(ids)]),
                                            input_ids[row : row + 1, : len(ids)])
                          for name, which in (("base", base), ("model", model))}
                same, divergence = _next_token_agreement(logits["base"][0], logits["model"][0])
                del logits
                agree, kl_sum, total = agree + same, kl_sum + divergence, total + len(ids)
                heap.check()
                steps()
    steps.finish()
    cosine = cosine_stats(pooled["base"], pooled["model"])
    return LanguageModelFidelity(cosine, agree / max(total, 1), kl_sum / max(total, 1))


class _Steps:
    """The fidelity check's progress: blocks (or batches) of both bodies, then texts through the heads."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0
        if progress:
            progress("measuring fidelity", 0, total)

    def __call__(self) -> None:
        self.done += 1
        if self.progress:
            self.progress("measuring fidelity", min(self.done, self.total), self.total)

    def finish(self) -> None:
        if self.progress:
            self.progress("measuring fidelity", self.total, self.total)


def _bodies(model, batches: list, stack: list[str] | None, step) -> list:
    """The body's output (final states first, of the body's own type) on each batch: a block at a time where
    `stack` names the blocks, else a pass per batch."""
    if stack:
        return bodies_by_block(model, batches, stack, step)
    outputs = []
    for input_ids, attention_mask in batches:
        outputs.append(body_output(model, input_ids, attention_mask))
        return_freed_heap()  # the pass's freed small blocks, before the next pass piles more on them
        step()
    return outputs


def _output_of(kind: type, states: torch.Tensor):
    """A body's output of this type holding only these final states (a tuple where the body returns tuples)."""
    return kind(last_hidden_state=states) if hasattr(kind, "to_tuple") else (states,)


class _GivenOutput(torch.nn.Module):
    """Stands in for a language model's body: returns an output computed before, as the body would."""

    def __init__(self, output):
        super().__init__()
        self.output, self.calls = output, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.output


def head_logits(model, given_output, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits a ...ForCausalLM gives for `input_ids` whose body returns `given_output` (final states first, of
    the type the body returns): its own forward with the body standing in, so the head and what follows it are
    the model's code."""
    prefix = model.base_model_prefix
    body, given = getattr(model, prefix), _GivenOutput(given_output)
    setattr(model, prefix, given)
    try:
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    finally:
        setattr(model, prefix, body)
    if given.calls != 1 or logits.shape[:2] != input_ids.shape:
        raise RuntimeError(f"{type(model).__name__}'s forward does not compute its logits from its body's states")
    return logits


# Positions whose float32 next-token distributions are formed at once: 32 rows of a 50k vocabulary are 6 MB a
# tensor, where a text's whole (128 positions) were 26 MB, six times over (two models, exp, difference, product).
# The KL's terms are then formed in the two distributions' own tensors: its plain expression's three temporaries
# were 19 MB more at the fidelity check's peak (benchmarks/memory.py, the shared-key form at rank 768).
DISTRIBUTION_ROWS = 32


def _next_token_agreement(base_logits: torch.Tensor, model_logits: torch.Tensor) -> tuple[int, float]:
    """(positions where the two models' most likely next token agrees, the summed KL(base || model)) of two
    (positions, vocabulary) logit matrices, a few rows at a time."""
    agree, kl_sum = 0, 0.0
    for first in range(0, base_logits.shape[0], DISTRIBUTION_ROWS):
        p = torch.log_softmax(base_logits[first : first + DISTRIBUTION_ROWS].float(), -1)
        q = torch.log_softmax(model_logits[first : first + DISTRIBUTION_ROWS].float(), -1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        difference = q.neg_().add_(p)  # p - q, in q's tensor (the same float32 numbers as the subtraction's)
        kl_sum += float(p.exp_().mul_(difference).sum())
    return agree, kl_sum


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
    bound_primitive_cache()
    register()
    folder = resolve_model(model)
    against = against or recorded_base(folder)
    if against is None:
        raise BadInputError(f"{model} records no base model (no report.json of collab-convert's); give --against "
                            "MODEL")
    base_folder = resolve_model(against)
    config = AutoConfig.from_pretrained(base_folder)
    check_same_shape(model, AutoConfig.from_pretrained(folder), against, config)
    tokenizer = load_tokenizer(folder, f"verifying {model}")
    causal = is_language_model(config.architectures)
    max_length = within_positions(config.to_dict(), max_length)
    # On a CPU both run in float32 whatever they store (compress --dtype f16, a bf16 original): the figures then
    # measure the weights, not half-precision arithmetic, so a full-rank result reads exact. compress's own check
    # runs a bf16 checkpoint in bf16 where the CPU multiplies it, as transformers does (predict.FidelityEstimator,
    # devices.pass_dtype), and its report says so.
    dtype = torch.float32 if str(device).startswith("cpu") else "auto"
    if causal:  # one pass of each model gives the embeddings and the next-token figures
        measured = compare_language_models(
            for_measuring(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)).to(device),
            for_measuring(AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype)).to(device),
            tokenizer, texts, max_length, progress, device,
            share=pass_share(base_folder, device, None if dtype == "auto" else dtype))
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


