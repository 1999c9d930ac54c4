"""The decoder forms' runs ask torch for transparent huge pages (its THP_MEM_ALLOC_ENABLE) before torch loads: their
calibration passes allocate and free large buffers batch after batch. The CP form does not (its fits grow the heap
with it), a user's own setting wins, and a process that already loaded torch is left as it is."""

import json
import os
import subprocess
import sys

import torch

from collab_convert import cpu
from fixtures.models import ROTARY_CASES, build_rotary


def fresh_python(code: str, **environment) -> str:
    """What `code` prints in a new interpreter (torch not loaded), with these environment variables (None: unset)."""
    env = {**os.environ, **{k: v for k, v in environment.items() if v is not None}}
    for name in [k for k, v in environment.items() if v is None]:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


ASKS = ("import os; from collab_convert.cpu import ask_for_huge_pages as ask; "
        "print([ask(form) for form in ('collaborative', 'auto', 'shared-key', 'multi-query')], "
        "os.environ.get('THP_MEM_ALLOC_ENABLE'))")


def test_only_the_decoder_forms_ask_and_the_first_ask_sets_torchs_setting():
    assert fresh_python(ASKS, THP_MEM_ALLOC_ENABLE=None) == "[False, False, True, False] 1"


def test_a_users_own_setting_wins():
    assert fresh_python(ASKS, THP_MEM_ALLOC_ENABLE="0") == "[False, False, False, False] 0"


def test_a_process_that_loaded_torch_is_left_as_it_is(monkeypatch):
    monkeypatch.delenv(cpu.HUGE_PAGES, raising=False)
    assert torch.zeros(1).numel() == 1  # torch has allocated: its setting is read already
    assert not cpu.ask_for_huge_pages("shared-key")
    assert cpu.HUGE_PAGES not in os.environ and not cpu.huge_pages_on()


def test_the_command_line_asks_for_a_key_cache_run_and_its_report_says_so(tmp_path):
    model = tmp_path / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), model)
    code = ("from collab_convert.cli import main; import sys; "
            f"sys.exit(main(['compress', {str(model)!r}, '--key-cache', '0.5', '--weight-only', '-q', "
            f"'-o', {str(tmp_path / 'out')!r}]))")
    fresh_python(code, THP_MEM_ALLOC_ENABLE=None)

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["threads"]["huge_pages"] is True
    assert "huge pages asked for" in (tmp_path / "out" / "report.md").read_text()
