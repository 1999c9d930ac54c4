"""Files only: sizes, model resolution, the lazy reader and streaming writer, and staged output."""

import pytest
import torch

from collab_convert.errors import BadInputError, OutputExistsError
from collab_convert.io.folders import StagedOutput, check_output
from collab_convert.io.headers import TensorSpec
from collab_convert.io.reader import TensorReader
from collab_convert.io.writer import ShardWriter, parse_size


def test_sizes_parse_like_humans_write_them():
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size(1234) == 1234
    with pytest.raises(BadInputError):
        parse_size("lots")


def test_hub_id_not_in_the_cache_says_how_to_get_it(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from collab_convert.io.folders import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(BadInputError, match="hf download acme/missing"):
        resolve_model("acme/missing")


def test_shard_writer_streams_what_the_reader_reads_back(tmp_path):
    tensors = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    writer = ShardWriter(tmp_path, specs, max_shard_bytes=40)  # the first tensor alone fills a shard
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.finish() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                               "model.safetensors.index.json"]
    reader = TensorReader(tmp_path)
    assert reader.names() == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(reader.get(name), tensor) and reader.spec(name).shape == tuple(tensor.shape)


def test_shard_writer_refuses_a_tensor_out_of_order(tmp_path):
    writer = ShardWriter(tmp_path, [TensorSpec("a", torch.float32, (2,))])
    with pytest.raises(RuntimeError, match="writer expected a"):
        writer.add("b", torch.zeros(2))


def test_staged_output_appears_whole_on_commit_and_vanishes_otherwise(tmp_path):
    output = tmp_path / "out"
    with StagedOutput(output) as staged:
        (staged.folder / "model.safetensors").write_text("x")
        assert not output.exists()
        staged.commit()
    assert (output / "model.safetensors").read_text() == "x"
    with pytest.raises(KeyError):
        with StagedOutput(tmp_path / "other") as staged:
            (staged.folder / "half").write_text("written")
            raise KeyError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped interrupt, as meant
def test_an_interrupt_swallowed_on_its_way_still_stops_the_commit(tmp_path):
    # Python drops an exception raised inside a destructor; the request is remembered all the same.
    from collab_convert import interrupts

    class Swallowing:
        def __del__(self):
            interrupts.request_interrupt()  # raises KeyboardInterrupt, which Python prints and drops here

    try:
        Swallowing()  # the interrupt lands in its destructor and is lost
        with pytest.raises(KeyboardInterrupt):
            with StagedOutput(tmp_path / "out") as staged:
                (staged.folder / "model.safetensors").write_text("x")
                staged.commit()
        assert list(tmp_path.iterdir()) == []  # nothing committed, the staging folder gone
    finally:
        interrupts.forget_interrupt()


def test_output_checks_refuse_overlap_and_occupied_folders(tmp_path):
    source = tmp_path / "model"
    (source / "sub").mkdir(parents=True)
    with pytest.raises(BadInputError, match="overlaps the input"):
        check_output(source / "sub", source, overwrite=True)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "file").write_text("keep me")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        check_output(occupied, source, overwrite=False)
    check_output(occupied, source, overwrite=True)


@pytest.mark.parametrize("kernel", ["whole", "partial then refused", "unavailable"])
def test_copied_tensors_are_byte_identical_however_the_kernel_copies(tmp_path, monkeypatch, kernel):
    import os

    source = tmp_path / "in"
    source.mkdir()
    tensors_in = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(1000, dtype=torch.bfloat16),
                  "c": torch.ones(3, 4, dtype=torch.float16)}
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors_in.items()]
    writer = ShardWriter(source, specs)
    for name, tensor in tensors_in.items():
        writer.add(name, tensor)
    writer.finish()
    real = getattr(os, "copy_file_range", None)
    if kernel == "partial then refused" and real is not None:
        calls = []

        def partial(src, dst, count, offset_src=None, *args):
            if calls:
                raise OSError(18, "cross-device")
            calls.append(1)
            return real(src, dst, max(count // 3, 1), offset_src)

        monkeypatch.setattr(os, "copy_file_range", partial)
    elif kernel == "unavailable":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    reader = TensorReader(source)
    out = tmp_path / "out"
    out.mkdir()
    copy = ShardWriter(out, [reader.spec(name) for name in reader.names()])
    for name in reader.names():
        copy.copy_bytes(reader.spec(name), reader.byte_range(name), chunk=7)
    copy.finish()
    assert (out / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_tensors_are_overwritten_in_place_and_nothing_else_moves(tmp_path):
    from collab_convert.io.writer import overwrite_tensors

    first = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    second = torch.ones(5, dtype=torch.bfloat16)
    specs = [TensorSpec("a", torch.float32, (3, 4)), TensorSpec("b", torch.bfloat16, (5,)),
             TensorSpec("c", torch.float32, (2,))]
    writer = ShardWriter(tmp_path, specs, max_shard_bytes=50)  # "a" in one shard, "b" and "c" in another
    for spec, tensor in zip(specs, (first, second, torch.tensor([7.0, 8.0])), strict=True):
        writer.add(spec.name, tensor)
    files = writer.finish()
    before = {name: (tmp_path / name).read_bytes() for name in files}

    overwrite_tensors(tmp_path, {"b": torch.full((5,), 2.5, dtype=torch.float64), "a": -first})

    reader = TensorReader(tmp_path)
    assert torch.equal(reader.get("a"), -first)
    assert reader.get("b").dtype == torch.bfloat16 and torch.equal(reader.get("b"), torch.full((5,), 2.5).bfloat16())
    assert torch.equal(reader.get("c"), torch.tensor([7.0, 8.0]))
    reader.close()
    assert {name: len((tmp_path / name).read_bytes()) for name in files} == {n: len(b) for n, b in before.items()}
    written = {name: (tmp_path / name).read_bytes() for name in files}
    with pytest.raises(RuntimeError, match="shape"):
        overwrite_tensors(tmp_path, {"a": first, "c": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="not in"):
        overwrite_tensors(tmp_path, {"a": first, "missing": torch.zeros(1)})
    assert {name: (tmp_path / name).read_bytes() for name in files} == written  # refused whole, before a byte


def test_reading_layer_by_layer_keeps_one_shard_mapped(tmp_path):
    """A loop over the layers that reads each one's weights (the rank spread, the fits before refinement) holds
    the pages of the shard it reads, not of every shard read before it."""
    from transformers import BertModel

    from collab_convert.architectures.source import open_model
    from fixtures.models import save_tiny_tokenizer, tiny_bert_config

    torch.manual_seed(0)
    BertModel(tiny_bert_config(num_hidden_layers=4)).save_pretrained(tmp_path, max_shard_size="40KB")
    save_tiny_tokenizer(tmp_path)
    source = open_model(str(tmp_path))
    try:
        shards_read = set()
        for layer in source.shard_by_shard():
            source.read_projections(layer)
            shards_read |= set(source.reader._open)
            assert list(source.reader._open) == [source.reader._location[layer.anchor]]
        assert len(shards_read) > 1  # the layers do lie in several shards
    finally:
        source.close()
