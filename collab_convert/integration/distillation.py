"""Distillation through the whole model: the collaborative parameters of every layer, tuned together.

Each layer is fitted on its own (its attention against the original's, on the original's inputs). That cannot
let one layer make up for what another lost. Here the fitted model (the student) learns the original's
next-token distributions (KL, over every real token of the calibration text) by Adam on the collaborative
tensors alone: shared keys, key mixings, cores, shared queries, mixing vectors and content biases. Every other
weight stays as it was. The step for each tensor is a share of its own scale, so models of any scale and
dtype get the same relative step.

The best state on a held-out tenth of the texts (at most HELD_OUT_MAX) is kept, judged every CHECK_EVERY
steps, and the run stops early after PATIENCE checks without a gain. Unlike the rest of a calibrated run, both
models are loaded whole, on the run's device; the best state comes back in host memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import HOST, Device, host_copy, moved
from ..errors import BadInputError
from ..progress import DETAIL, Progress, no_progress

# The tensors our transform adds: the only ones distillation changes (format.py names them in the checkpoint).
COLLABORATIVE_PARAMETERS = ("shared_query", "shared_key", "mixing", "content_bias", "key_mixing", "query_core",
                            "pass_core")
BATCH_SEQUENCES = 4
RELATIVE_STEP = 1e-3  # Adam's step as a share of each tensor's root mean square
CHECK_EVERY = 20
PATIENCE = 3
HELD_OUT_SHARE = 10  # one sequence in ten is held out, at most HELD_OUT_MAX
HELD_OUT_MAX = 8


@dataclass
class Distillation:
    steps: int  # steps taken (the best state may come from an earlier one)
    best_step: int
    kl_before: float  # held-out mean KL(original || result) per token, nats
    kl_after: float
    sequences: int  # training sequences
    held_out: int
    trained: int  # parameters tuned
    seconds: float

    def as_dict(self) -> dict:
        return {"objective": "KL of the next-token distributions against the original's, every layer together",
                "steps": self.steps, "best_step": self.best_step, "kl_before": self.kl_before,
                "kl_after": self.kl_after, "sequences": self.sequences, "held_out_sequences": self.held_out,
                "parameters_tuned": self.trained, "seconds": round(self.seconds, 2)}


def distill(original: Path, result: Path, texts: list[str], max_length: int, steps: int, seed: int = 0,
            progress: Progress = no_progress, device: Device = HOST,
            names: list[str] | None = None) -> tuple[dict[str, torch.Tensor], Distillation]:
    """Tune the collaborative tensors of the checkpoint at `result` (or the checkpoint tensors `names`) against the
    model at `original`; the best state of the tuned tensors, by parameter name in the loaded model (the caller
    writes them into the checkpoint), and what happened."""
    from transformers import AutoModelForCausalLM

    from .batches import right_padded
    from .loading import for_measuring, load_model, load_tokenizer

    started = time.perf_counter()
    tokenizer = load_tokenizer(original, "distillation")
    teacher = for_measuring(AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)).to(device)
    student = for_measuring(load_model(result, AutoModelForCausalLM, dtype=torch.float32)).to(device)
    tuned = _tunable(student, names)
    training, held_out = _split(tokenizer(texts, truncation=True, max_length=max_length)["input_ids"])
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam([{"params": [p], "lr": RELATIVE_STEP * float(p.detach().pow(2).mean().sqrt())}
                                  for p in tuned.values()])

    def batch_kl(sequences: list[list[int]]) -> tuple[torch.Tensor, int]:
        """(sum of KL(original || result) over the real tokens, how many)."""
        input_ids, attention_mask = moved(right_padded(sequences, pad=tokenizer.pad_token_id or 0), device)
        real = attention_mask.bool()
        with torch.no_grad():
            target = torch.log_softmax(teacher(input_ids=input_ids, attention_mask=attention_mask).logits.float(), -1)
        predicted = torch.log_softmax(student(input_ids=input_ids, attention_mask=attention_mask).logits.float(), -1)
        kl = torch.nn.functional.kl_div(predicted, target, log_target=True, reduction="none").sum(-1)
        return kl[real].sum(), int(real.sum())

    @torch.no_grad()
    def held_out_kl() -> float:
        parts = [batch_kl(held_out[i : i + BATCH_SEQUENCES]) for i in range(0, len(held_out), BATCH_SEQUENCES)]
        return float(sum(total for total, _ in parts)) / sum(count for _, count in parts)

    before = best = held_out_kl()
    best_state, best_step, since_best, step = _snapshot(tuned), 0, 0, 0
    for step in range(1, steps + 1):
        picks = torch.randperm(len(training), generator=generator)[:BATCH_SEQUENCES].tolist()
        total, count = batch_kl([training[i] for i in picks])
        loss = total / count
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        shown = f"training KL {float(loss.detach()):.4f}, held-out {before:.4f} -> {best:.4f}"
        progress(f"distilling{DETAIL}{shown}", step, steps)
        if step % CHECK_EVERY and step != steps:
            continue
        current = held_out_kl()
        if current < best:
            best, best_state, best_step, since_best = current, _snapshot(tuned), step, 0
        else:
            since_best += 1
            if since_best >= PATIENCE:
                break
    report = Distillation(step, best_step, before, best, len(training), len(held_out),
                          sum(p.numel() for p in tuned.values()), time.perf_counter() - started)
    return best_state, report


def _split(encoded: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """(training, held-out) sequences: one in HELD_OUT_SHARE held out, spread over the file as its topics may be."""
    encoded = [ids for ids in encoded if len(ids) >= 2]
    if len(encoded) < 2:
        raise BadInputError("--distill-steps needs at least two calibration texts of two tokens or more")
    held = min(max(len(encoded) // HELD_OUT_SHARE, 1), HELD_OUT_MAX)
    stride = len(encoded) // held
    held_out = [encoded[i * stride] for i in range(held)]
    return [ids for i, ids in enumerate(encoded) if i % stride or i // stride >= held], held_out


def _tunable(model: torch.nn.Module, names: list[str] | None = None) -> dict[str, torch.nn.Parameter]:
    """The collaborative parameters (or those of the checkpoint tensors `names`) by name in the model; everything
    else frozen."""
    if names is not None:
        return _named(model, names)
    model.requires_grad_(False)
    tuned = {}
    for module_name, module in model.named_modules():
        if not getattr(module, "is_collaborative", False):
            continue
        for name, parameter in module.named_parameters():
            if name.split(".")[0] in COLLABORATIVE_PARAMETERS and parameter.numel():
                tuned[f"{module_name}.{name}"] = parameter.requires_grad_(True)
    if not tuned:
        raise ValueError("the checkpoint has no collaborative parameters to distil")
    return tuned


def _named(model: torch.nn.Module, names: list[str]) -> dict[str, torch.nn.Parameter]:
    """The parameters of these checkpoint tensors (named with or without the head's base-model prefix); everything
    else frozen."""
    model.requires_grad_(False)
    wanted, tuned = set(names), {}
    for name, parameter in model.named_parameters():
        if name in wanted or name.split(".", 1)[-1] in wanted:
            tuned[name] = parameter.requires_grad_(True)
    if len(tuned) != len(wanted):
        raise ValueError(f"the checkpoint's model has {len(tuned)} of the {len(wanted)} tensors to distil")
    return tuned


def _snapshot(tuned: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {name: host_copy(parameter) for name, parameter in tuned.items()}

