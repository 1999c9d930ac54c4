"""Ctrl-C and SIGTERM, remembered. The CLI's handler raises KeyboardInterrupt at once, but Python drops an
exception raised inside a destructor or a weakref callback (it prints "Exception ignored in ..." and goes on), so
an interrupt that lands there would let the run finish and write its output. The request is kept, and the
output's commit checks it: an interrupted run never commits."""

from __future__ import annotations

_requested = False


def request_interrupt(signum=None, frame=None) -> None:
    """Signal handler: remember the interrupt, then raise it where the run is."""
    global _requested
    _requested = True
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if an interrupt was requested, even one that was swallowed on its way."""
    if _requested:
        raise KeyboardInterrupt


def forget_interrupt() -> None:
    global _requested
    _requested = False
