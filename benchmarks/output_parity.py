"""Do two versions of the code write the same outputs? For a restructure that must change no behaviour.

    git archive OLD_COMMIT | tar -x -C /tmp/old
    python benchmarks/output_parity.py --old /tmp/old [--new .] [--work DIR]

Every case runs in both versions, each in a child process whose PYTHONPATH puts that version's package first:
the five families that offer both forms (GPT-2, GPTBigCode, OPT, BART, T5) x both forms x weight-only and
calibrated, plus BERT (CP, and `--rank auto` with a fidelity target), and three rotary decoders (Llama, Qwen3's
QK-norm, Phi-3's fused projection), weight-only and calibrated; and `analyze` of each family in each form.
Tiny checkpoints are built from configs (fixtures/), with a WordPiece tokenizer so calibration can run.

Compared, file by file: weights (safetensors) and plots byte for byte; config.json byte for byte, then as
JSON; report.json as JSON without seconds, output folder and idle cores; report.md and the card without their
time line. Every difference is printed, so an intended change (a renamed field) can be told from an unintended
one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTH_FORMS = ("gpt2", "gpt_bigcode", "opt", "bart", "t5")
ROTARY = ("llama", "qwen3", "phi3")

# Runs in the child: compress and analyze every case with the version on PYTHONPATH.
RUNNER = r"""
import json, sys
from pathlib import Path
import collab_convert
from collab_convert import AnalyzeOptions, CompressOptions, analyze, compress
print(collab_convert.__file__, file=sys.stderr)
cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
for case in cases:
    if case["job"] == "compress":
        compress(case["model"], CompressOptions(output=out / case["name"], **case["options"]))
    else:
        result = analyze(case["model"], options=AnalyzeOptions(**case["options"]))
        (out / f"{case['name']}.json").write_text(json.dumps(result.to_dict(), indent=1, default=str))
"""


def build_models(folder: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from fixtures.models import ROTARY_CASES, build_family, build_rotary, family_case, save_tiny_tokenizer

    models = {}
    for name in ("bert", *BOTH_FORMS):
        build_family(family_case(name), folder / name)
        models[name] = folder / name
    for name in ROTARY:
        build_rotary(next(case for case in ROTARY_CASES if case.name == name), folder / name)
        models[name] = folder / name
    for model in models.values():
        save_tiny_tokenizer(model)
    return models


def cases(models: dict[str, Path], texts: Path) -> list[dict]:
    calibrated = {"calibration": str(texts), "calibration_samples": 24, "refine_steps": 5}
    found = []
    sizes = {"collaborative": {"rank": 12}, "shared-key": {"key_cache": 0.5}}
    for name in BOTH_FORMS:
        for form in ("collaborative", "shared-key"):
            for label, extra in (("weights", {}), ("calibrated", calibrated)):
                found.append({"job": "compress", "name": f"{name}-{form}-{label}", "model": str(models[name]),
                              "options": {"form": form, **sizes[form], **extra}})
            found.append({"job": "analyze", "name": f"analyze-{name}-{form}", "model": str(models[name]),
                          "options": {"form": form}})
    for label, extra in (("weights", {}), ("calibrated", calibrated)):
        found.append({"job": "compress", "name": f"bert-{label}", "model": str(models["bert"]),
                      "options": {"rank": 12, **extra}})
        for name in ROTARY:
            found.append({"job": "compress", "name": f"{name}-{label}", "model": str(models[name]),
                          "options": {"key_cache": 0.5, **extra}})
    found.append({"job": "compress", "name": "bert-auto", "model": str(models["bert"]),
                  "options": {"rank": "auto", "target_cosine": 0.95, **calibrated}})
    found.append({"job": "analyze", "name": "analyze-bert-calibrated", "model": str(models["bert"]),
                  "options": {"ranks": [8, 16], "calibration": str(texts), "calibration_samples": 24}})
    for name in ROTARY:
        found.append({"job": "analyze", "name": f"analyze-{name}", "model": str(models[name]), "options": {}})
    return found


def run(version: Path, case_file: Path, out: Path) -> None:
    out.mkdir(parents=True)
    environment = {**os.environ, "PYTHONPATH": str(version), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
                   "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    subprocess.run([sys.executable, "-c", RUNNER, str(case_file), str(out)], check=True, env=environment,
                   cwd=tempfile.gettempdir())


# what differs between any two runs: time, where the output went, and how many cores were idle when it started
UNCOMPARED = ("seconds", "stage_seconds", "output", "threads")


def without_seconds(value):
    if isinstance(value, dict):
        return {k: without_seconds(v) for k, v in value.items() if k not in UNCOMPARED}
    if isinstance(value, list):
        return [without_seconds(v) for v in value]
    return value


def json_differences(old, new, where: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            if key not in new:
                found.append(f"{where}.{key}: removed (was {json.dumps(old[key])[:60]})")
            elif key not in old:
                found.append(f"{where}.{key}: added ({json.dumps(new[key])[:60]})")
            else:
                found += json_differences(old[key], new[key], f"{where}.{key}")
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in json_differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {json.dumps(old)[:60]} -> {json.dumps(new)[:60]}"]


def timeless(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("- time:")]


def compare_file(old: Path, new: Path) -> list[str]:
    if old.suffix == ".json":
        if old.read_bytes() == new.read_bytes():
            return []
        differences = json_differences(without_seconds(json.loads(old.read_text())),
                                       without_seconds(json.loads(new.read_text())))
        return differences or ([] if old.name != "config.json" else ["bytes differ, the same JSON"])
    if old.suffix == ".md":
        return [] if timeless(old.read_text()) == timeless(new.read_text()) else ["text differs"]
    return [] if old.read_bytes() == new.read_bytes() else ["bytes differ"]


def compare(old_root: Path, new_root: Path) -> dict[str, list[str]]:
    report = {}
    for old in sorted(old_root.rglob("*")):
        if not old.is_file():
            continue
        relative = old.relative_to(old_root)
        new = new_root / relative
        report[str(relative)] = compare_file(old, new) if new.is_file() else ["missing in the new output"]
    for new in sorted(new_root.rglob("*")):
        if new.is_file() and not (old_root / new.relative_to(new_root)).is_file():
            report[str(new.relative_to(new_root))] = ["only in the new output"]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="source tree of the old version")
    parser.add_argument("--new", type=Path, default=ROOT, help="source tree of the new version (default: this one)")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for models and outputs (default: temporary); kept, its old outputs are reused")
    arguments = parser.parse_args()
    work = arguments.work or Path(tempfile.mkdtemp(prefix="collab-parity-"))
    case_file = work / "cases.json"
    if not case_file.is_file():  # a kept --work folder keeps its models and the old version's outputs
        models = build_models(work / "models")
        case_file.write_text(json.dumps(cases(models, ROOT / "fixtures" / "sentences.txt")))
    shutil.rmtree(work / "new", ignore_errors=True)
    for label, version in (("old", arguments.old), ("new", arguments.new)):
        if (work / label).exists():
            print(f"reusing the {label} outputs in {work / label}")
            continue
        print(f"running {len(json.loads(case_file.read_text()))} cases with the {label} code ({version})", flush=True)
        run(version.resolve(), case_file, work / label)
    report = compare(work / "old", work / "new")
    identical = [name for name, found in report.items() if not found]
    weights = [name for name in report if name.endswith(".safetensors")]
    print(f"\nweights: {sum(not report[name] for name in weights)} of {len(weights)} safetensors files byte-identical")
    print(f"{len(identical)} of {len(report)} files identical (weights and plots byte for byte; reports without "
          "seconds)")
    for name, found in report.items():
        for difference in found:
            print(f"  {name}: {difference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
