"""ONNX export: a compressed encoder and a compressed decoder run in onnxruntime as they do in PyTorch."""

import json

import pytest
import torch
from typer.testing import CliRunner

from collab_convert import CompressOptions, compress
from collab_convert.cli import app



def _session_outputs(folder, inputs):
    from collab_convert.integration.onnx_export import onnx_session

    session = onnx_session(folder / "model.onnx")
    names = [i.name for i in session.get_inputs()]
    return torch.from_numpy(session.run(None, {name: inputs[name].numpy() for name in names})[0])


def test_a_compressed_encoder_runs_in_onnxruntime_as_in_pytorch(tiny_bert, tmp_path, token_batch):
    from collab_convert import load_model
    from collab_convert.exporting import export
    from collab_convert.options import ExportOptions
    from transformers import AutoModel

    compressed = tmp_path / "compressed"
    compress(str(tiny_bert), CompressOptions(rank=8, output=compressed))
    result = export(str(compressed), ExportOptions(output=tmp_path / "onnx"))
    assert result.max_abs_difference <= 1e-4
    assert "model.onnx" in result.files and "tokenizer.json" in result.files
    assert not any(name.endswith(".svg") for name in result.files)  # compress's plots stay behind
    # runtimes (optimum, transformers.js) read the original's model type; the graph needs no modeling code
    config = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert config["model_type"] == "bert" and "auto_map" not in config
    assert "collaborative_modeling.py" not in result.files
    # a batch of another size and length than the traced example, with padding
    inputs = dict(token_batch, token_type_ids=torch.zeros_like(token_batch["input_ids"]))
    ours = _session_outputs(tmp_path / "onnx", inputs)
    with torch.no_grad():
        theirs = load_model(str(compressed), auto_class=AutoModel).eval()(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    assert (ours - theirs)[real].abs().max() < 1e-4


def test_a_half_precision_checkpoint_exports_as_a_float32_graph(tiny_bert, tmp_path):
    from collab_convert.exporting import export
    from collab_convert.options import ExportOptions

    compress(str(tiny_bert), CompressOptions(rank=8, output=tmp_path / "compressed", dtype="f16"))
    result = export(str(tmp_path / "compressed"), ExportOptions(output=tmp_path / "onnx"))
    assert result.max_abs_difference <= 1e-4  # float16 arithmetic in both differed by 4e-3


def _decoder(kind: str, folder):
    import transformers as T

    from fixtures.models import save_tiny_tokenizer

    torch.manual_seed(0)
    if kind == "gpt2":  # absolute positions, collaborative (CP) form
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=120, n_embd=32, n_layer=2, n_head=4, n_positions=160))
    else:  # rotary, grouped-query: the shared rotary key
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=160))
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-shared-key", "llama"])
def test_a_compressed_decoder_exports_its_logits_without_cache(kind, tmp_path):
    folder = _decoder(kind.removesuffix("-shared-key"), tmp_path / kind)
    budget = {"rank": 8} if kind == "gpt2" else {"key_cache": 0.5}  # --key-cache: the shared-key form
    compress(str(folder), CompressOptions(output=tmp_path / "compressed", plots=False, **budget))
    outcome = CliRunner().invoke(app, ["export", str(tmp_path / "compressed"), "-o", str(tmp_path / "onnx"), "--json"])
    assert outcome.exit_code == 0, outcome.output
    report = json.loads(outcome.stdout)
    assert report["outputs"] == ["logits"] and report["max_abs_difference"] <= 1e-4
    assert report["inputs"] == ["input_ids", "attention_mask"]
    assert json.loads((tmp_path / "onnx" / "export.json").read_text())["kind"].startswith("causal language model")


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_an_encoder_decoder_exports_its_encoder(name, tmp_path):
    # the whole model would run its decoder on inputs it makes up (T5 refused to trace at all): the encoder is
    # what takes the input alone, and export.json says so
    from collab_convert.exporting import export
    from collab_convert.options import ExportOptions
    from fixtures.models import build_family, family_case, save_tiny_tokenizer

    build_family(family_case(name), tmp_path / "in")
    save_tiny_tokenizer(tmp_path / "in")  # the export checks its result on text
    compress(str(tmp_path / "in"), CompressOptions(form="shared-key", key_cache=0.5, output=tmp_path / "c", plots=False))
    result = export(str(tmp_path / "c"), ExportOptions(output=tmp_path / "onnx"))
    assert result.max_abs_difference <= 1e-4
    kind = json.loads((tmp_path / "onnx" / "export.json").read_text())["kind"]
    assert kind.startswith("encoder of an encoder-decoder")


def test_a_failed_export_is_explained_by_its_cause_in_one_clean_line():
    from collab_convert.exporting import export_failure

    torch_style = RuntimeError("Failed to export the model with torch.export. \x1b[96mThis is step 1/3\x1b[0m of "
                               "exporting.\n- Modify the model code.\n\n## Exception summary\n\n<class 'ValueError'>: "
                               "You must specify exactly one of input_ids or inputs_embeds\n\n(Refer to the stack.)")
    assert export_failure(torch_style) == ("<class 'ValueError'>: You must specify exactly one of input_ids or "
                                           "inputs_embeds")
    assert export_failure(RuntimeError("plain\nmore")) == "plain"


def test_export_refuses_a_folder_that_is_no_model_and_writes_nothing(tmp_path):
    from collab_convert.cli import main

    (tmp_path / "empty").mkdir()
    code = main(["export", str(tmp_path / "empty"), "-o", str(tmp_path / "onnx")])
    assert code == 3
    assert not (tmp_path / "onnx").exists()


def test_an_onnx_file_name_is_refused_naming_the_folder_to_give(tiny_bert, tmp_path, capsys):
    from collab_convert.cli import main

    capsys.readouterr()
    code = main(["export", str(tiny_bert), "-o", str(tmp_path / "model.onnx")])
    err = capsys.readouterr().err
    assert code == 3 and "-o model-onnx" in err and err.count("\n") == 1
    assert not (tmp_path / "model.onnx").exists()
