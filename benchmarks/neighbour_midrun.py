"""A neighbour that starts or stops during a calibrated compress: the threads following the idle cores (threads.py)
against the count fixed when the run started, side by side in one run.

    python benchmarks/neighbour_midrun.py [--model FOLDER] [--budget "--rank 192"] [--documents 300] [--delay 14]

Each scenario runs `collab-convert compress MODEL BUDGET --calibration news.txt` twice, as a user runs it: with the
default threads (counted when the run starts, then followed through it) and with `--threads N` fixed at the count
the run starts with, which is what every run did before the threads followed the machine. Scenarios:
  - quiet: nothing beside it;
  - starts: a neighbour (one thread of float32 matrix products, benchmarks/neighbour.py) starts --delay seconds
    after the command, once the run has counted 2 idle cores, and runs until the command ends;
  - stops: the neighbour runs from before the command until --delay seconds after it, so the run starts on 1.
Calibration text: Brown's news documents (benchmarks/calibration_documents.py). Prints the seconds past imports
(report.json) and the fixed run's time over the followed run's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_documents import document_runs  # noqa: E402
from neighbour import PROGRAM  # noqa: E402


class Neighbour:
    """The busy job, started and stopped on a timer of its own."""

    def __init__(self):
        self.process = None

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", PROGRAM])

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def run(command: list[str], out: Path, scenario: str, delay: float) -> dict:
    neighbour = Neighbour()
    if scenario == "stops":
        neighbour.start()
        time.sleep(1.0)  # it is busy when the run counts the idle cores
    timer = threading.Timer(delay, neighbour.start if scenario == "starts" else neighbour.stop)
    if scenario != "quiet":
        timer.start()
    try:
        subprocess.run([*command, "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    finally:
        timer.cancel()
        neighbour.stop()
    return json.loads((out / "report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded all-MiniLM-L6-v2")
    parser.add_argument("--budget", default="--rank 192")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--delay", type=float, default=14.0, help="seconds after the command the neighbour starts "
                        "or stops: past the imports and the opening, where the run counts the idle cores")
    parser.add_argument("--scenarios", default="quiet,starts,stops")
    args = parser.parse_args()
    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    model = str(resolve_model(args.model or DEFAULT_MODEL))
    news = [d[0] for d in document_runs(200) if d[1] == "news"][: args.documents]
    print(f"{model}, {args.budget}, {len(news)} news documents; neighbour: one thread of float32 products", flush=True)
    print(f"{'scenario':<8} {'threads':<22} {'past imports':>12} {'counts used':>12}  stages", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "news.txt"
        text.write_text("\n".join(news) + "\n")
        base = ["collab-convert", "compress", model, *args.budget.split(), "--calibration", str(text),
                "--calibration-samples", str(len(news)), "-q", "--json", "--overwrite"]
        for scenario in args.scenarios.split(","):
            start_count = 1 if scenario == "stops" else 2
            seconds = {}
            for label, extra in (("followed (default)", []), (f"fixed at {start_count}", ["--threads",
                                                                                         str(start_count)])):
                report = run(base + extra, Path(scratch) / "out", scenario, args.delay)
                seconds[label] = report["seconds"]
                stages = ", ".join(f"{k} {v:.1f}" for k, v in report["stage_seconds"].items())
                print(f"{scenario:<8} {label:<22} {report['seconds']:11.1f}s "
                      f"{str(report['threads'].get('counts_used', '-')):>12}  {stages}", flush=True)
            followed, fixed = seconds.values()
            print(f"{scenario:<8} fixed / followed: {fixed / followed:.2f}x", flush=True)


if __name__ == "__main__":
    main()
