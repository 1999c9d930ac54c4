"""analyze against compress, as a user runs them: `collab-convert analyze` (its default candidate ranks) and
`collab-convert compress --rank 192`, on the embedded MiniLM, each in a fresh process.

    python benchmarks/analyze_vs_compress.py [--rounds 10] [--loaded]

The two commands alternate in ABBA order, so that a drift of the machine (a neighbour starting, the file cache)
falls on both alike. Printed: each command's median and fastest wall time, and the ratio analyze / compress of
the medians and of each round's pair. Target (issue #32): analyze no slower than compress, a ratio <= 1.0.
--loaded runs it all beside a busy neighbour (one core of matrix products).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from neighbour import busy_neighbour  # noqa: E402


def command(arguments: list[str]) -> list[str]:
    executable = shutil.which("collab-convert")
    return [executable, *arguments] if executable else [sys.executable, "-m", "collab_convert", *arguments]


def wall(arguments: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command(arguments), capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--loaded", action="store_true", help="beside a busy neighbour")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, busy_neighbour(args.loaded):
        runs = {"analyze": ["analyze"],
                "compress --rank 192": ["compress", "--rank", "192", "-o", f"{scratch}/out", "--overwrite"]}
        wall(runs["compress --rank 192"])  # warm the file cache and write the output folder once
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for name in order:
                times[name].append(wall(runs[name]))
    print(f"MiniLM, {args.rounds} rounds in ABBA order, {'beside a busy neighbour' if args.loaded else 'quiet'}")
    for name, values in times.items():
        print(f"  collab-convert {name:22s} median {statistics.median(values):6.2f} s   fastest {min(values):6.2f} s")
    analyze, compress = times["analyze"], times["compress --rank 192"]
    pairs = [a / c for a, c in zip(analyze, compress)]
    print(f"  analyze / compress: {statistics.median(analyze) / statistics.median(compress):.3f} of the medians, "
          f"{statistics.median(pairs):.3f} median of the {len(pairs)} pairs (target <= 1.0)")


if __name__ == "__main__":
    main()
