"""A GGUF input is dequantised to float32 to be compressed; the output goes back to the precision the file stored
its weights in (or the one --dtype asks for), and config.json says which."""

import json

import pytest
import torch
from safetensors import safe_open

from collab_convert import CompressOptions, compress
from collab_convert.exporting import export
from collab_convert.io.gguf import stored_precision
from collab_convert.options import ExportOptions
from collab_convert.report.summary import disk_line
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny_bpe_tokenizer


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-input")
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama-bpe"), root / "in")
    save_tiny_bpe_tokenizer(root / "in")
    return root / "in"


def gguf_of(folder, dtype, target):
    """The tiny llama as a GGUF file in `dtype`, written by our own exporter (llama.cpp's llama architecture)."""
    export(str(folder), ExportOptions(format="gguf", output=target, dtype=dtype))
    return target


def stored_dtypes(folder) -> set[str]:
    with safe_open(folder / "model.safetensors", "pt") as handle:
        return {handle.get_slice(name).get_dtype() for name in handle.keys()}


@pytest.mark.parametrize("precision, on_disk, named", [("f16", "F16", "float16"), ("bf16", "BF16", "bfloat16")])
def test_a_gguf_input_is_written_in_the_precision_its_file_stored(tiny_llama_folder, precision, on_disk, named,
                                                                 tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAB_CONVERT_CACHE", str(tmp_path / "cache"))
    source = gguf_of(tiny_llama_folder, precision, tmp_path / "in.gguf")
    assert stored_precision(source) == precision
    result = compress(str(source), CompressOptions(kv_cache=0.5, output=tmp_path / "out", weight_only=True))
    assert stored_dtypes(tmp_path / "out") == {on_disk}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == named
    assert result.disk["output_bytes"] < 0.6 * result.disk["input_bytes"]  # the dequantised float32 folder
    line = disk_line(result.disk)
    assert f"written in {precision}, the precision the file stores its weights in" in line
    assert line in (tmp_path / "out" / "report.md").read_text()


def test_dtype_f32_keeps_the_dequantised_float32(tiny_llama_folder, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("COLLAB_CONVERT_CACHE", str(tmp_path / "cache"))
    source = gguf_of(tiny_llama_folder, "f16", tmp_path / "in.gguf")
    result = compress(str(source), CompressOptions(kv_cache=1.0, output=tmp_path / "out", weight_only=True,
                                                   dtype="f32"))
    assert stored_dtypes(tmp_path / "out") == {"F32"}
    assert "written in f32)" in disk_line(result.disk)
    # the full-width multi-query form of the dequantised weights, in float32: exact
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    original = AutoModelForCausalLM.from_pretrained(dequantised(tmp_path / "cache")).eval()
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (stock(ids).logits - original(ids).logits).abs().max() < 1e-4


def dequantised(cache):
    """The float32 folder the GGUF input was dequantised into (io/gguf.py's cache)."""
    return next(p for p in (cache / "gguf").iterdir() if (p / "config.json").is_file())


def test_dtype_converts_every_floating_tensor_of_a_folder_too(tiny_bert, tmp_path):
    from transformers import AutoModel

    import collab_convert  # noqa: F401 - our loader for the collaborative form

    compress(str(tiny_bert), CompressOptions(rank=8, output=tmp_path / "f32"))
    result = compress(str(tiny_bert), CompressOptions(rank=8, output=tmp_path / "bf16", dtype="bf16"))
    assert stored_dtypes(tmp_path / "bf16") == {"BF16"}
    assert result.disk["output_bytes"] < 0.6 * result.disk["input_bytes"]
    assert "(written in bf16, as --dtype asked)" in disk_line(result.disk)
    ids = torch.tensor([[2, 15, 27, 8, 3]])
    with torch.no_grad():
        half = AutoModel.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()(ids).last_hidden_state
        full = AutoModel.from_pretrained(tmp_path / "f32").eval()(ids).last_hidden_state
    assert half.dtype == full.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(half, full, dim=-1).min() > 0.999


def test_a_checkpoint_compressed_from_a_gguf_keeps_its_own_precision_when_compressed_again(tiny_llama_folder, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("COLLAB_CONVERT_CACHE", str(tmp_path / "cache"))
    source = gguf_of(tiny_llama_folder, "f16", tmp_path / "in.gguf")
    compress(str(source), CompressOptions(kv_cache=1.0, output=tmp_path / "f32", weight_only=True, dtype="f32"))
    again = compress(str(tmp_path / "f32"), CompressOptions(kv_cache=1.0, output=tmp_path / "again",
                                                            weight_only=True))
    assert stored_dtypes(tmp_path / "again") == {"F32"} and "written_dtype" not in again.disk
