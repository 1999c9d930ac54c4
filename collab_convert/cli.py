"""The command line: parses, calls the pure functions in pipeline.py, prints. Nothing else lives here.

Exit codes: 0 success; 1 a threshold failed; 2 usage error; 3 bad input (missing or unreadable model,
unsupported architecture, invalid rank, output exists); 130 interrupted.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from .errors import BadInputError

EXIT_CODES = """Exit codes: 0 success, 1 a threshold failed, 2 usage error, 3 bad input, 130 interrupted."""

app = typer.Typer(
    name="collab-convert",
    help="Measure how redundant a transformer's attention heads are, and make them collaborate.\n\n"
    "Start with `collab-convert analyze MODEL`, then `collab-convert compress MODEL --rank R -o OUT`. "
    + EXIT_CODES,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Piped output (CI logs, files) gets wide tables rather than names folded at 80 columns.
stdout = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 180)
stderr = Console(stderr=True)


class _Quiet:
    quiet = False


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"collab-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


def _progress_bar(enabled: bool):
    if not enabled or _Quiet.quiet:
        return None
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
    )


def _run_with_progress(function, *args, show: bool = True):
    bar = _progress_bar(show and stderr.is_terminal)
    if bar is None:
        return function(*args)
    tasks = {}
    with bar:

        def progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done)

        return function(*args, progress=progress)


MODEL_HELP = "A local model folder or a hub id in the local Hugging Face cache (default: the embedded all-MiniLM-L6-v2)."


@app.command()
def analyze(
    model: str = typer.Argument(None, help=MODEL_HELP, show_default=False),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Comma-separated candidate ranks to cost, e.g. 64,128,192."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the spectra into this PNG file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """PCA redundancy of every attention layer: spectra, energy ranks, and costs at candidate ranks.

    Next: pick a rank from the 95% or 99% column and run `collab-convert compress MODEL --rank R -o OUT`.
    """
    from .checkpoint import DEFAULT_MODEL
    from .pipeline import analyze as run_analyze

    _Quiet.quiet = quiet
    candidate = _parse_ranks(ranks)
    result = _run_with_progress(run_analyze, model or DEFAULT_MODEL, candidate, show=not as_json)
    if plot is not None:
        from .report import plot_spectra

        layers = [(l.name, l.spectra["query_unfolding"], l.spectra["key_unfolding"]) for l in result.layers]
        try:
            plot_spectra(layers, plot)
        except OSError as error:
            raise BadInputError(f"cannot write the plot to {plot}: {error.strerror or error}") from None
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    table = Table(title=f"Attention redundancy: {result.model} ({result.family})")
    table.add_column("layer", no_wrap=True)
    table.add_column("heads x d_k", justify="right")
    table.add_column("query dims 90/95/99%", justify="right")
    table.add_column("key dims 90/95/99%", justify="right")
    table.add_column("Q/K params", justify="right")
    first = result.layers[0]
    for candidate_cost in first.candidates:
        table.add_column(f"R={candidate_cost['rank']}", justify="right")
    for layer in result.layers:
        q = layer.energy_ranks["query_unfolding"]
        k = layer.energy_ranks["key_unfolding"]
        table.add_row(
            layer.name,
            f"{layer.num_heads} x {layer.head_dim}",
            "/".join(str(v) for v in q.values()),
            "/".join(str(v) for v in k.values()),
            f"{layer.original['parameters']:,}",
            *[f"{c['parameters']:,}" for c in layer.candidates],
        )
    stdout.print(table)
    stdout.print(
        "Dimensions: shared query/key dimensions holding 90/95/99% of the energy of the stacked head products. "
        "R=...: Q/K parameters of the collaborative form at that rank.\n"
        "Next: collab-convert compress MODEL --rank R -o OUT"
    )


def _parse_ranks(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"'{text}' is not a comma-separated list of integers", param_hint="--ranks")
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter("ranks must be positive integers", param_hint="--ranks")
    return values


@app.command()
def compress(
    model: str = typer.Argument(None, help=MODEL_HELP, show_default=False),
    rank: str = typer.Option(..., "--rank", "-r", help="Shared query/key dimension R for every layer, or 'auto' (see --energy)."),
    energy: float = typer.Option(0.95, "--energy", help="With --rank auto: share of (logit, with --calibration) energy each layer keeps."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Text file (one example per line) or folder of .txt files: fit the logits on real inputs and refine against the original attention."),
    calibration_samples: int = typer.Option(512, "--calibration-samples", help="Examples to read from --calibration at most."),
    refine_steps: int = typer.Option(100, "--refine-steps", help="With --calibration: Adam steps per layer against the original attention (0: off)."),
    output: Path = typer.Option(..., "--output", "-o", help="Folder to write the collaborative checkpoint to."),
    seed: int = typer.Option(0, "--seed", help="Seed for anything random (the default fit has no random step)."),
    max_iterations: int = typer.Option(500, "--max-iterations", help="ALS iterations per layer at most."),
    tolerance: float = typer.Option(1e-3, "--tolerance", help="Stop when an iteration improves the error by less than this share."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard, e.g. 500MB."),
    device: str = typer.Option("cpu", "--device", help="Run the decomposition on cpu or cuda[:N]."),
    method: str = typer.Option("tucker-cp-als", "--method", help="tucker-cp-als (ours) or reference-parafac (the paper's)."),
    max_error: Optional[float] = typer.Option(None, "--max-error", help="Exit 1 if any layer's relative error exceeds this."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists and is not empty."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the model, ranks and output location; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Re-parametrize every attention layer into collaborative form and write a loadable checkpoint.

    Next: `import collab_convert` and load OUTPUT with transformers' Auto classes or collab_convert.load_model.
    """
    from pydantic import ValidationError

    from .checkpoint import DEFAULT_MODEL
    from .pipeline import CompressOptions
    from .pipeline import compress as run_compress
    from .report import result_json

    _Quiet.quiet = quiet
    if rank != "auto":
        try:
            rank = int(rank)
        except ValueError:
            raise typer.BadParameter(f"'{rank}' is neither an integer nor 'auto'", param_hint="--rank") from None
    try:
        options = CompressOptions(
            rank=rank,
            energy=energy,
            calibration=calibration,
            calibration_samples=calibration_samples,
            refine_steps=refine_steps,
            output=output,
            seed=seed,
            max_iterations=max_iterations,
            tolerance=tolerance,
            max_shard_size=max_shard_size,
            method=method,
            device=device,
            overwrite=overwrite,
        )
    except ValidationError as error:
        first = error.errors()[0]
        raise typer.BadParameter(first["msg"].removeprefix("Value error, "), param_hint=f"--{first['loc'][0]}")
    if dry_run:
        from .pipeline import plan

        checked = plan(model or DEFAULT_MODEL, options)
        if as_json:
            typer.echo(json.dumps(checked.to_dict()))
        else:
            stdout.print(
                f"OK: {checked.model} ({checked.family}), {len(checked.layers)} attention layers at rank {rank} -> "
                f"{checked.output}. Q/K parameters {checked.parameters_before:,} -> {checked.parameters_after:,}.\n"
                "Next: run the same command without --dry-run."
            )
        return
    result = _run_with_progress(run_compress, model or DEFAULT_MODEL, options, show=not as_json)
    failed = [layer for layer in result.layers if max_error is not None and layer.relative_error > max_error]
    if as_json:
        typer.echo(result_json(result, indent=None))
    else:
        table = Table(title=f"Collaborative attention ({'auto ranks' if rank == 'auto' else f'rank {rank}'}): {result.model}")
        for column in ("layer", "rank", "relative error", "per-head truncation", "Q/K params before", "after"):
            table.add_column(column, justify="left" if column == "layer" else "right")
        for layer in result.layers:
            table.add_row(
                layer.name,
                str(layer.rank),
                f"{layer.relative_error:.4f}",
                "-" if layer.per_head_truncation_error != layer.per_head_truncation_error else f"{layer.per_head_truncation_error:.4f}",
                f"{layer.parameters_before:,}",
                f"{layer.parameters_after:,}",
            )
        stdout.print(table)
        stdout.print(
            f"Wrote {result.output} in {result.seconds:.1f} s. Q/K parameters {result.parameters_before:,} -> "
            f"{result.parameters_after:,}; mean relative error {result.mean_relative_error:.4f}.\n"
            f"Next: python -c \"import collab_convert; m = collab_convert.load_model('{result.output}')\""
        )
    if failed:
        worst = max(failed, key=lambda layer: layer.relative_error)
        _error(
            f"{len(failed)} layer(s) exceed --max-error {max_error}: worst {worst.name} at "
            f"{worst.relative_error:.4f}"
        )
        raise typer.Exit(1)


@app.command()
def verify(
    model: str = typer.Argument(..., help="The compressed checkpoint (a folder)."),
    against: str = typer.Option(..., "--against", help="The base model it came from."),
    texts: Path = typer.Option(..., "--texts", help="Text file (one example per line) or folder of .txt files."),
    samples: int = typer.Option(1000, "--samples", help="Examples to read at most."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Exit 1 if the mean cosine of final hidden states is below this."),
    min_cosine_p01: Optional[float] = typer.Option(None, "--min-cosine-p01", help="Exit 1 if the 1st-percentile cosine is below this."),
    min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Language models: exit 1 if next-token top-1 agreement is below this."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Language models: exit 1 if the mean next-token KL exceeds this."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
) -> None:
    """Fidelity of a compressed checkpoint to its base on real text: cosine of final hidden states (mean and
    1st percentile) and, for language models, next-token top-1 agreement and KL.

    Next: put the thresholds that matter to you in your release pipeline (see docs/ci.md).
    """
    from .calibration import read_texts
    from .fidelity import verify as run_verify

    thresholds = {"min_cosine": min_cosine, "min_cosine_p01": min_cosine_p01, "min_top1": min_top1, "max_kl": max_kl}
    result = run_verify(model, against, read_texts(texts, samples), thresholds)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        line = (
            f"{result.texts} texts: cosine mean {result.cosine_mean:.4f}, 1st percentile {result.cosine_p01:.4f}, "
            f"min {result.cosine_min:.4f}"
        )
        if result.top1_agreement is not None:
            line += f"; next-token top-1 agreement {result.top1_agreement:.4f}, KL {result.kl_mean:.4f}"
        stdout.print(line, highlight=False)
    if result.failures:
        _error("; ".join(result.failures))
        raise typer.Exit(1)


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _is(error: BaseException, class_name: str) -> bool:
    """Match click's exception classes by name: typer may vendor its own copy of click."""
    return any(cls.__name__ == class_name for cls in type(error).__mro__)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: every failure becomes one line on stderr and an exit code, never a traceback."""
    from .errors import CollabError

    signal.signal(signal.SIGTERM, _interrupted)
    _quiet_libraries()
    try:
        # Without standalone mode click returns a typer.Exit's code instead of exiting.
        code = app(args=argv, prog_name="collab-convert", standalone_mode=False)
        code = code if isinstance(code, int) else 0
        if code == 130:  # typer turns Ctrl-C (and our SIGTERM) into a silent Exit(130)
            _error("interrupted; nothing was written")
        return code
    except KeyboardInterrupt:
        _error("interrupted; nothing was written")
        return 130
    except CollabError as error:
        _error(str(error))
        return error.exit_code
    except MemoryError:
        _error("ran out of memory")
        return 3
    except Exception as error:  # click's own exceptions, whichever copy of click raised them
        if _is(error, "NoArgsIsHelpError"):
            print(error.format_message() if hasattr(error, "format_message") else "", file=sys.stderr)
            return 2
        if _is(error, "UsageError"):
            context = getattr(error, "ctx", None)
            command = getattr(getattr(context, "command", None), "name", None)
            hint = f" (see collab-convert {command} --help)" if command and command != "collab-convert" else ""
            _error(error.format_message().replace("\n", " ") + hint)
            return 2
        if _is(error, "Exit"):
            return getattr(error, "exit_code", 0)
        if _is(error, "Abort"):
            _error("interrupted; nothing was written")
            return 130
        raise


def _quiet_libraries() -> None:
    """stderr is for our progress and our one-line errors: no loading bars or advice from transformers."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def entry() -> None:
    sys.exit(main())
