"""MPNet adds a relative position bias to its scores: refinement's target is the attention the model computes."""

import torch

from collab_convert.architectures.source import open_model
from collab_convert.decompose.refinement import _original_attention
from collab_convert.integration import capture
from collab_convert.integration.capture import collect_statistics

from fixtures import SENTENCES
from fixtures.models import CharacterTokenizer, build_family, family_case

TEXT = "the cat sat on the warm mat."  # within the tiny model's 40 positions


def test_refinement_target_is_the_models_own_attention(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "_tokenizer", lambda folder: CharacterTokenizer())
    model = build_family(family_case("mpnet"), tmp_path / "mpnet")
    source = open_model(str(tmp_path / "mpnet"))
    try:
        layers = source.layers
        statistics, _ = collect_statistics(source.folder, source.family, [layer.prefix for layer in layers], [TEXT],
                                           max_length=64, keep_samples=1, scratch=tmp_path / "scratch")
        projections = source.read_projections(layers[1])
    finally:
        source.close()
    layer = statistics[layers[1].prefix]
    assert layer.position_bias is not None and layer.position_bias.shape[-1] == len(TEXT)

    batch = _original_attention(layer.query_samples, layer.key_samples, projections.query_weight,
                                projections.query_bias, projections.key_weight, layers[1].shape.num_heads,
                                layers[1].shape.head_dim ** -0.5, False, layer.position_bias)[0]
    ids = torch.tensor([CharacterTokenizer()([TEXT], max_length=64)["input_ids"][0]])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=ids, output_attentions=True).attentions[1]
    assert torch.allclose(batch.target_p, expected, atol=1e-5)
    # without the bias the target would be another attention altogether
    plain = _original_attention(layer.query_samples, layer.key_samples, projections.query_weight,
                                projections.query_bias, projections.key_weight, layers[1].shape.num_heads,
                                layers[1].shape.head_dim ** -0.5, False)[0]
    assert not torch.allclose(plain.target_p, expected, atol=1e-3)


def test_mpnet_is_refined_never_worse_on_held_out_sequences(tmp_path, monkeypatch):
    from collab_convert import CompressOptions, compress

    monkeypatch.setattr(capture, "_tokenizer", lambda folder: CharacterTokenizer())
    build_family(family_case("mpnet"), tmp_path / "mpnet")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES[:24]) + "\n")
    monkeypatch.setattr("collab_convert.predict.can_measure", lambda source: False)  # no real tokenizer here
    result = compress(str(tmp_path / "mpnet"), CompressOptions(rank=8, output=tmp_path / "out", calibration=texts,
                                                               calibration_samples=24, refine_steps=60, plots=False,
                                                               calibration_max_length=30))
    refined = [layer.refinement for layer in result.layers]
    assert all(r is not None for r in refined)
    assert all(r["steps"] > 0 and r["kl_after"] <= r["kl_before"] for r in refined)
    assert result.calibration["refinement"].startswith("Adam on the attention KL")
