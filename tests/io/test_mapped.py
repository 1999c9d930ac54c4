"""Pages of a memory-mapped shard leave resident memory once read, and nothing else is ever given back."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from collab_convert.io.mapped import drop_read_pages, unwritten_file_mapping
from fixtures.resident import resident_file_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@pytest.fixture
def mapped_weight(tmp_path):
    torch.manual_seed(0)
    save_file({"weight": torch.randn(4096, 512)}, tmp_path / "shard.safetensors")  # 8 MB
    return safe_open(str(tmp_path / "shard.safetensors"), framework="pt").get_tensor("weight")


def test_a_read_weights_pages_leave_and_its_values_stay(mapped_weight):
    expected = mapped_weight.clone()
    assert unwritten_file_mapping(mapped_weight) is not None
    float(mapped_weight.sum())  # every page touched
    touched = resident_file_bytes()
    drop_read_pages(mapped_weight)
    assert touched - resident_file_bytes() > 0.9 * mapped_weight.numel() * mapped_weight.element_size()
    assert torch.equal(mapped_weight, expected)  # read again from the page cache


def test_only_the_pages_wholly_inside_a_slice_go(mapped_weight):
    expected = mapped_weight.clone()
    for rows in (slice(0, 3), slice(3, 1000), slice(1000, None)):  # slices that end mid-page
        drop_read_pages(mapped_weight[rows])
    assert torch.equal(mapped_weight, expected)


def test_memory_that_is_not_an_unwritten_file_mapping_does_not_qualify(mapped_weight):
    assert unwritten_file_mapping(torch.randn(4096, 512)) is None  # anonymous: dropping it would zero it
    assert unwritten_file_mapping(mapped_weight.clone()) is None
    mapped_weight[0, 0] = 1.0  # a private copy of that page now: dropping it would bring the file's bytes back
    assert unwritten_file_mapping(mapped_weight) is None


def test_the_reader_hands_out_large_tensors_off_the_mapping(tmp_path):
    """What a loop over the layers reads does not stay resident while its shard stays mapped: a large tensor comes
    back as a copy of the file's values, its pages in the mapping handed back; small ones stay views."""
    from collab_convert.io.reader import TensorReader

    torch.manual_seed(0)
    weights = {"large": torch.randn(4096, 512), "small": torch.randn(16, 16)}
    save_file(weights, tmp_path / "model.safetensors")
    reader = TensorReader(tmp_path)
    try:
        before = resident_file_bytes()
        large = reader.get("large")
        assert torch.equal(large, weights["large"])
        assert unwritten_file_mapping(large) is None  # a copy in anonymous memory
        assert resident_file_bytes() - before < 0.25 * large.numel() * large.element_size()
        assert unwritten_file_mapping(reader.get("small")) is not None
    finally:
        reader.close()


def test_the_reader_leaves_alone_a_tensor_that_is_not_a_view_of_the_mapping(tmp_path):
    """safetensors may copy a tensor (to align it): that copy is handed out as it is, and its pages are never given
    back (anonymous memory given back reads as zeros), even once the shard's mapping has qualified."""
    from collab_convert.io.reader import TensorReader

    torch.manual_seed(0)
    weights = {"first": torch.randn(1024, 512), "second": torch.randn(1024, 512)}
    save_file(weights, tmp_path / "model.safetensors")
    reader = TensorReader(tmp_path)
    try:
        assert torch.equal(reader.get("first"), weights["first"])  # the mapping qualifies now
        handle = reader._handle(reader._location["second"])
        copied = handle.get_tensor("second").clone()

        class Copying:  # a handle whose tensor comes back as a copy in anonymous memory
            def get_tensor(self, key):
                return copied

        reader._open[reader._location["second"]] = Copying()
        second = reader.get("second")
        assert second is copied and torch.equal(second, weights["second"])
    finally:
        reader.close()
