"""GGUF export: a stock multi-query checkpoint as one file in llama.cpp's llama architecture, checked by running
llama.cpp's graph (written in torch) over the file's own tensors against transformers; and in llama.cpp itself
where its Python binding is installed (the benchmark builds it; CI does not)."""

import json

import pytest
import torch

from collab_convert import CompressOptions, compress
from collab_convert.cli import main
from collab_convert.exporting import export
from collab_convert.options import ExportOptions
from fixtures import SENTENCES
from fixtures.models import ROTARY_CASES, build_rotary, save_tiny_bpe_tokenizer


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """A tiny llama (llama3 RoPE, a byte-level BPE tokenizer) and its multi-query form at half the KV cache."""
    root = tmp_path_factory.mktemp("gguf")
    build_rotary(next(c for c in ROTARY_CASES if c.name == "llama-bpe"), root / "in")
    save_tiny_bpe_tokenizer(root / "in")
    compress(str(root / "in"), CompressOptions(kv_cache=0.5, output=root / "mq", weight_only=True))
    return root


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_the_file_computes_what_transformers_does(stock, dtype, tmp_path):
    from gguf import GGUFReader

    target = tmp_path / "model.gguf"
    result = export(str(stock / "mq"), ExportOptions(format="gguf", output=target, dtype=dtype))
    assert result.max_abs_difference < 1e-5 and result.details["next_token_agreement"] == 1.0
    fields = {name: field.contents() for name, field in GGUFReader(str(target)).fields.items()}
    assert fields["general.architecture"] == "llama" and fields["llama.attention.head_count_kv"] == 1
    assert fields["llama.attention.key_length"] == fields["llama.attention.value_length"] == 16
    tensors = {t.name: t for t in GGUFReader(str(target)).tensors}
    assert list(tensors["rope_freqs.weight"].shape) == [8]  # the key's per-pair frequencies
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == dtype.upper()
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == 300


def test_the_check_catches_a_layout_mistake_and_writes_nothing(stock, tmp_path, monkeypatch):
    from collab_convert.errors import BadInputError
    from collab_convert.integration import gguf_export

    monkeypatch.setattr(gguf_export, "interleaved", lambda rows, heads: rows)  # rotate_half pairs left as they are
    with pytest.raises(BadInputError, match="differs from PyTorch"):
        export(str(stock / "mq"), ExportOptions(format="gguf", output=tmp_path / "model.gguf", dtype="f32"))
    assert list(tmp_path.iterdir()) == []


def test_the_original_exports_too_for_a_side_by_side(stock, tmp_path):
    result = export(str(stock / "in"), ExportOptions(format="gguf", output=tmp_path / "original.gguf", dtype="f32"))
    assert result.details["kv_heads"] == 2 and result.max_abs_difference < 1e-5


@pytest.mark.parametrize("what, why", [
    ("shared-key", "loads through collab-convert's own modules"),
    ("name", "name it with .gguf"),
    ("exists", "pass --overwrite"),
])
def test_what_it_cannot_write_is_refused_in_one_line(stock, what, why, tmp_path, capsys):
    source, target = stock / "mq", tmp_path / "model.gguf"
    if what == "shared-key":
        source = tmp_path / "shared"
        compress(str(stock / "in"), CompressOptions(key_cache=0.5, output=source, weight_only=True))
    elif what == "name":
        target = tmp_path / "model.bin"
    else:
        target.write_text("keep me")
    capsys.readouterr()
    code = main(["export", str(source), "--format", "gguf", "-o", str(target)])
    err = capsys.readouterr().err
    assert code == 3 and why in err and err.count("\n") == 1
    assert (not target.exists()) or target.read_text() == "keep me"


def test_missing_folders_before_the_file_are_made_as_compress_makes_its_output(stock, tmp_path):
    target = tmp_path / "releases" / "v1" / "model.gguf"
    assert main(["export", str(stock / "mq"), "--format", "gguf", "-o", str(target)]) == 0
    assert target.is_file() and [p.name for p in target.parent.iterdir()] == ["model.gguf"]


def test_the_cli_names_what_it_checked(stock, tmp_path, capsys):
    capsys.readouterr()
    assert main(["export", str(stock / "mq"), "--format", "gguf", "-o", str(tmp_path / "m.gguf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["format"] == "gguf" and result["details"]["dtype"] == "f16" and result["files"] == ["m.gguf"]


def test_llama_cpp_runs_the_file(stock, tmp_path):
    """Where llama.cpp's Python binding is installed: the real engine agrees with transformers."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export(str(stock / "mq"), ExportOptions(format="gguf", output=tmp_path / "m.gguf", dtype="f32"))
    ids = AutoTokenizer.from_pretrained(stock / "mq")(" ".join(SENTENCES[:3]))["input_ids"][:60]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(stock / "mq")(torch.tensor([ids])).logits[0]
    engine = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), logits_all=True, n_ctx=128, verbose=False)
    engine.eval(ids)
    found = torch.tensor(engine.scores[: len(ids)])
    assert (found.argmax(-1) == expected.argmax(-1)).float().mean() == 1.0
    assert float((found - expected).abs().max() / expected.abs().max()) < 1e-3
