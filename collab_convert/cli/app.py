"""The Typer application every command registers with (commands.py), and its --version."""

from __future__ import annotations

import typer

EXIT_CODES = """Exit codes: 0 success, 1 a threshold failed, 2 usage error, 3 bad input, 130 interrupted."""

app = typer.Typer(
    name="collab-convert",
    help="Measure how redundant a transformer's attention heads are, and make them collaborate.\n\n"
    "Start with `collab-convert analyze MODEL`, then `collab-convert compress MODEL --rank R -o OUT`. "
    + EXIT_CODES,
    add_completion=True,  # --install-completion / --show-completion for the user's shell
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        from ..version import __version__

        typer.echo(f"collab-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass
