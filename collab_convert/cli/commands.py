"""The four commands: each parses (flags from options.py), calls its job, and prints (render.py)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Optional

import typer

from ..cpu import ask_for_huge_pages
from ..errors import BadInputError
from ..options import AnalyzeOptions, CompressOptions, ExportOptions, VerifyOptions
from .app import app
from .flags import build_options, with_options
from .render import (
    Quiet,
    print_analysis,
    print_compression,
    print_error,
    print_warning,
    print_plan,
    print_verification,
    run_with_progress,
)

MODEL_HELP = "A local model folder or a hub id in the local Hugging Face cache (default: the embedded all-MiniLM-L6-v2)."
JSON_HELP = "Print one JSON object on stdout and nothing else."
QUIET_HELP = "No progress output."


def _check_plot_path(plot: Path) -> None:
    """Missing folders before the plot are made (as compress's -o); a folder in its place, or one that cannot be
    made, is a one-line error."""
    from ..io.folders import file_in_the_way

    if plot.is_dir():
        raise BadInputError(f"cannot write the plot to {plot}: it is a folder")
    blocking = file_in_the_way(plot)
    if blocking is not None:
        raise BadInputError(f"cannot write the plot to {plot}: {blocking} is a file, not a folder")
    try:
        plot.parent.mkdir(parents=True, exist_ok=True)
    except OSError as failure:
        raise BadInputError(f"cannot write the plot to {plot}: {failure.strerror or failure}") from None


@app.command()
@with_options(AnalyzeOptions, after="model")
def analyze(
    model: str = typer.Argument(None, help=MODEL_HELP, show_default=False, metavar="MODEL"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
    **options,
) -> None:
    """PCA redundancy of every attention layer: spectra, energy ranks, and what each candidate rank costs and
    gives (the error of a fit; with --calibration the logit error and the embedding cosine on held-out lines).

    Examples:

    collab-convert analyze                       (the embedded all-MiniLM-L6-v2)

    collab-convert analyze ./my-bert --calibration my-domain.txt --target-cosine 0.99

    collab-convert analyze HuggingFaceTB/SmolLM2-135M-Instruct --form multi-query --json

    Next: --target-cosine 0.99 names the smallest rank that keeps embeddings that close; then run
    `collab-convert compress MODEL --rank R -o OUT` (or --rank auto).
    """
    Quiet.quiet = quiet
    chosen = build_options(AnalyzeOptions, options)
    ask_for_huge_pages(chosen.form)  # before torch loads (cpu.py)
    from ..analysis import analyze as run_analyze
    from ..architectures.source import ask_for_huge_pages_for
    from ..io.folders import DEFAULT_MODEL

    if chosen.plot is not None:  # before the work: a plot that cannot be written must not cost the analysis
        _check_plot_path(chosen.plot)
    model = DEFAULT_MODEL if model is None else model  # "" is refused as empty, not taken for the default
    ask_for_huge_pages_for(model, chosen.form)  # a form left to the family: known now, before torch allocates
    result = run_with_progress(run_analyze, model, chosen, show=not as_json, stage_lines=True)
    if chosen.plot is not None:
        from ..forms import form_named
        from ..report.plots import plot_spectra

        try:
            plot_spectra(form_named(result.form).spectra(result.layers), chosen.plot)
        except OSError as failure:
            raise BadInputError(f"cannot write the plot to {chosen.plot}: {failure.strerror or failure}") from None
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    print_analysis(result)


@app.command()
@with_options(CompressOptions, after="model")
def compress(
    model: str = typer.Argument(None, help=MODEL_HELP, show_default=False, metavar="MODEL"),
    max_error: Optional[float] = typer.Option(None, "--max-error", rich_help_panel="Fidelity gates (exit 1 when one fails)", help="Exit 1 if any layer's weight error (the "
                                              "error column) exceeds this. A calibrated fit targets outputs, not "
                                              "weights: gate it on measured fidelity (--min-cosine, --min-top1, "
                                              "--max-kl)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the model, ranks and output location; write nothing."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
    **options,
) -> None:
    """Rewrite every attention layer in a form whose heads share (collaborative, shared key, or multi-query: keys and
    values) and write a loadable checkpoint.

    Examples:

    collab-convert compress ./my-bert --rank 192 --calibration my-domain.txt --min-cosine 0.99 -o out/bert-192

    collab-convert compress ./my-llama --kv-cache 0.5 --calibration docs.txt -o out/llama-kv50   (stock checkpoint)

    collab-convert compress ./my-llama --key-cache 0.75 -o out/llama-k75     (calibrates on built-in text)

    Next: `import collab_convert` and load OUTPUT with transformers' Auto classes or collab_convert.load_model
    (a --kv-cache output loads with transformers alone).
    """
    Quiet.quiet = quiet
    chosen = build_options(CompressOptions, options)  # usage errors answer before anything heavy loads
    ask_for_huge_pages(chosen.requested_form)  # before torch loads (cpu.py)
    from ..architectures.source import ask_for_huge_pages_for
    from ..compression import compress as run_compress
    from ..compression import plan
    from ..io.folders import DEFAULT_MODEL
    from ..report.reports import result_json

    model = DEFAULT_MODEL if model is None else model  # "" is refused as empty, not taken for the default
    if dry_run:
        checked = plan(model, chosen)
        if as_json:
            typer.echo(json.dumps(checked.to_dict()))
        else:
            print_plan(checked)
        return
    ask_for_huge_pages_for(model, chosen.requested_form)  # a form left to the family: known now
    result = run_with_progress(run_compress, model, chosen, show=not as_json, stage_lines=True)
    for warning in result.warnings or []:
        print_warning(warning)
    if as_json:
        typer.echo(result_json(result, indent=None))
    else:
        print_compression(result, chosen.rank)
    failures = list(result.failures or [])
    failed = [layer for layer in result.layers if max_error is not None and layer.relative_error > max_error]
    if failed:
        worst = max(failed, key=lambda layer: layer.relative_error)
        failures.append(f"{len(failed)} layer(s) exceed --max-error {max_error}: worst {worst.name} at "
                        f"{worst.relative_error:.4f}")
    if failures:
        print_error("; ".join(failures))
        raise typer.Exit(1)


@app.command()
@with_options(ExportOptions, after="model")
def export(
    model: str = typer.Argument(..., help="The compressed checkpoint (a folder), or any model transformers loads.",
                                metavar="CHECKPOINT"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
    **options,
) -> None:
    """Write CHECKPOINT as ONNX (batch and length dynamic; encoders: final hidden states, causal language models:
    logits without a cache), after checking that onnxruntime reproduces PyTorch on built-in sentences; or, with
    --format gguf, a stock llama-family checkpoint (compress --kv-cache writes one) as a GGUF file for llama.cpp,
    after checking that llama.cpp's graph over the file reproduces PyTorch.

    Examples:

    collab-convert export out/bert-192 --format onnx -o out/bert-192-onnx

    collab-convert export out/llama-kv50 --format gguf -o out/llama-kv50.gguf --dtype f16

    Next: run OUTPUT/model.onnx with onnxruntime.InferenceSession (its inputs are the tokenizer's, saved beside it),
    or the .gguf file with llama.cpp (llama-cli -m FILE.gguf, or llama_cpp.Llama(model_path=FILE.gguf)).
    """
    Quiet.quiet = quiet
    chosen = build_options(ExportOptions, options)
    from ..exporting import export as run_export
    from .render import print_export

    result = run_with_progress(run_export, model, chosen, show=not as_json, stage_lines=True)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        print_export(result)


@app.command()
@with_options(VerifyOptions, after="model")
def verify(
    model: str = typer.Argument(..., help="The compressed checkpoint (a folder).", metavar="CHECKPOINT"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
    **options,
) -> None:
    """Fidelity of a compressed checkpoint to its base on real text: cosine of final hidden states (mean and
    1st percentile) and, for language models, next-token top-1 agreement and KL.

    Examples:

    collab-convert verify out/bert-192 --texts holdout.txt --min-cosine 0.99     (against the base it records)

    collab-convert verify out/llama-kv50 --against ./my-llama --texts holdout.txt --min-top1 0.8 --json

    Next: put the thresholds that matter to you in your release pipeline (see docs/ci.md).
    """
    Quiet.quiet = quiet
    chosen = build_options(VerifyOptions, options)
    from ..integration.fidelity import verify as run_verify
    from ..io.texts import read_texts

    result = run_with_progress(run_verify, model, chosen.against, read_texts(chosen.texts, chosen.samples),
                               chosen.thresholds, show=not as_json, stage_lines=True,
                               device=chosen.device)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        print_verification(result)
    if result.failures:
        print_error("; ".join(result.failures))
        raise typer.Exit(1)


def _reflowed(doc: str) -> str:
    """A docstring as help: each paragraph one line (rich help keeps a docstring's line breaks), blank lines kept."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines()) for paragraph in paragraphs)


for _command in app.registered_commands:
    _command.help = _reflowed(_command.callback.__doc__ or "")
