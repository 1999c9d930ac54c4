"""What the terminal shows: the progress bars on stderr, and results as tables and lines on stdout. Each result
carries its form, and the form (forms/) gives its own tables and words; this module only lays them out."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table as RichTable
from rich.text import Text

from ..progress import stage_of

# Piped output (CI logs, files) gets wide tables, unless COLUMNS says how wide; a terminal gets its own width.
# On a terminal rich wraps prose between words (the terminal itself would break it mid-word and mid-number);
# piped, a line stays whole for whatever reads it.
stdout = Console(soft_wrap=not sys.stdout.isatty(),
                 width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 180)
stderr = Console(stderr=True)


class Quiet:
    """--quiet: no progress output for the command running now."""

    quiet = False


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def print_warning(message: str) -> None:
    """One line on stderr, even with --json or --quiet: stdout stays one JSON object, and the warning is also in it."""
    print(f"warning: {message}", file=sys.stderr)


def _progress_bar(enabled: bool):
    if not enabled or Quiet.quiet:
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


def run_with_progress(function, *args, show: bool = True, stage_lines: bool = False, **kwargs):
    """A bar per stage on a terminal; elsewhere, with `stage_lines`, one line on stderr as each stage starts (a
    long job piped to a file or a CI log is not silent)."""
    bar = _progress_bar(show and stderr.is_terminal)
    if bar is None and show and stage_lines and not Quiet.quiet:
        return _with_stage_lines(function, *args, **kwargs)
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


# Seconds a stage runs before its line appears: a bad input fails faster, in one line. The environment may set it
# (a CI log that wants no stage lines, or every one at once with 0).
STAGE_LINE_AFTER = float(os.environ.get("COLLAB_CONVERT_STAGE_LINE_AFTER", "2.0"))


def _with_stage_lines(function, *args, **kwargs):
    """Run `function`, writing a line on stderr for each stage that runs longer than STAGE_LINE_AFTER seconds."""
    import threading

    pending: dict[str, threading.Timer] = {}
    started: set[str] = set()

    def announce(what: str, done: int, total: int) -> None:
        stage = stage_of(what)
        if stage in started:
            return
        started.add(stage)
        for timer in pending.values():
            timer.cancel()
        pending.clear()
        if STAGE_LINE_AFTER <= 0:
            print(f"{stage} ...", file=sys.stderr, flush=True)
            return
        pending[stage] = threading.Timer(STAGE_LINE_AFTER, print, (f"{stage} ...",), {"file": sys.stderr,
                                                                                     "flush": True})
        pending[stage].daemon = True
        pending[stage].start()

    try:
        return function(*args, progress=announce, **kwargs)
    finally:
        for timer in pending.values():
            timer.cancel()


def table(title: str, columns: list[str], rows: list[list[str]] = ()) -> RichTable:
    """A table that wraps rather than cuts: numbers are never shown as an ellipsis."""
    shown = RichTable()
    shown.heading = title  # printed as prose by show(): rich folds a table's own title mid-word ("90/95/9 / 9%")
    for index, column in enumerate(columns):
        shown.add_column(column, justify="left" if index == 0 else "right", overflow="fold")
    for row in rows:
        shown.add_row(*row)
    return shown


def show(shown: RichTable) -> None:
    """A table under its title, the title wrapped between words like any line of text."""
    stdout.print(Text(shown.heading), shown)


def print_analysis(result) -> None:
    from ..forms import form_named

    form = form_named(result.form)
    for view in form.analysis_tables(result):
        show(table(view.title, view.columns, view.rows))
    stdout.print(form.analysis_advice(result), highlight=False)


def print_plan(checked) -> None:
    from ..forms import form_named

    stdout.print(
        f"OK: {checked.model} ({checked.family}, {checked.form} form), {len(checked.layers)} attention layers at "
        f"{checked.size} -> {checked.output}. {form_named(checked.form).terms.parameters_line} "
        f"{checked.parameters_before:,} -> "
        f"{checked.parameters_after:,}.\nNext: run the same command without --dry-run."
    )


def _sentence(line: str) -> str:
    """A report.md bullet ("- fidelity, measured on ...: ...") as a sentence of the terminal summary."""
    line = line.removeprefix("- ")
    return line[:1].upper() + line[1:] + ("" if line.endswith(".") else ".")


def print_compression(result, rank) -> None:
    from ..forms import form_named
    from ..report.summary import disk_line, fidelity_lines
    from ..results import layer_labels

    labels = layer_labels([layer.name for layer in result.layers])
    kind = "auto ranks" if rank == "auto" else f"rank {rank}" if rank is not None else "shared key"
    form = form_named(result.form)
    columns, cells = form.layer_columns(result)
    shown = table(f"Collaborative attention ({kind}): {result.model}",
                  ["layer", *columns, f"{form.terms.parameters_short} before", "after"])
    for layer, own in zip(result.layers, cells, strict=True):
        shown.add_row(labels[layer.name], *own, f"{layer.parameters_before:,}", f"{layer.parameters_after:,}")
    show(shown)
    lines = [f"Wrote {result.output} in {result.seconds:.1f} s. {form.terms.parameters_line} "
             f"{result.parameters_before:,} -> {result.parameters_after:,}"
             + (f"; {disk_line(result.disk)[2:]}." if result.disk else "."), form.rank_sentence(result),
             _sentence(form.error_line(result)), _sentence(fidelity_lines(result)[0])]
    stdout.print("\n".join(lines + [f"Next: {form.next_step(result)}"]), highlight=False)



def print_verification(result) -> None:
    line = (f"{result.texts} texts: cosine mean {result.cosine_mean:.4f}, 1st percentile {result.cosine_p01:.4f}, "
            f"min {result.cosine_min:.4f}")
    if result.top1_agreement is not None:
        line += f"; next-token top-1 agreement {result.top1_agreement:.4f}, KL {result.kl_mean:.4f}"
    from ..report.summary import worst_lines

    stdout.print("\n".join([line, *worst_lines(result.worst_texts, "texts")]), highlight=False)


def print_export(result) -> None:
    if result.format == "gguf":
        stdout.print(
            f"Wrote {result.output} ({result.kind}) in {result.seconds:.1f} s; llama.cpp's graph over the file matches "
            f"PyTorch to {result.max_abs_difference:.1e} of the largest logit (next token agrees on "
            f"{result.details['next_token_agreement']:.2%}) on {result.checked_on}; tokenizer "
            f"{result.details['tokenizer']}.\nNext: llama-cli -m {result.output}, or "
            f"llama_cpp.Llama(model_path='{result.output}')", highlight=False)
        return
    stdout.print(
        f"Wrote {result.output}/model.onnx ({result.kind}) in {result.seconds:.1f} s; onnxruntime matches "
        f"PyTorch to {result.max_abs_difference:.1e} on {result.checked_on}.", highlight=False)
