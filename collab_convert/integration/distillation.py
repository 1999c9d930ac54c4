"""Distillation through the whole model: the collaborative parameters of every layer, tuned together.

Each layer is fitted on its own (its attention against the original's, on the original's inputs). That cannot
let one layer make up for what another lost. Here the fitted model (the student) learns the original's outputs
by Adam on the collaborative tensors alone: shared keys, key mixings, cores, shared queries, mixing vectors and
content biases. Every other weight stays as it was. What it learns depends on what the model is for:
  - a language model: the original's next-token distributions (KL, over every real token of the text);
  - an encoder: the original's final token states (1 - cosine, token by token) and its sentence embedding
    (1 - cosine of the mean-pooled states, the sentence-transformers recipe), the two weighted alike.
The step for each tensor is a share of its own scale, so models of any scale and dtype get the same relative
step.

The best state on a held-out tenth of the texts (at most the objective's held_out_max) is kept, judged every
CHECK_EVERY steps by the held-out measure (next-token KL; for an encoder, 1 - cosine of the sentence embeddings),
and the run stops early after PATIENCE checks without a gain. Unlike the rest of a calibrated run, both models are
loaded whole, on the run's device; the best state comes back in host memory. The original's body runs once per
text: its final states are kept for the later steps that draw the text (a language model's next-token
distributions are too large to keep: what its head reads is kept, and the head alone runs again). A bfloat16
checkpoint on a device that multiplies bfloat16 trains in mixed precision: the original in its own dtype, the
result's products under autocast to it, the tuned tensors in float32 (SmolLM2: a step 2.03 s against 3.53 s,
beside a bfloat16 forward-backward pass of 1.7-1.9 s).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import HOST, Device, floating_dtype, host_copy, in_pass_dtype, moved
from ..errors import BadInputError
from ..progress import DETAIL, Progress, no_progress

# The tensors our transform adds: the only ones distillation changes (format.py names them in the checkpoint).
COLLABORATIVE_PARAMETERS = ("shared_query", "shared_key", "mixing", "content_bias", "key_mixing", "query_core",
                            "pass_core")
BATCH_SEQUENCES = 4  # a language model's texts per step
RELATIVE_STEP = 1e-3  # Adam's step as a share of each tensor's root mean square (a language model's)
CHECK_EVERY = 20
PATIENCE = 3
HELD_OUT_SHARE = 10  # one sequence in ten is held out, at most HELD_OUT_MAX
HELD_OUT_MAX = 8


@dataclass
class Distillation:
    objective: str  # what the student learned
    measure: str  # the held-out measure the best state is chosen by
    steps: int  # steps taken (the best state may come from an earlier one)
    best_step: int
    before: float  # the held-out measure before and after
    after: float
    sequences: int  # training sequences
    held_out: int
    trained: int  # parameters tuned
    seconds: float
    seconds_per_step: float  # a training step alone (its batch, both models' passes, the backward, Adam's update)

    def as_dict(self) -> dict:
        found = {"objective": self.objective, "held_out_measure": self.measure, "steps": self.steps,
                 "best_step": self.best_step, "before": self.before, "after": self.after,
                 "sequences": self.sequences, "held_out_sequences": self.held_out,
                 "parameters_tuned": self.trained, "seconds": round(self.seconds, 2),
                 "seconds_per_step": round(self.seconds_per_step, 4)}
        if self.measure == NextTokens.measure:  # the names gates and scripts read for language models
            found.update(kl_before=self.before, kl_after=self.after)
        return found


class NextTokens:
    """A language model's objective: KL(original || result) of the next-token distributions, every real token."""

    objective = "KL of the next-token distributions against the original's, every layer together"
    measure = "next-token KL, nats per token"
    batch_sequences, relative_step, held_out_max = BATCH_SEQUENCES, RELATIVE_STEP, HELD_OUT_MAX
    auto_class = "AutoModelForCausalLM"  # what the student and the teacher load as

    @staticmethod
    def reference(teacher, input_ids, attention_mask) -> torch.Tensor:
        """The original's next-token log-probabilities, (batch, tokens, vocabulary)."""
        return torch.log_softmax(teacher(input_ids=input_ids, attention_mask=attention_mask).logits.float(), -1)

    @staticmethod
    def kept_states(teacher, input_ids, attention_mask, check: bool = True) -> torch.Tensor | None:
        """What the original's output head reads, in the original's dtype: kept in place of the log-probabilities,
        which are vocabulary x tokens floats (SmolLM2: 25 MB a text of 128 tokens; its states 0.15 MB). With
        `check`, None where the head alone does not give the model's logits (a scale or a soft cap after it): then
        they are recomputed at every step. A property of the model: checked on the first batch only."""
        head = teacher.get_output_embeddings()
        if head is None:
            return None
        read = []
        hook = head.register_forward_hook(lambda module, args, output: read.append(args[0]))
        try:
            logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits
        finally:
            hook.remove()
        if len(read) != 1 or read[0].shape[:2] != logits.shape[:2]:
            return None
        if not check:
            return read[0]
        scale = float(logits.float().abs().max().clamp_min(1e-6))
        return read[0] if float((head(read[0]).float() - logits.float()).abs().max()) <= 1e-3 * scale else None

    @staticmethod
    def from_kept(teacher, states: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(teacher.get_output_embeddings()(states).float(), -1)

    @staticmethod
    def losses(target, student, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(training loss summed over the units, held-out measure summed over them, how many units)."""
        real = attention_mask.bool()
        predicted = torch.log_softmax(student(input_ids=input_ids, attention_mask=attention_mask).logits.float(), -1)
        kl = torch.nn.functional.kl_div(predicted, target, log_target=True, reduction="none").sum(-1)[real].sum()
        return kl, kl.detach(), int(real.sum())


class Embeddings:
    """An encoder's objective: its final token states and its mean-pooled sentence embedding, by cosine; one unit
    per sequence. Only the embedding's cosine is the held-out measure: it is what users compare."""

    objective = ("1 - cosine of the final token states and of the mean-pooled sentence embeddings against the "
                 "original's, every layer together")
    measure = "1 - cosine of the sentence embeddings"
    # Measured on all-MiniLM-L6-v2 at rank 192 (300 news documents): 4 texts a step at 1e-3 or 1e-2 never beat the
    # fit on held-out texts (each batch pulled the shared tensors its own way); 16 at 3e-4 gained on every domain
    # scored (benchmarks/cross_domain.py).
    batch_sequences, relative_step = 16, 3e-4
    held_out_max = 64  # an embedding is cheap to score: a steadier choice of the best state
    auto_class = "AutoModel"

    @staticmethod
    def reference(teacher, input_ids, attention_mask) -> torch.Tensor:
        """The original's final token states, (batch, tokens, width)."""
        from .fidelity import text_inputs

        batch = text_inputs(teacher.config, {"input_ids": input_ids, "attention_mask": attention_mask})
        return teacher(**batch).last_hidden_state.float()

    @staticmethod
    def kept_states(teacher, input_ids, attention_mask, check: bool = True) -> torch.Tensor:
        """A text's final states are the reference itself: tokens x width floats, kept in float16 where they fit
        (relative rounding 5e-4: a cosine moves by ~1e-7)."""
        states = Embeddings.reference(teacher, input_ids, attention_mask)
        half = states.to(torch.float16)
        return half if bool(torch.isfinite(half).all()) else states

    @staticmethod
    def from_kept(teacher, states: torch.Tensor) -> torch.Tensor:
        return states.float()

    @staticmethod
    def losses(target, student, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor, int]:
        from .fidelity import mean_pooled, text_inputs

        batch = text_inputs(student.config, {"input_ids": input_ids, "attention_mask": attention_mask})
        states = student(**batch).last_hidden_state.float()
        real = attention_mask.to(states.dtype)
        token_loss = ((1 - torch.nn.functional.cosine_similarity(states, target, dim=-1)) * real).sum(1)
        pooled_loss = 1 - torch.nn.functional.cosine_similarity(mean_pooled(states, attention_mask),
                                                                mean_pooled(target, attention_mask), dim=-1)
        tokens = real.sum(1).clamp_min(1.0)
        return (token_loss / tokens + pooled_loss).sum(), pooled_loss.detach().sum(), input_ids.shape[0]


def objective_for(architectures: list[str] | None):
    from .fidelity import is_language_model

    return NextTokens if is_language_model(architectures) else Embeddings


def distill(original: Path, result: Path, texts: list[str], max_length: int, steps: int, seed: int = 0,
            progress: Progress = no_progress, device: Device = HOST, names: list[str] | None = None,
            objective=NextTokens) -> tuple[dict[str, torch.Tensor], Distillation]:
    """Tune the collaborative tensors of the checkpoint at `result` (or the checkpoint tensors `names`) against the
    model at `original`, by `objective` (NextTokens or Embeddings); the best state of the tuned tensors, by
    parameter name in the loaded model (the caller writes them into the checkpoint), and what happened."""
    from .loading import for_measuring, load_tokenizer

    started = time.perf_counter()
    tokenizer = load_tokenizer(original, "distillation")
    teacher = for_measuring(_loaded(objective, original, ours=False, device=device)).to(device)
    student = for_measuring(_loaded(objective, result, ours=True, device=device)).to(device)
    tuned = _tunable(student, names)
    student = _Autocast(student, floating_dtype(teacher), torch.device(device).type)
    sequences = [ids for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
                 if len(ids) >= 2]
    training, held_out = _split(len(sequences), objective.held_out_max)
    references = _References(objective, teacher, sequences, tokenizer.pad_token_id or 0, device)
    generator = torch.Generator().manual_seed(seed)
    step_of = objective.relative_step
    optimiser = torch.optim.Adam([{"params": [p], "lr": step_of * float(p.detach().pow(2).mean().sqrt())}
                                  for p in tuned.values()])
    batch = objective.batch_sequences

    def batch_losses(chosen: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        reference, input_ids, attention_mask = references.of(chosen)
        return objective.losses(reference, student, input_ids, attention_mask)

    @torch.no_grad()
    def held_out_measure() -> float:
        parts = [batch_losses(held_out[i : i + batch]) for i in range(0, len(held_out), batch)]
        return float(sum(measured for _, measured, _ in parts)) / sum(count for _, _, count in parts)

    before = best = held_out_measure()
    best_state, best_step, since_best, step = _snapshot(tuned), 0, 0, 0
    stepping = 0.0  # seconds in training steps, held-out checks apart
    for step in range(1, steps + 1):
        step_started = time.perf_counter()
        picks = torch.randperm(len(training), generator=generator)[:batch].tolist()
        total, _, count = batch_losses([training[i] for i in picks])
        loss = total / count
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        stepping += time.perf_counter() - step_started
        shown = f"training loss {float(loss.detach()):.4f}, held-out {before:.4f} -> {best:.4f}"
        progress(f"distilling{DETAIL}{shown}", step, steps)
        if step % CHECK_EVERY and step != steps:
            continue
        current = held_out_measure()
        if current < best:
            best, best_state, best_step, since_best = current, _snapshot(tuned), step, 0
        else:
            since_best += 1
            if since_best >= PATIENCE:
                break
    report = Distillation(objective.objective, objective.measure, step, best_step, before, best, len(training),
                          len(held_out), sum(p.numel() for p in tuned.values()), time.perf_counter() - started,
                          stepping / max(step, 1))
    return best_state, report


class _References:
    """The original's reference for batches of the encoded sequences, made from what objective.kept_states keeps
    (an encoder's final states, what a language model's head reads) the first time a batch draws a sequence, in
    host memory: the original's body runs once per text, not once per step that draws it (MiniLM, 16 texts a
    step: a third of a step was its forward). Where kept_states gives None, objective.reference every step."""

    def __init__(self, objective, teacher, sequences: list[list[int]], pad: int, device: Device):
        self.objective, self.teacher, self.sequences, self.pad, self.device = objective, teacher, sequences, pad, device
        self.kept: dict[int, torch.Tensor] = {}
        self.keeps = True  # until kept_states says the objective cannot

    def of(self, chosen: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reference, input_ids, attention_mask) of these sequences, right-padded."""
        input_ids, attention_mask = self._padded(chosen)
        missing = [i for i in chosen if i not in self.kept]
        if missing and self.keeps:
            with torch.no_grad():
                computed = self.objective.kept_states(self.teacher, *self._padded(missing), check=not self.kept)
            self.keeps = computed is not None
            for row, i in enumerate(missing if self.keeps else []):
                self.kept[i] = host_copy(computed[row, : len(self.sequences[i])])
        with torch.no_grad():
            if not self.keeps:
                return self.objective.reference(self.teacher, input_ids, attention_mask), input_ids, attention_mask
            kept = [self.kept[i] for i in chosen]
            dtype = functools.reduce(torch.promote_types, (k.dtype for k in kept))  # float16, unless one did not fit
            states = torch.zeros(*input_ids.shape, kept[0].shape[-1], dtype=dtype, device=self.device)
            for row, (i, states_of) in enumerate(zip(chosen, kept)):
                states[row, : len(self.sequences[i])] = states_of.to(self.device)
            return self.objective.from_kept(self.teacher, states), input_ids, attention_mask

    def _padded(self, chosen: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from .batches import right_padded

        return moved(right_padded([self.sequences[i] for i in chosen], pad=self.pad), self.device)


def _loaded(objective, folder: Path, ours: bool, device: Device = HOST):
    """The model in `folder` as the objective's auto class. Ours (the result, through our loader) in float32: the
    tuned tensors' master copy. The original in its own dtype where the device multiplies it natively
    (devices.pass_dtype: a bfloat16 checkpoint's forward at half a float32 one's time), else in float32."""
    import transformers

    from .loading import load_model

    auto_class = getattr(transformers, objective.auto_class)
    if ours:
        return load_model(folder, auto_class, dtype=torch.float32)
    return in_pass_dtype(auto_class.from_pretrained(folder), device)


class _Autocast:
    """The student called under autocast to the teacher's dtype where that is a half precision: its products in
    the precision the original runs in, its tuned float32 tensors the master copy Adam updates (mixed-precision
    training). In float32 it is the student itself. (A float32 encoder's steps in bfloat16 on a CPU with bfloat16
    units: MiniLM's step in 0.6 of its time, but each step gained a quarter less: not taken.)"""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device_type: str):
        self.model, self.dtype, self.device_type = model, dtype, device_type

    @property
    def config(self):
        return self.model.config

    def __call__(self, **inputs):
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.model(**inputs)


def _split(count: int, most: int = HELD_OUT_MAX) -> tuple[list[int], list[int]]:
    """(training, held-out) sequence numbers: one in HELD_OUT_SHARE held out, spread over the file as its topics may
    be."""
    if count < 2:
        raise BadInputError("--distill-steps needs at least two calibration texts of two tokens or more")
    held = min(max(count // HELD_OUT_SHARE, 1), most)
    stride = count // held
    held_out = [i * stride for i in range(held)]
    return [i for i in range(count) if i % stride or i // stride >= held], held_out


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

