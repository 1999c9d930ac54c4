"""The decoder forms' runs ask torch for transparent huge pages (its THP_MEM_ALLOC_ENABLE) before torch reads it, at
its first allocation: their calibration passes allocate and free large buffers batch after batch. The CP form does
not (its fits grow the heap with it), a user's own setting wins, a process whose torch has allocated is left as it
is, and the report says what torch's allocator does, not what the environment says."""

import json
import os
import subprocess
import sys

import torch

from collab_convert import cpu
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny


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


CHECKS = ("import os, torch; from collab_convert import cpu; {before}; "
          "print(cpu.huge_pages_on(), os.environ.get('THP_MEM_ALLOC_ENABLE'))")


def test_torch_loaded_but_nothing_allocated_still_takes_the_setting():
    assert fresh_python(CHECKS.format(before="print(cpu.ask_for_huge_pages('shared-key'))"),
                        THP_MEM_ALLOC_ENABLE=None) == "True\nTrue 1"


def test_a_setting_torch_read_too_late_is_reported_off_and_taken_back():
    late = "torch.zeros(1); print(cpu.ask_for_huge_pages('shared-key'))"
    assert fresh_python(CHECKS.format(before=late), THP_MEM_ALLOC_ENABLE=None) == "False\nFalse None"
    # set by hand after torch's first allocation: the environment says 1, the allocator does not take it
    by_hand = "torch.zeros(1); os.environ['THP_MEM_ALLOC_ENABLE'] = '1'"
    assert fresh_python(CHECKS.format(before=by_hand), THP_MEM_ALLOC_ENABLE=None) == "False 1"


def compressed_report(tmp_path, model, *flags) -> dict:
    """report.json of a weight-only compress of `model` run from the command line in a fresh interpreter."""
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    code = ("from collab_convert.cli import main; import sys; "
            f"sys.exit(main(['compress', {str(model)!r}, *{list(flags)!r}, '--weight-only', '-q', '-o', {str(out)!r}]))")
    fresh_python(code, THP_MEM_ALLOC_ENABLE=None)
    return json.loads((out / "report.json").read_text()) | {"card": (out / "report.md").read_text()}


def test_the_command_line_asks_for_a_key_cache_run_and_its_report_says_so(tmp_path):
    model = tmp_path / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), model)
    report = compressed_report(tmp_path, model, "--key-cache", "0.5")

    assert report["threads"]["huge_pages"] is True
    assert "huge pages asked for" in report["card"]


def test_a_form_left_to_the_family_asks_for_a_rotary_decoder_and_not_for_an_encoder(tmp_path):
    llama, bert = tmp_path / "llama", tmp_path / "bert"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), llama)
    save_tiny(bert)

    assert compressed_report(tmp_path, llama, "--rank", "8")["threads"]["huge_pages"] is True  # the shared key
    assert compressed_report(tmp_path, bert, "--rank", "8")["threads"]["huge_pages"] is False  # the CP form


def test_the_familys_form_is_read_without_converting_a_gguf_file(tmp_path, monkeypatch):
    from collab_convert.architectures.source import form_taken

    monkeypatch.setenv("COLLAB_CONVERT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    llama = tmp_path / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), llama)

    assert form_taken(str(gguf)) is None and not (tmp_path / "cache").exists()
    assert form_taken(str(llama)) == "shared-key" and form_taken(str(tmp_path / "missing")) is None


def test_the_kernels_mode_is_read_and_the_report_says_when_it_gives_none(tmp_path):
    from collab_convert.report.reports import _huge_pages

    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert cpu.kernel_huge_pages(str(setting)) == "never"
    assert cpu.kernel_huge_pages(str(tmp_path / "missing")) is None
    assert "the kernel's setting: never, so none are given" in _huge_pages({"huge_pages": True,
                                                                            "huge_pages_kernel": "never"})
    assert _huge_pages({"huge_pages": False, "huge_pages_kernel": "madvise"}) == ""
