"""A busy neighbour for --loaded runs: one thread of float32 matrix products for as long as the block runs, as a
second job on a shared 2-core machine would be."""

from __future__ import annotations

import contextlib
import subprocess
import sys

PROGRAM = """
import torch
torch.set_num_threads(1)
a = torch.randn(1024, 1024)
while True:
    a = torch.tanh(a @ a / 32)
"""


@contextlib.contextmanager
def busy_neighbour(enabled: bool = True):
    process = subprocess.Popen([sys.executable, "-c", PROGRAM]) if enabled else None
    try:
        yield
    finally:
        if process is not None:
            process.kill()
            process.wait()
