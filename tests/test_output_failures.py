"""The output side fails cleanly: a full disk (a file-size limit) ends in one line with nothing written, a run
killed with SIGKILL leaves only a staging folder that the next run removes, and of two runs racing for one OUT
one wins whole while the other refuses."""

import json
import resource
import subprocess
import sys

import pytest

from collab_convert.errors import OutputExistsError
from collab_convert.io.folders import StagedOutput
from fixtures.models import ROTARY_CASES, build_rotary


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decoder") / "llama"
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama"), folder)
    return folder


def cli(*arguments, limit_bytes=None):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "collab_convert", *map(str, arguments)], capture_output=True,
                          text=True, preexec_fn=limit if limit_bytes else None)


def test_a_full_disk_ends_in_one_line_and_leaves_nothing(decoder, tmp_path):
    run = cli("compress", decoder, "--key-cache", "0.5", "-o", tmp_path / "out", "-q", limit_bytes=20_000)
    assert run.returncode == 3
    assert run.stderr.startswith("error: could not write the output") and run.stderr.count("\n") == 1
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(decoder, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = tmp_path / f".out.collab-tmp-{dead.pid}"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    run = cli("compress", decoder, "--key-cache", "0.5", "-o", tmp_path / "out", "-q")
    assert run.returncode == 0, run.stderr
    assert not abandoned.exists() and (tmp_path / "out" / "config.json").is_file()


def test_of_two_runs_writing_one_output_one_wins_whole(tmp_path):
    output = tmp_path / "out"
    first, second = StagedOutput(output), StagedOutput(output)
    second.folder = tmp_path / ".out.collab-tmp-second"  # two processes in one test: two staging folders
    with first, second:
        (first.folder / "model.safetensors").write_text("first")
        (second.folder / "model.safetensors").write_text("second")
        first.commit()
        with pytest.raises(OutputExistsError, match="another run"):
            second.commit()
    assert (output / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


KILL_AFTER_FIRST_LAYER = r"""
import os, signal, sys
from pathlib import Path
from collab_convert import CompressOptions, compress

def progress(stage, done, total):
    if stage.startswith(("fitting", "refining")) and done == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a scheduler or the OOM killer would

compress(sys.argv[1], CompressOptions(key_cache=0.5, output=Path(sys.argv[2]), calibration=Path(sys.argv[3]),
                                      refine_steps=20), progress)
"""


def test_resume_continues_a_killed_run_and_writes_the_same_bytes(decoder, tmp_path):
    from collab_convert import CompressOptions, compress
    from fixtures.models import save_tiny_tokenizer

    save_tiny_tokenizer(decoder)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"the {w} was on the {v}" for w in "abcdef" for v in "ghij") + "\n")
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_LAYER, str(decoder), str(tmp_path / "out"),
                             str(texts)])
    assert killed.returncode == -9
    staging = [p for p in tmp_path.iterdir() if ".collab-tmp-" in p.name]
    assert len(staging) == 1 and not (tmp_path / "out").exists()  # never mistaken for a finished output
    finished = sorted(p.name for p in (staging[0] / ".resume").iterdir() if p.suffix == ".json")
    assert len(finished) == 1  # the first layer was saved before the kill
    saved = json.loads((staging[0] / ".resume" / finished[0]).read_text())

    options = dict(key_cache=0.5, calibration=texts, refine_steps=20)
    resumed = compress(str(decoder), CompressOptions(output=tmp_path / "out", resume=True, **options))
    compress(str(decoder), CompressOptions(output=tmp_path / "whole", **options))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert resumed.layers[0].seconds == saved["seconds"]  # reused, not fitted again
    assert resumed.layers[1].seconds != saved["seconds"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "texts.txt", "whole"]
    assert not (tmp_path / "out" / ".resume").exists()


def test_a_read_only_destination_ends_in_one_line(decoder, tmp_path, monkeypatch, capsys):
    """Root ignores file modes, so the refusal a read-only mount gives is simulated where folders are made."""
    import errno
    from pathlib import Path

    from collab_convert.cli import main

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    original_mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):
        if read_only in self.parents or self == read_only:
            raise PermissionError(errno.EROFS, "Read-only file system", str(self))
        return original_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    code = main(["compress", str(decoder), "--key-cache", "0.5", "-o", str(read_only / "out"), "-q"])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("error: could not write the output") and err.count("\n") == 1
    assert list(read_only.iterdir()) == []


def test_an_output_path_that_links_into_the_input_is_refused(decoder, tmp_path, capsys):
    from collab_convert.cli import main
    from fixtures.models import folder_digest

    before = folder_digest(decoder)
    link = tmp_path / "out"
    link.symlink_to(decoder / "inside", target_is_directory=True)
    code = main(["compress", str(decoder), "--key-cache", "0.5", "-o", str(link), "-q"])
    err = capsys.readouterr().err
    assert code == 3 and "overlaps the input" in err and err.count("\n") == 1
    assert folder_digest(decoder) == before


@pytest.mark.parametrize("where", ["a file as its parent", "a name too long", "inside /proc"])
def test_an_output_no_folder_can_be_made_at_ends_in_one_line(where, decoder, tmp_path, capsys):
    """Where the system refuses the output folder itself (not a full or read-only disk): one line, exit 3, and
    nothing left behind."""
    from pathlib import Path

    from collab_convert.cli import main

    (tmp_path / "notes.txt").write_text("a file, not a folder")
    output = {"a file as its parent": tmp_path / "notes.txt" / "out", "a name too long": tmp_path / ("o" * 300),
              "inside /proc": Path("/proc") / "collab-out"}[where]
    code = main(["compress", str(decoder), "--key-cache", "0.5", "-o", str(output), "-q"])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("error: could not write the output") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    if where == "a file as its parent":
        assert "notes.txt is a file, not a folder" in err
