"""The command line: parses, calls the jobs (analysis.py, compression.py, integration/fidelity.py), prints.
Nothing else lives here; every option of a job comes from options.py.

Exit codes: 0 success; 1 a threshold failed; 2 usage error; 3 bad input (missing or unreadable model,
unsupported architecture, invalid rank, output exists); 130 interrupted.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional, get_args

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from .errors import BadInputError
from .options import AnalyzeOptions, CompressOptions, ExportOptions
from .progress import stage_of

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

# Piped output (CI logs, files) gets wide tables, unless COLUMNS says how wide; a terminal gets its own width.
stdout = Console(soft_wrap=True, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 180)
stderr = Console(stderr=True)


class _Quiet:
    quiet = False


def _version(value: bool) -> None:
    if value:
        from .version import __version__

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
        TimeRemainingColumn(),
        console=stderr,
        transient=True,
    )


def _run_with_progress(function, *args, show: bool = True, **kwargs):
    bar = _progress_bar(show and stderr.is_terminal)
    if bar is None:
        return function(*args, **kwargs)
    tasks = {}
    with bar:

        def progress(what: str, done: int, total: int) -> None:
            stage = stage_of(what)  # one bar per stage; its changing detail goes into the description
            if stage not in tasks:
                tasks[stage] = bar.add_task(what, total=total)
            bar.update(tasks[stage], completed=done, total=total, description=what)

        return function(*args, progress=progress, **kwargs)


MODEL_HELP = "A local model folder or a hub id in the local Hugging Face cache (default: the embedded all-MiniLM-L6-v2)."


def _cli_type(field):
    """The type the command line reads a field as: its `cli_type`, else its annotation (X | None -> Optional[X])."""
    declared = (field.json_schema_extra or {}).get("cli_type")
    if declared is not None:
        return Optional[declared] if field.default is None and not field.is_required() else declared
    args = [a for a in get_args(field.annotation) if a is not type(None)]
    if type(None) in get_args(field.annotation) and len(args) == 1:
        return Optional[args[0]]
    return field.annotation


def _flags(name: str, field) -> list[str]:
    return (field.json_schema_extra or {}).get("flags") or [f"--{name.replace('_', '-')}"]


def with_options(options_model, after: str):
    """Give a command one CLI option per field of `options_model` (names, defaults and help from the model),
    placed after its parameter `after`. The command receives them as keyword arguments."""

    def decorate(function):
        own = list(inspect.signature(function).parameters.values())
        own = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
        generated = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(... if field.is_required() else field.default, *_flags(name, field),
                                     help=field.description, show_default=not field.is_required()),
                annotation=_cli_type(field),
            )
            for name, field in sorted(options_model.model_fields.items(),
                                      key=lambda item: item[0] not in options_model.__annotations__)
        ]
        position = next(i for i, p in enumerate(own) if p.name == after) + 1
        parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        function.__signature__ = inspect.Signature(parameters[:position] + generated + parameters[position:])
        return function

    return decorate


def build_options(options_model, values: dict):
    """The options model from CLI values; a value it refuses is a usage error naming the flag."""
    from pydantic import ValidationError

    try:
        return options_model(**values)
    except ValidationError as error:
        first = error.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        field = options_model.model_fields.get(name)
        hint = _flags(name, field)[0] if field else None
        raise typer.BadParameter(first["msg"].removeprefix("Value error, "), param_hint=hint) from None


@app.command()
@with_options(AnalyzeOptions, after="model")
def analyze(
    model: str = typer.Argument(None, help=MODEL_HELP, show_default=False, metavar="MODEL"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    **options,
) -> None:
    """PCA redundancy of every attention layer: spectra, energy ranks, and what each candidate rank costs and
    gives (the error of a fit; with --calibration the logit error and the embedding cosine on held-out lines).

    Next: --target-cosine 0.99 names the smallest rank that keeps embeddings that close; then run
    `collab-convert compress MODEL --rank R -o OUT` (or --rank auto).
    """
    _Quiet.quiet = quiet
    chosen = build_options(AnalyzeOptions, options)
    from .analysis import analyze as run_analyze
    from .io.folders import DEFAULT_MODEL

    result = _run_with_progress(run_analyze, model or DEFAULT_MODEL, chosen.ranks, show=not as_json, options=chosen)
    if chosen.plot is not None:
        from .report.plots import plot_spectra

        layers = [(l.name, l.spectra["query_unfolding"], l.spectra["key_unfolding"]) for l in result.layers]
        try:
            plot_spectra(layers, chosen.plot)
        except OSError as error:
            raise BadInputError(f"cannot write the plot to {chosen.plot}: {error.strerror or error}") from None
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    _print_analysis(result)


def _table(title: str, *columns: str) -> Table:
    """A table that wraps rather than cuts: numbers are never shown as an ellipsis."""
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right", overflow="fold")
    return table


def _print_analysis(result) -> None:
    from .results import layer_labels

    labels = layer_labels([layer.name for layer in result.layers])
    if result.layers and result.layers[0].frequency_spectra is not None:
        stdout.print(_rotary_spread(result, labels))
        stdout.print(_candidate_table(result))
        stdout.print(_rotary_advice(result), highlight=False)
        return
    spread = _table(f"{result.model} ({result.family}): shared dimensions holding 90/95/99% of the energy",
                    "layer", "heads x d_k", "query side", "key side")
    for layer in result.layers:
        spread.add_row(labels[layer.name], f"{layer.num_heads} x {layer.head_dim}",
                       "/".join(str(v) for v in layer.energy_ranks["query_unfolding"].values()),
                       "/".join(str(v) for v in layer.energy_ranks["key_unfolding"].values()))
    stdout.print(spread)
    stdout.print(_candidate_table(result))
    stdout.print(_analysis_advice(result), highlight=False)


def _rotary_spread(result, labels) -> Table:
    rotary = any(layer.frequency_spectra for layer in result.layers)  # none: absolute positions, nothing rotates
    columns = ["layer", "heads x d (key heads)", "shared key"]
    columns += ["strongest frequencies (#0 fastest)"] if rotary else []
    table = _table(f"{result.model} ({result.family}, {'rotary' if rotary else 'absolute positions'}): shared key "
                   "numbers per token holding 90/95/99% of the score energy", *columns)
    for layer in result.layers:
        strength = [sum(row) for row in layer.frequency_spectra]
        top = sorted(range(len(strength)), key=lambda j: -strength[j])[:3]
        row = [labels[layer.name], f"{layer.num_heads} x {layer.head_dim} ({layer.kv_heads})",
               "/".join(str(v) for v in layer.energy_ranks["shared_key"].values())]
        table.add_row(*row, *([", ".join(f"#{j} {100 * strength[j]:.0f}%" for j in top)] if rotary else []))
    return table


def _rotary_advice(result) -> str:
    spread = "layers and RoPE frequencies" if any(layer.frequency_spectra for layer in result.layers) else "layers"
    return ("Rank = the shared key's numbers per token and layer, on average (the key cache); the budget is spread "
            f"over {spread} as compress spreads it. error: share of score energy lost (keys "
            "weighted by the queries that read them), mean over layers.\n"
            f"Next: collab-convert compress {result.model} --key-cache 0.5 --calibration FILE -o OUT")


def _candidate_table(result) -> Table:
    calibrated = any(p.mean_logit_error is not None for p in result.predictions)
    measured = any(p.cosine_mean is not None for p in result.predictions)
    columns = ["rank", "Q/K params", "key cache/token", "error"] + (["logit error"] if calibrated else [])
    columns += ["cosine mean/p1"] if measured else []
    table = _table(f"Candidate ranks, all {len(result.layers)} layers together", *columns)
    first = result.predictions[0] if result.predictions else None
    if first:
        row = ["original", f"{first.parameters_before:,}", f"{first.key_cache_before:,}", "0"]
        table.add_row(*row, *(["0"] if calibrated else []), *(["1/1"] if measured else []))
    for p in result.predictions:
        row = [str(p.rank), f"{p.parameters:,} ({100 * p.parameters / p.parameters_before:.0f}%)",
               f"{p.key_cache_per_token:,}", f"{p.mean_relative_error:.3f}"]
        row += [f"{p.mean_logit_error:.3f}"] if calibrated else []
        row += [f"{p.cosine_mean:.4f}/{p.cosine_p01:.4f}"] if measured else []
        table.add_row(*row)
    return table


def _analysis_advice(result) -> str:
    lines = ["error: relative error of the head products after the fit (mean over layers)"
             + ("; logit error: share of attention-logit energy lost on the calibration text" if any(
                 p.mean_logit_error is not None for p in result.predictions) else "") + "."]
    if result.probe:
        lines.append(f"cosine: embeddings of the compressed model against the original on {result.probe} "
                     "(before refinement, which only improves them).")
    if result.target:
        t = result.target
        lines.append(f"Smallest rank reaching cosine {t['target_cosine']}: {t['rank']} "
                     f"(measured {t['cosine_mean']:.4f} mean, {t['cosine_p01']:.4f} 1st percentile).")
        lines.append(f"Next: collab-convert compress {result.model} --rank {t['rank']} -o OUT")
    else:
        lines.append("Next: collab-convert analyze MODEL --target-cosine 0.99 names the rank that keeps embeddings "
                     "that close, or collab-convert compress MODEL --rank auto -o OUT picks it.")
    if "shared-key" in result.forms:
        lines.append(f"For the KV cache: collab-convert analyze {result.model} --form shared-key (each head keeps its "
                     "query and one key is shared: the most fidelity per cached key number).")
    return "\n".join(lines)


@app.command()
@with_options(CompressOptions, after="model")
def compress(
    model: str = typer.Argument(None, help=MODEL_HELP, show_default=False, metavar="MODEL"),
    max_error: Optional[float] = typer.Option(None, "--max-error", help="Exit 1 if any layer's relative error exceeds this."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the model, ranks and output location; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    **options,
) -> None:
    """Re-parametrize every attention layer into collaborative form and write a loadable checkpoint.

    Next: `import collab_convert` and load OUTPUT with transformers' Auto classes or collab_convert.load_model.
    """
    _Quiet.quiet = quiet
    chosen = build_options(CompressOptions, options)  # usage errors answer before anything heavy loads
    from .compression import compress as run_compress
    from .io.folders import DEFAULT_MODEL
    from .report.reports import result_json

    if dry_run:
        _print_plan(model or DEFAULT_MODEL, chosen, as_json)
        return
    result = _run_with_progress(run_compress, model or DEFAULT_MODEL, chosen, show=not as_json)
    if as_json:
        typer.echo(result_json(result, indent=None))
    else:
        _print_compression(result, chosen.rank)
    failed = [layer for layer in result.layers if max_error is not None and layer.relative_error > max_error]
    if failed:
        worst = max(failed, key=lambda layer: layer.relative_error)
        _error(
            f"{len(failed)} layer(s) exceed --max-error {max_error}: worst {worst.name} at "
            f"{worst.relative_error:.4f}"
        )
        raise typer.Exit(1)


def _print_plan(model: str, options: CompressOptions, as_json: bool) -> None:
    from .compression import plan

    checked = plan(model, options)
    if as_json:
        typer.echo(json.dumps(checked.to_dict()))
        return
    size = f"rank {options.rank}"
    if options.key_cache is not None:  # the shared-key form: the plan's rank is the shared key's average width
        width = checked.layers[0]["rank"]
        size = f"{options.key_cache:.0%} of the key cache ({width} numbers per token and layer on average)"
    stdout.print(
        f"OK: {checked.model} ({checked.family}), {len(checked.layers)} attention layers at {size} -> "
        f"{checked.output}. Q/K parameters {checked.parameters_before:,} -> {checked.parameters_after:,}.\n"
        "Next: run the same command without --dry-run."
    )


def _print_compression(result, rank) -> None:
    from .results import layer_labels

    labels = layer_labels([layer.name for layer in result.layers])
    kind = "auto ranks" if rank == "auto" else f"rank {rank}" if rank is not None else "shared key"
    table = _table(f"Collaborative attention ({kind}): {result.model}",
                   "layer", "rank", "relative error", "per-head truncation", "Q/K params before", "after")
    for layer in result.layers:
        table.add_row(
            labels[layer.name],
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


@app.command()
@with_options(ExportOptions, after="model")
def export(
    model: str = typer.Argument(..., help="The compressed checkpoint (a folder), or any model transformers loads.",
                                metavar="CHECKPOINT"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    **options,
) -> None:
    """Write CHECKPOINT as ONNX (batch and length dynamic; encoders: final hidden states, causal language models:
    logits without a cache), after checking that onnxruntime reproduces PyTorch on built-in sentences.

    Next: run OUTPUT/model.onnx with onnxruntime.InferenceSession; its inputs are the tokenizer's (saved beside it).
    """
    _Quiet.quiet = quiet
    chosen = build_options(ExportOptions, options)
    from .exporting import export as run_export

    result = _run_with_progress(run_export, model, chosen, show=not as_json)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        stdout.print(
            f"Wrote {result.output}/model.onnx ({result.kind}) in {result.seconds:.1f} s; onnxruntime matches "
            f"PyTorch to {result.max_abs_difference:.1e} on {result.checked_on}.", highlight=False)


def _device_name(value: str) -> str:
    from .options import misnamed_device

    if misnamed_device(value):
        raise typer.BadParameter(misnamed_device(value))
    return value


@app.command()
def verify(
    model: str = typer.Argument(..., help="The compressed checkpoint (a folder).", metavar="CHECKPOINT"),
    against: str = typer.Option(..., "--against", help="The base model it came from."),
    texts: Path = typer.Option(..., "--texts", help="Text file (one example per line) or folder of .txt files."),
    samples: int = typer.Option(1000, "--samples", help="Examples to read at most."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Exit 1 if the mean cosine of final hidden states is below this."),
    min_cosine_p01: Optional[float] = typer.Option(None, "--min-cosine-p01", help="Exit 1 if the 1st-percentile cosine is below this."),
    min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Language models: exit 1 if next-token top-1 agreement is below this."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Language models: exit 1 if the mean next-token KL exceeds this."),
    device: str = typer.Option("cpu", "--device", callback=_device_name, help="Run both models on cpu or cuda[:N]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Fidelity of a compressed checkpoint to its base on real text: cosine of final hidden states (mean and
    1st percentile) and, for language models, next-token top-1 agreement and KL.

    Next: put the thresholds that matter to you in your release pipeline (see docs/ci.md).
    """
    from .integration.fidelity import verify as run_verify
    from .io.texts import read_texts

    thresholds = {"min_cosine": min_cosine, "min_cosine_p01": min_cosine_p01, "min_top1": min_top1, "max_kl": max_kl}
    _Quiet.quiet = quiet
    result = _run_with_progress(run_verify, model, against, read_texts(texts, samples), thresholds, show=not as_json,
                                device=device)
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


def _is(error: BaseException, class_name: str) -> bool:
    """Match click's exception classes by name: typer may vendor its own copy of click."""
    return any(cls.__name__ == class_name for cls in type(error).__mro__)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: every failure becomes one line on stderr and an exit code, never a traceback."""
    from .errors import CollabError
    from .interrupts import forget_interrupt, request_interrupt

    forget_interrupt()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, request_interrupt)
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
    except OSError as error:
        import errno

        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            where = f" ({error.filename})" if error.filename else ""
            _error(f"could not write the output{where}: {error.strerror}; nothing was written")
            return 3
        raise
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
    """stderr is for our progress and our one-line errors: no loading bars or advice from transformers.

    Environment variables, read when transformers is first imported (which --help never does)."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def entry() -> None:
    sys.exit(main())
