"""The command line: parses, calls the jobs (analysis.py, compression.py, exporting.py, integration/fidelity.py),
prints. app.py holds the Typer application, flags.py makes each command's flags from options.py, commands.py
holds the four commands, render.py lays results out.

Exit codes: 0 success; 1 a threshold failed; 2 usage error; 3 bad input (missing or unreadable model,
unsupported architecture, invalid rank, output exists); 130 interrupted.
"""

from __future__ import annotations

import signal
import sys
from typing import Optional

from . import commands  # noqa: F401 - registers the commands with the app
from .app import app
from .render import print_error

__all__ = ["app", "entry", "main"]


def _is(error: BaseException, class_name: str) -> bool:
    """Match click's exception classes by name: typer may vendor its own copy of click."""
    return any(cls.__name__ == class_name for cls in type(error).__mro__)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: every failure becomes one line on stderr and an exit code, never a traceback."""
    from ..errors import CollabError, first_line
    from ..interrupts import forget_interrupt, request_interrupt

    forget_interrupt()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, request_interrupt)
    _quiet_libraries()
    try:
        # Without standalone mode click returns a typer.Exit's code instead of exiting.
        code = app(args=argv, prog_name="collab-convert", standalone_mode=False)
        code = code if isinstance(code, int) else 0
        if code == 130:  # typer turns Ctrl-C (and our SIGTERM) into a silent Exit(130)
            print_error("interrupted; nothing was written")
        return code
    except KeyboardInterrupt:
        print_error("interrupted; nothing was written")
        return 130
    except CollabError as error:
        print_error(str(error))
        return error.exit_code
    except MemoryError:
        print_error("ran out of memory")
        return 3
    except OSError as error:
        import errno

        where = f" ({error.filename})" if error.filename else ""
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            print_error(f"could not write the output{where}: {error.strerror}; nothing was written")
        else:  # the system refused something else (a file gone or unreadable mid-run): still one line
            print_error(f"{error.strerror or first_line(error)}{where}")
        return 3
    except Exception as error:  # click's own exceptions, whichever copy of click raised them
        if _is(error, "NoArgsIsHelpError"):
            print(error.format_message() if hasattr(error, "format_message") else "", file=sys.stderr)
            return 2
        if _is(error, "UsageError"):
            context = getattr(error, "ctx", None)
            command = getattr(getattr(context, "command", None), "name", None)
            hint = f" (see collab-convert {command} --help)" if command and command != "collab-convert" else ""
            print_error(error.format_message().replace("\n", " ") + hint)
            return 2
        if _is(error, "Exit"):
            return getattr(error, "exit_code", 0)
        if _is(error, "Abort"):
            print_error("interrupted; nothing was written")
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


def entry() -> None:
    sys.exit(main())
