"""Hostile or broken safetensors files and shard indexes are refused in one clear error, before anything a
header claims is allocated; property-based fuzzing of headers finds no other exception."""

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collab_convert.errors import BadInputError
from collab_convert.io.reader import TensorReader


def write(folder, header: dict | bytes, data: bytes = b"", claimed: int | None = None):
    folder.mkdir(exist_ok=True)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if claimed is None else claimed
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", length) + raw + data)
    return folder


def refused(folder, fragment):
    with pytest.raises(BadInputError, match=fragment):
        TensorReader(folder)


GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


def test_a_sound_file_reads(tmp_path):
    folder = write(tmp_path / "m", GOOD, bytes(16))
    assert TensorReader(folder).get("w").shape == (2, 2)


@pytest.mark.parametrize("header, data, claimed, fragment", [
    (GOOD, bytes(16), 2**40, "claims"),  # a header length of a terabyte
    (b"{not json", b"", None, "not JSON"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {"dtype": "F32", "shape": [1], '
     b'"data_offsets": [4, 8]}}', bytes(8), None, "twice"),
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 4096]}}, bytes(16), None, "outside"),
    ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}, bytes(16), None, "disagrees"),
    ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), None, "dtype"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16), None, "overlap"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}}, bytes(16), None, "shape"),
    ([1, 2, 3], b"", None, "not a JSON object"),
])
def test_lying_headers_are_refused(tmp_path, header, data, claimed, fragment):
    refused(write(tmp_path / "m", header, data, claimed), fragment)


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path):
    folder = write(tmp_path / "m", GOOD, bytes(16))
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    for target in ("../elsewhere.safetensors", "/etc/passwd"):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": target}}))
        refused(folder, "outside the model folder")


def test_a_shard_linking_outside_the_folder_is_refused(tmp_path):
    outside = write(tmp_path / "outside", GOOD, bytes(16))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    refused(folder, "leads outside")


def test_an_index_naming_missing_shards_is_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-9.safetensors"}}))
    refused(folder, "missing")


entries = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "I8", "Q4"]), st.integers(), st.none()),
    "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), st.text(max_size=3), st.none()),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 80), min_size=0, max_size=3), st.none()),
})


@settings(max_examples=1500, deadline=None)
@given(header=st.dictionaries(st.text(min_size=1, max_size=4), entries, max_size=4),
       data=st.binary(max_size=64), claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzzed_headers_end_in_a_clear_error_or_a_good_read(tmp_path_factory, header, data, claimed):
    folder = write(tmp_path_factory.mktemp("fuzz"), header, data, claimed)
    try:
        reader = TensorReader(folder)
        for name in reader.names():
            reader.get(name)
    except BadInputError:
        pass
