"""What a calibrated run costs against its physical floor: one plain forward pass of the original over the same
calibration tokens (issue 35), measured side by side in one run.

    python benchmarks/calibration_cost.py [--model smollm2|minilm|qwen2-0.5b-shape|FOLDER] [--budget "--key-cache 0.5"]
        [--documents 300] [--max-length 128] [--extra "--distill-steps 0"] [--profile FILE.svg]

1. The floor: the original loaded as transformers loads it by default (the checkpoint's own dtype: float32 for
   MiniLM and the GGUF SmolLM2, bfloat16 for most hub checkpoints; --floor-dtype to choose), the calibration texts
   tokenised and cut at --max-length, and `model(**batch)` over them in batches of about 4096 padded tokens, under
   inference mode, with the CLI's thread count. Timed past loading, once before the CLI run and once after it: the
   floor is their mean (the machine's speed drifted by 20% between runs an hour apart).
2. The CLI as a user runs it: `collab-convert compress MODEL BUDGET --calibration FILE --calibration-samples N
   --calibration-max-length L`, wall time, and from its report.json the time past imports and each stage's.
Printed: every stage in seconds and as a multiple of the floor, and the whole run's multiple (target: at most
2.0). --profile records the CLI run with py-spy (a flame graph), to see where a stage's time goes.
3. With --distill-steps in --extra: one distillation step (report.json's distillation.seconds_per_step: the batch,
   the original's forward, the result's forward and backward, Adam's update) against one forward-backward pass of
   the original (every weight trainable, as a plain fine-tune's step, in the plain pass's dtype) on batches of the
   same shape (the texts a step takes, cut alike), with the CLI's thread count, median of 5.

Text: Brown documents of about 200 words (benchmarks/calibration_documents.py), the calibration side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_documents import chosen_documents, probe_documents  # noqa: E402

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "minilm": None}
BATCH_TOKENS = 4096


def _torch_dtype(name: str):
    """--floor-dtype as from_pretrained takes it: "auto", or a torch dtype."""
    import torch

    return name if name == "auto" else getattr(torch, name)


def floor_seconds(folder: Path, texts: list[str], max_length: int, threads: int | None,
                  dtype: str = "auto") -> tuple[float, int]:
    """(seconds of one plain forward pass over the texts, real tokens), the model loaded in `dtype` ("auto":
    transformers' default, the checkpoint's own dtype)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from collab_convert.integration.batches import right_padded
    from collab_convert.integration.fidelity import is_language_model

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    auto = AutoModelForCausalLM if is_language_model(config.get("architectures")) else AutoModel
    model = auto.from_pretrained(folder, dtype=_torch_dtype(dtype)).eval()
    encoded = sorted(tokenizer(texts, truncation=True, max_length=max_length)["input_ids"], key=len)
    batches, start = [], 0
    while start < len(encoded):
        count = max(1, BATCH_TOKENS // len(encoded[min(start + 1, len(encoded) - 1)]))
        batches.append(right_padded(encoded[start : start + count], tokenizer.pad_token_id or 0))
        start += count
    started = time.perf_counter()
    with torch.inference_mode():
        for input_ids, attention_mask in batches:
            model(input_ids=input_ids, attention_mask=attention_mask)
    return time.perf_counter() - started, sum(len(ids) for ids in encoded)


def forward_backward_seconds(folder: Path, texts: list[str], max_length: int, threads: int | None,
                             repeats: int = 5, dtype: str = "auto") -> tuple[float, int]:
    """(median seconds of one forward-backward pass of the original on a distillation step's batch, its texts)."""
    import statistics

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from collab_convert.integration.batches import right_padded
    from collab_convert.integration.distillation import objective_for
    from collab_convert.integration.fidelity import is_language_model

    if threads:
        torch.set_num_threads(threads)
    config = json.loads((folder / "config.json").read_text())
    sequences = objective_for(config.get("architectures")).batch_sequences
    causal = is_language_model(config.get("architectures"))
    model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(
        folder, dtype=_torch_dtype(dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    generator, seen = torch.Generator().manual_seed(0), []
    for _ in range(repeats + 1):  # the first warms up
        picks = torch.randperm(len(encoded), generator=generator)[:sequences].tolist()
        input_ids, attention_mask = right_padded([encoded[i] for i in picks], tokenizer.pad_token_id or 0)
        started = time.perf_counter()
        output = model(input_ids=input_ids, attention_mask=attention_mask)
        values = output.logits if causal else output.last_hidden_state
        values.float().logsumexp(-1).mean().backward()
        seen.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(seen[1:]), sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", default=None, help="compress's size flags (default: --key-cache 0.5 for a "
                        "decoder, --rank 192 for MiniLM)")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--extra", default="", help="more compress flags")
    parser.add_argument("--floor-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the plain pass's dtype (auto: transformers' default, the checkpoint's own)")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy flame graph of the CLI run "
                        "(FILE.txt: collapsed stacks)")
    parser.add_argument("--floor-huge-pages", action="store_true", help="the plain pass with torch's huge pages "
                        "(THP_MEM_ALLOC_ENABLE=1), as the CLI asks for them in the decoder forms; by default it runs "
                        "as a user's plain loop does, without (THP_MEM_ALLOC_ENABLE=0 in the environment turns them "
                        "off for both)")
    args = parser.parse_args()
    if args.floor_huge_pages:  # before torch loads here: it reads the setting at its first allocation
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    floor_pages = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"

    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    if args.model == "qwen2-0.5b-shape":  # a 0.5B-class grouped-query decoder, built once (shaped_decoder.py)
        from shaped_decoder import build

        args.model = str(build())
    name = MODELS.get(args.model, args.model) or DEFAULT_MODEL
    folder = resolve_model(name)
    budget = (args.budget or ("--rank 192" if args.model == "minilm" else "--key-cache 0.5")).split()
    calibration, _ = chosen_documents(args.documents, 1)
    # the plain pass before and after the CLI run: the machine's speed drifts by 20% over the minutes one run takes
    import torch

    from collab_convert.cpu import choose_threads

    before, _ = floor_seconds(folder, calibration, args.max_length,
                              choose_threads(None, torch.get_num_threads())[0], args.floor_dtype)  # the CLI's threads
    with tempfile.TemporaryDirectory(prefix="collab-cost-") as scratch:
        text = Path(scratch) / "calibration.txt"
        text.write_text("\n".join(calibration + probe_documents(calibration)) + "\n")
        out = Path(scratch) / "out"
        command = ["collab-convert", "compress", name, *budget, "--calibration", str(text), "--calibration-samples",
                   str(len(calibration)), "--calibration-max-length", str(args.max_length), "-o", str(out), "-q",
                   "--json", *args.extra.split()]
        if args.profile:
            kind = "raw" if args.profile.suffix == ".txt" else "flamegraph"  # raw: collapsed stacks, to count
            command = [shutil.which("py-spy") or "py-spy", "record", "-o", str(args.profile), "--rate", "20",
                       "--format", kind, "--subprocesses", "--", *command]
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        report = json.loads((out / "report.json").read_text())
    threads = (report.get("threads") or {}).get("threads")
    after, tokens = floor_seconds(folder, calibration, args.max_length, threads, args.floor_dtype)
    floor = (before + after) / 2
    print(f"{name}, {' '.join(budget)} {args.extra}; {len(calibration)} documents, {tokens:,} calibration tokens at "
          f"{args.max_length}; {threads} threads")
    cli_pages = bool((report.get("threads") or {}).get("huge_pages"))
    print(f"one plain forward pass of the original ({args.floor_dtype} dtype) over them: {floor:.1f} s "
          f"(the mean of {before:.1f} s before the CLI run and {after:.1f} s after it); torch's huge pages: "
          f"{'on' if floor_pages else 'off'} in the plain pass, {'on' if cli_pages else 'off'} in the CLI run")
    print(f"{'stage':<28} {'seconds':>8} {'x forward pass':>15}")
    for stage, seconds in report["stage_seconds"].items():
        print(f"{stage:<28} {seconds:8.1f} {seconds / floor:15.2f}")
    print(f"{'whole run past imports':<28} {report['seconds']:8.1f} {report['seconds'] / floor:15.2f}   "
          f"(target 2.0; CLI wall time with imports {wall:.1f} s)")
    figures = {"model": name, "budget": budget, "extra": args.extra, "tokens": tokens, "floor_seconds": floor,
               "floor_seconds_before": before, "floor_seconds_after": after, "floor_dtype": args.floor_dtype,
               "run_seconds": report["seconds"], "wall_seconds": wall, "ratio": report["seconds"] / floor,
               "stage_seconds": report["stage_seconds"], "threads": threads, "floor_huge_pages": floor_pages,
               "cli_huge_pages": cli_pages}
    fidelity = report.get("fidelity") or {}
    if "kl_mean" in fidelity:
        print(f"fidelity on the held-out lines: top-1 {fidelity.get('top1_agreement'):.5f}, "
              f"KL {fidelity['kl_mean']:.5f}")
        figures.update(top1=fidelity.get("top1_agreement"), kl=fidelity["kl_mean"])
    distillation = report.get("distillation")
    if distillation and "seconds_per_step" in distillation:
        pass_seconds, sequences = forward_backward_seconds(folder, calibration, args.max_length, threads,
                                                           dtype=args.floor_dtype)
        step = distillation["seconds_per_step"]
        print(f"one distillation step ({sequences} texts): {step:.2f} s; one forward-backward pass of the original on "
              f"a batch of the same shape: {pass_seconds:.2f} s; ratio {step / pass_seconds:.2f}")
        print(f"distillation's held-out {distillation.get('held_out_measure')}: {distillation.get('before'):.5f} -> "
              f"{distillation.get('after'):.5f} (best at step {distillation.get('best_step')})")
        figures.update(distill_step_seconds=step, forward_backward_seconds=pass_seconds,
                       distill_step_ratio=step / pass_seconds)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
