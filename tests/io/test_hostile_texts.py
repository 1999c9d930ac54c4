"""Hostile calibration and verify texts: empty, binary, invalid UTF-8, one 10 MB line, a folder of thousands
of files. Each is refused in one clear error or read cheaply, never a traceback."""

import pytest

from collab_convert.errors import BadInputError
from collab_convert.io.texts import MAX_LINE_CHARACTERS, read_texts


@pytest.mark.parametrize("content, fragment", [
    (b"", "holds no text"),
    (b"\n\n   \n", "holds no text"),
    (bytes(range(256)) * 4, "not UTF-8|binary"),
    (b"caf\xe9 au lait\n", "not UTF-8"),
    (b"text\x00with a NUL\n", "binary"),
])
def test_unusable_files_are_refused(tmp_path, content, fragment):
    path = tmp_path / "texts.txt"
    path.write_bytes(content)
    with pytest.raises(BadInputError, match=fragment):
        read_texts(path)


def test_a_ten_megabyte_line_is_cut_not_refused(tmp_path):
    path = tmp_path / "one-line.txt"
    path.write_text("word " * 2_000_000 + "\nsecond line\n")
    texts = read_texts(path)
    assert len(texts) == 2 and len(texts[0]) == MAX_LINE_CHARACTERS


def test_a_folder_of_thousands_of_files_reads_only_what_is_used(tmp_path):
    for index in range(3000):
        (tmp_path / f"{index:05d}.txt").write_text(f"sentence number {index}\n")
    (tmp_path / "99999.txt").write_bytes(b"\xff\xfe broken")  # never reached: the limit is met first
    assert read_texts(tmp_path, limit=10) == [f"sentence number {i}" for i in range(10)]


def test_a_missing_path_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        read_texts(tmp_path / "nowhere.txt")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_refused_not_read_without_end(device):
    """/dev/zero would be read until memory ran out; /dev/null is not a missing file either."""
    with pytest.raises(BadInputError, match="not a file or a folder"):
        read_texts(device)
