"""Tiny models built from configs by fixtures/ (no downloads) and the real all-MiniLM-L6-v2 shipped on PyPI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# pytest-xdist's workers (pyproject's addopts: -n 2) are started with COLUMNS=80: piped output gets its wide
# default in them as in a plain run; tests of a terminal's width set COLUMNS themselves.
os.environ.pop("COLUMNS", None)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers share the cores: one thread each, so that neither waits on a thread the other has preempted.
    torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for fixtures/

import collab_convert  # noqa: E402,F401 - registers the loader with transformers
from fixtures import SENTENCES, HERE as FIXTURES  # noqa: E402
from fixtures.models import save_tiny  # noqa: E402


class QuietMachine:
    """The neighbour gauge of a machine with nothing else running: torch splits each score block over its threads."""

    def busy_elsewhere(self) -> float:
        return 0.0


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The score path's scheduling depends on the machine's load (modeling/blocks.py): pinned here, so a test
    takes the same path beside a busy neighbour as on a quiet machine. Tests of the busy path pin that instead."""
    from collab_convert.modeling import blocks

    monkeypatch.setattr(blocks.BlockWorkers, "_gauge", QuietMachine())


@pytest.fixture(autouse=True)
def no_stage_lines_on_a_timer(monkeypatch):
    """Piped, a command writes a stage's line once the stage has run STAGE_LINE_AFTER seconds: how long a stage
    takes depends on the machine's load, so here none does unless a test asks for them (nor in the commands a
    test runs in a child process: they read the environment)."""
    from collab_convert.cli import render

    monkeypatch.setattr(render, "STAGE_LINE_AFTER", 3600.0)
    monkeypatch.setenv("COLLAB_CONVERT_STAGE_LINE_AFTER", "3600")


@pytest.fixture
def tiny_bert(tmp_path) -> Path:
    return save_tiny(tmp_path / "tiny-bert")


@pytest.fixture
def token_batch():
    torch.manual_seed(1)
    input_ids = torch.randint(1, 120, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # padding must be honoured
    attention_mask[2, 3:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture
def calibration_file() -> Path:
    assert len(SENTENCES) >= 32
    return FIXTURES / "sentences.txt"


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)
