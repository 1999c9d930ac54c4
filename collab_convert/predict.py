"""What a rank will give, measured before the user commits to it: the embedding cosine of the compressed model
to the original on a few texts.

For each rank asked about, the form writes a scratch checkpoint as a real compression would (`write`, handed in
by the form), which is loaded the way a user loads it (transformers + our quantizer) and compared with the
original on the probe texts: the number is what `verify` would print for that checkpoint on those texts. The
form's statistics are collected once; the refinement is left out (it only ever improves the fit), so an estimate
errs on the cautious side. Any form's finished checkpoint is measured the same way (measured).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .architectures.source import SourceModel
from .options import CompressOptions
from .progress import Progress, no_progress
from .stages import ProbeTexts

DEFAULT_TARGET_COSINE = 0.99
PROBE_FILE = Path(__file__).parent / "data" / "probe_sentences.txt"


@dataclass
class Estimate:
    rank: int
    cosine_mean: float
    cosine_p01: float


def default_probe() -> ProbeTexts:
    texts = [line for line in PROBE_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return ProbeTexts(texts, f"{len(texts)} built-in English sentences (collab_convert/data)")


def can_measure(source: SourceModel) -> bool:
    """Text models with a tokenizer: a fidelity estimate needs text to run them on."""
    return any((source.folder / name).is_file() for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                                                                  "spiece.model", "vocab.json"))


def states_to_keep(source: SourceModel, options: CompressOptions, held_out: ProbeTexts | None):
    """What the calibration pass keeps of the original for the fidelity check (integration/model_runs.KeptStates):
    a language model's states on the held-out texts, which the check then need not compute again; else None."""
    from .integration.fidelity import is_language_model
    from .integration.model_runs import KeptStates

    if held_out is None or not is_language_model(source.config.get("architectures")) or not can_measure(source):
        return None
    return KeptStates(held_out.texts, options.calibration_max_length)


class FidelityEstimator:
    """Embedding cosine of the collaborative model to the original, at any rank, on fixed probe texts. Models are
    loaded with their blocks offloaded to disk (one block in memory as it runs), so measuring a model does not
    hold it, or two of it, in memory; their blocks run in the checkpoint's own dtype where the device multiplies
    it natively, float32 elsewhere (_loaded)."""

    def __init__(self, source: SourceModel, options: CompressOptions, probe: ProbeTexts,
                 write: Callable[[Path, dict[str, int], Progress], None] | None = None):
        """`write(folder, ranks, progress)` writes a checkpoint at these ranks (by layer) into an empty folder,
        where ranks are searched."""
        from .integration.batches import batch_tokens
        from .integration.loading import load_tokenizer

        self.source, self.options, self.probe, self.write = source, options, probe, write
        self.tokenizer = load_tokenizer(source.folder, "a fidelity estimate")
        # as many texts per forward pass as keep a block's activations small (calibration's batch size)
        self.batch_size = max(1, batch_tokens(source.width) // options.calibration_max_length)
        self._reference = None
        self._dtypes: dict[Path, torch.dtype] = {}  # the dtype each measured checkpoint's blocks ran in
        self.cache: dict[int, Estimate] = {}
        self.kept = None  # the original's states on the probe texts, where calibration kept them (model_runs)

    @property
    def reference(self):
        """The original's embeddings of the probe texts, computed when a cosine first needs them."""
        if self._reference is None:
            from .integration.fidelity import sentence_embeddings

            original = self._loaded(self.source.folder)
            self._reference = sentence_embeddings(original, self.tokenizer, self.probe.texts,
                                                  batch_size=self.batch_size,
                                                  max_length=self.options.calibration_max_length,
                                                  device=self.options.device)
        return self._reference

    def at(self, rank: int, progress: Progress = no_progress) -> Estimate:
        if rank not in self.cache:
            self.cache[rank] = self._measure(rank, progress)
        return self.cache[rank]

    def _measure(self, rank: int, progress: Progress) -> Estimate:
        ranks = {layer.prefix: min(rank, layer.shape.key_dim) for layer in self.source.layers}
        with tempfile.TemporaryDirectory(prefix="collab-estimate-") as scratch:
            folder = Path(scratch)
            self.write(folder, ranks, progress)
            cosine_mean, cosine_p01 = self.cosines(folder)
        return Estimate(rank, cosine_mean, cosine_p01)

    def cosines(self, folder: Path) -> tuple[float, float]:
        """Mean and 1st-percentile cosine of a written collaborative checkpoint's embeddings to the original's."""
        stats = self._cosine_stats(folder)
        return stats.mean, stats.p01

    def _cosine_stats(self, folder: Path):
        from .integration.fidelity import cosine_stats, sentence_embeddings

        model = self._loaded(folder)
        return cosine_stats(self.reference, sentence_embeddings(
            model, self.tokenizer, self.probe.texts, batch_size=self.batch_size,
            max_length=self.options.calibration_max_length, device=self.options.device))

    def measured(self, folder: Path, progress=None) -> dict:
        """Fidelity of a finished checkpoint, for its report and card: cosines, the held-out texts it serves
        worst, and for language models the next-token top-1 agreement and KL (one pass of each model gives both:
        integration/fidelity.compare_language_models, which reports its blocks and texts to `progress`: SmolLM2's
        check is 20 s)."""
        from .integration.fidelity import compare_language_models, is_language_model, worst_texts
        from .integration.model_runs import pass_share

        next_tokens = {}
        if is_language_model(self.source.config.get("architectures")):
            from transformers import AutoModelForCausalLM

            device = self.options.device
            found = compare_language_models(
                self._loaded(folder, AutoModelForCausalLM), self._loaded(self.source.folder, AutoModelForCausalLM),
                self.tokenizer, self.probe.texts, self.options.calibration_max_length, progress, device=device,
                prefixes=[layer.prefix for layer in self.source.layers], kept=self.kept,
                share=pass_share(self.source.folder, device))
            stats, next_tokens = found.cosine, {"top1_agreement": found.top1_agreement, "kl_mean": found.kl_mean}
        else:
            stats = self._cosine_stats(folder)
        return {"measured_on": self.probe.description, "computed_in": self._computed_in(folder),
                "cosine_mean": stats.mean, "cosine_p01": stats.p01, "worst_texts": worst_texts(stats, self.probe.texts),
                **next_tokens}

    def _loaded(self, folder: Path, auto_class=None):
        """A checkpoint as measured here: its blocks offloaded (one in memory as it runs), and run in the
        checkpoint's own dtype where the device multiplies it natively, as transformers runs it (devices.pass_dtype:
        a bfloat16 checkpoint on a CPU with AVX512-BF16 in bfloat16, at half the float32 time; SmolLM2's held-out
        KL 0.12045 in float32, 0.12088 so). The heads still compute float32 logits (heads.float32_in_slices)."""
        from .integration.layerwise import blocks_dtype, load_offloaded

        model = load_offloaded(folder, auto_class, self.options.device, native=True)
        self._dtypes[Path(folder)] = blocks_dtype(model)
        return model

    def _computed_in(self, folder: Path) -> str:
        """The precision the figures were computed in: the result's blocks', and the original's where it differs."""
        result, original = (str(self._dtypes.get(Path(f), torch.float32)).removeprefix("torch.")
                            for f in (folder, self.source.folder))
        return result if result == original else f"{result} (the original in {original})"

    def smallest_rank(self, target: float, progress: Progress = no_progress) -> Estimate:
        """The smallest multiple of the head count whose mean cosine reaches `target` (bisection: fidelity grows
        with rank), or the full rank, which is exact."""
        step = min(layer.shape.num_heads for layer in self.source.layers)
        full = max(layer.shape.key_dim for layer in self.source.layers)
        low, high = 1, full // step  # in units of step; the full rank always reaches any target
        probes, total = 0, max((high - low).bit_length(), 1)
        while low < high:
            middle = (low + high) // 2
            progress("searching ranks", probes, total)
            if self.at(middle * step).cosine_mean >= target:
                high = middle
            else:
                low = middle + 1
            probes += 1
        progress("searching ranks", total, total)
        return self.at(low * step) if low * step < full else Estimate(full, 1.0, 1.0)
