"""Our `compress` against the paper's re-parametrization on the same layers, timed side by side.

The paper (Cordonnier et al.) runs TensorLy `parafac(T, R, init="random", tol=1e-6)` on each layer's dense
N_h x D_in x D_in tensor, in float32 as their code does. Both runs below go through the same
`collab_convert.compress` call, so reading,
writing and reports cost the same on both sides; imports are warmed up first and not timed.

    python benchmarks/speed_vs_paper.py --rank 192
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import collab_convert  # noqa: E402
from collab_convert.io.folders import DEFAULT_MODEL  # noqa: E402


def timed_compress(model: str, output: Path, **options):
    started = time.perf_counter()
    result = collab_convert.compress(model, collab_convert.CompressOptions(output=output, **options))
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rank", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours; the median is reported")
    parser.add_argument("--no-plots", action="store_true", help="both sides skip the plots (compress --no-plots)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # Warm-up: imports (torch kernels, safetensors) are not what we measure.
        timed_compress(args.model, scratch / "warm", rank=args.rank, max_iterations=1)

        ours = sorted(
            (timed_compress(args.model, scratch / f"ours{i}", rank=args.rank, plots=not args.no_plots)
             for i in range(args.repeats)),
            key=lambda run: run[0],
        )
        ours_seconds, ours_result = ours[len(ours) // 2]
        paper_seconds, paper_result = timed_compress(
            args.model, scratch / "paper", rank=args.rank, method="reference-parafac", plots=not args.no_plots
        )

    layers = len(ours_result.layers)
    print(f"{args.model}, rank {args.rank}, {layers} attention layers, whole compress() call each")
    print(f"{'method':<20} {'seconds':>9} {'per layer':>10} {'mean rel err':>13} {'iterations':>22}")
    print(
        f"{'tucker-cp-als':<20} {ours_seconds:>9.2f} {ours_seconds / layers:>10.3f} "
        f"{ours_result.mean_relative_error:>13.4f} {str([l.iterations for l in ours_result.layers]):>22}"
    )
    print(
        f"{'reference-parafac':<20} {paper_seconds:>9.2f} {paper_seconds / layers:>10.3f} "
        f"{paper_result.mean_relative_error:>13.4f} {str([l.iterations for l in paper_result.layers]):>22}"
    )
    ratio = paper_seconds / ours_seconds
    better = ours_result.mean_relative_error <= paper_result.mean_relative_error
    print(f"\nspeed-up {ratio:.1f}x (target 100x against the float32 reference); error ours/paper "
          f"{ours_result.mean_relative_error / paper_result.mean_relative_error:.3f} "
          f"({'equal or lower' if better else 'HIGHER'})")


if __name__ == "__main__":
    main()
