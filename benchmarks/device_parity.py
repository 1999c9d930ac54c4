"""The calibrated path on a GPU against the CPU, side by side in one run: for whoever has a GPU (none was lent
while --device was built for the whole calibrated path; the tests check it on a stand-in device instead).

    python benchmarks/device_parity.py [--device cuda] [--rank 192] [--documents 300] [--model FOLDER]

Runs `collab-convert compress --rank R --calibration FILE` as a user does, once with --device cpu and once with
--device DEVICE, on the same documents as calibration_documents.py (Brown texts regrouped into ~200-word
documents). Prints the seconds per stage of each run and their ratio, how far apart the two checkpoints'
tensors are, and the embedding cosine of each to the original on held-out documents. The two should agree to
rounding (float32 sums in another order); a GPU run that differs by more than rounding is a bug.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_documents import chosen_documents  # noqa: E402


def compress(model: str, rank: int, text: Path, out: Path, device: str) -> dict:
    subprocess.run(["collab-convert", "compress", model, "--rank", str(rank), "--calibration", str(text), "-o",
                    str(out), "-q", "--json", "--device", device], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "report.json").read_text())


def largest_difference(first: Path, second: Path) -> tuple[float, str]:
    from safetensors import safe_open

    worst, where = 0.0, "identical"
    with (safe_open(str(first / "model.safetensors"), "pt") as a,
          safe_open(str(second / "model.safetensors"), "pt") as b):
        for name in a.keys():  # noqa: SIM118 - not iterable itself
            first_tensor, second_tensor = a.get_tensor(name).double(), b.get_tensor(name).double()
            if first_tensor.numel() == 0:  # an empty tensor (a tiny model's) has no largest difference
                continue
            difference = float((first_tensor - second_tensor).abs().max())
            if difference > worst:
                worst, where = difference, name
    return worst, where


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int, default=192)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--evaluate", type=int, default=200)
    parser.add_argument("--model", default=None, help="the encoder to compress (default: all-MiniLM-L6-v2)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModel, AutoTokenizer

    import collab_convert  # noqa: F401
    from collab_convert.integration.fidelity import cosine_stats, sentence_embeddings
    from collab_convert.devices import unavailable
    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    if unavailable(args.device):
        sys.exit(unavailable(args.device))
    calibration, held_out = chosen_documents(args.documents, args.evaluate)
    source = resolve_model(args.model or DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source)
    with torch.inference_mode():
        reference = sentence_embeddings(AutoModel.from_pretrained(source).eval(), tokenizer, held_out)
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "calibration.txt"
        text.write_text("\n".join(calibration) + "\n")
        runs = {"cpu": "cpu", "device": args.device}  # two runs even with --device cpu (a check of this script)
        folders = {run: Path(scratch) / run for run in runs}
        reports = {run: compress(str(source), args.rank, text, folders[run], device) for run, device in runs.items()}
        print(f"rank {args.rank}, {len(calibration)} calibration documents, {len(held_out)} held-out ones")
        print(f"{'stage':<26} {'cpu s':>8} {args.device + ' s':>10} {'ratio':>7}")
        seconds = {run: {**report["stage_seconds"], "past imports": report["seconds"]}
                   for run, report in reports.items()}
        for stage in dict.fromkeys([*seconds["cpu"], *seconds["device"]]):
            on_cpu, on_device = seconds["cpu"].get(stage, 0.0), seconds["device"].get(stage, 0.0)
            ratio = f"{on_cpu / on_device:7.1f}" if on_device > 0.05 else "      -"
            print(f"{stage:<26} {on_cpu:8.1f} {on_device:10.1f} {ratio}")
        worst, where = largest_difference(folders["cpu"], folders["device"])
        print(f"largest tensor difference between the two checkpoints: {worst:.2e} ({where})")
        for run, folder in folders.items():
            with torch.inference_mode():
                stats = cosine_stats(reference, sentence_embeddings(AutoModel.from_pretrained(folder).eval(),
                                                                    tokenizer, held_out))
            print(f"--device {runs[run]}: cosine to the original {stats.mean:.4f} mean, {stats.p01:.4f} 1st percentile")


if __name__ == "__main__":
    main()
