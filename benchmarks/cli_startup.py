"""How fast the CLI answers without doing work: --help, --version and a usage error, as a user runs them; and
how fast `compress` on the embedded encoder refuses a forgotten --rank.

    python benchmarks/cli_startup.py

Each command runs 5 times in a fresh process (the installed `collab-convert` script); the median wall time is
printed. Target: under 1 s each. torch and transformers are imported only by commands that need them. The
forgotten --rank needs the model's config read and its family found (which imports torch, not transformers):
no target, its time is printed for the record.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = [
    ["--help"],
    ["compress", "--help"],
    ["analyze", "--help"],
    ["--version"],
    ["compress", "--rank", "nope", "-o", "/tmp/x"],  # a usage error
]


def forgotten_rank() -> list[str]:
    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    return ["compress", str(resolve_model(DEFAULT_MODEL)), "-o", "/tmp/cli-startup-never-written"]


def wall(arguments: list[str]) -> float:
    executable = shutil.which("collab-convert")
    command = [executable, *arguments] if executable else [sys.executable, "-m", "collab_convert", *arguments]
    started = time.perf_counter()
    subprocess.run(command, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> None:
    wall(["--version"])  # warm the file cache once
    print(f"{'command':45s} median s  (5 runs)  target < 1 s")
    for arguments in COMMANDS:
        median = statistics.median(wall(arguments) for _ in range(5))
        shown = "collab-convert " + " ".join(arguments)
        print(f"{shown:45s} {median:8.3f}  {'ok' if median < 1 else 'SLOW'}")
    median = statistics.median(wall(forgotten_rank()) for _ in range(5))
    print(f"{'collab-convert compress MINILM -o OUT (no --rank)':45s} {median:8.3f}  (refused from config.json)")


if __name__ == "__main__":
    main()
