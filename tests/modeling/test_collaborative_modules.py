"""Compressed checkpoints load through transformers and behave like the original."""

import json

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, BertModel

import collab_convert
from collab_convert import CompressOptions, compress, load_model
from fixtures.models import save_tiny

FULL_RANK = 48  # 4 heads x 12


def outputs(model, batch):
    with torch.no_grad():
        return model(**batch).last_hidden_state


def masked(hidden, batch):
    # Padded positions are free to differ; every real token must match.
    return hidden[batch["attention_mask"].bool()]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_full_rank_reproduces_the_original(tiny_bert, tmp_path, token_batch, implementation):
    compress(str(tiny_bert), CompressOptions(rank=FULL_RANK, output=tmp_path / "out"))
    original = AutoModel.from_pretrained(tiny_bert, attn_implementation=implementation).eval()
    collaborative = AutoModel.from_pretrained(tmp_path / "out", attn_implementation=implementation).eval()
    assert type(collaborative.encoder.layer[0].attention.self).__name__ == "CollaborativeBertSelfAttention"
    a, b = masked(outputs(original, token_batch), token_batch), masked(outputs(collaborative, token_batch), token_batch)
    assert (a - b).abs().max() / a.abs().max() < 1e-5


def test_eager_and_sdpa_agree_on_the_collaborative_model(tiny_bert, tmp_path, token_batch):
    compress(str(tiny_bert), CompressOptions(rank=20, output=tmp_path / "out"))
    eager = AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    sdpa = AutoModel.from_pretrained(tmp_path / "out", attn_implementation="sdpa").eval()
    a, b = masked(outputs(eager, token_batch), token_batch), masked(outputs(sdpa, token_batch), token_batch)
    assert torch.allclose(a, b, atol=1e-5)


def test_attention_weights_are_returned_like_the_original(tiny_bert, tmp_path, token_batch):
    compress(str(tiny_bert), CompressOptions(rank=FULL_RANK, output=tmp_path / "out"))
    original = AutoModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    collaborative = AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        a = original(**token_batch, output_attentions=True).attentions
        b = collaborative(**token_batch, output_attentions=True).attentions
    assert len(a) == len(b) == 2
    assert a[0].shape == b[0].shape
    assert torch.allclose(a[1], b[1], atol=1e-5)


def test_half_rank_loads_and_runs(tiny_bert, tmp_path, token_batch):
    result = compress(str(tiny_bert), CompressOptions(rank=FULL_RANK // 2, output=tmp_path / "out"))
    model = load_model(tmp_path / "out").eval()
    hidden = outputs(model, token_batch)
    assert torch.isfinite(hidden).all()
    assert all(0 < layer.relative_error < 1 for layer in result.layers)
    assert result.parameters_after < result.parameters_before
    state = model.state_dict()
    assert state["encoder.layer.0.attention.self.shared_query.weight"].shape == (24, 48)
    assert state["encoder.layer.0.attention.self.mixing"].shape == (4, 24)
    assert "encoder.layer.0.attention.self.query.weight" not in state


def test_task_heads_load_with_their_auto_classes(tmp_path, token_batch):
    source = save_tiny(tmp_path / "mlm", "BertForMaskedLM")
    compress(str(source), CompressOptions(rank=FULL_RANK, output=tmp_path / "out"))
    original = AutoModelForMaskedLM.from_pretrained(source).eval()
    collaborative = AutoModelForMaskedLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        a, b = original(**token_batch).logits, collaborative(**token_batch).logits
    assert (a - b).abs().max() < 1e-4
    # The base model inside a task checkpoint ("bert." prefix) loads too, and so does a new task head.
    base = AutoModel.from_pretrained(tmp_path / "out")
    assert isinstance(base, BertModel)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", num_labels=3)
    assert classifier(**token_batch).logits.shape == (3, 3)
    assert isinstance(load_model(tmp_path / "out"), type(original))


def test_a_new_task_head_swapped_in_keeps_the_collaborative_attention(tmp_path, token_batch):
    """A fine-tuning script's habit: a classifier of another label count over the checkpoint, with
    ignore_mismatched_sizes=True. With collab_convert imported only the head is new; the attention stays ours
    (without it, transformers would re-initialise the guarded projections too: docs/format.md)."""
    source = save_tiny(tmp_path / "classifier", "BertForSequenceClassification")
    compress(str(source), CompressOptions(rank=20, output=tmp_path / "out"))
    ours = load_model(tmp_path / "out").eval()
    swapped = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", num_labels=5,
                                                                 ignore_mismatched_sizes=True).eval()
    assert swapped.classifier.out_features == 5 and ours.classifier.out_features == 2
    assert torch.equal(outputs(swapped.bert, token_batch), outputs(ours.bert, token_batch))


def test_a_loaded_collaborative_model_saves_and_reloads(tiny_bert, tmp_path, token_batch):
    compress(str(tiny_bert), CompressOptions(rank=20, output=tmp_path / "out"))
    model = load_model(tmp_path / "out").eval()
    model.save_pretrained(tmp_path / "again")
    again = load_model(tmp_path / "again").eval()
    assert torch.equal(outputs(model, token_batch), outputs(again, token_batch))
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "collaborative"


def test_half_precision_checkpoints_stay_half_precision(tmp_path, token_batch):
    source = tmp_path / "fp16"
    save_tiny(source)
    model = BertModel.from_pretrained(source, dtype=torch.float16)
    model.save_pretrained(source)
    compress(str(source), CompressOptions(rank=FULL_RANK, output=tmp_path / "out"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("encoder.layer.0.attention.self.shared_query.weight").dtype == torch.float16
        assert f.get_tensor("encoder.layer.0.attention.self.value.weight").dtype == torch.float16


def test_importing_twice_keeps_registration_working():
    import importlib

    importlib.reload(collab_convert.integration.loading)
    collab_convert.integration.loading.register()
    collab_convert.integration.loading.register()
