"""MPNet and T5 add a relative position bias to their scores: refinement's target is the attention the model
computes, and both families are refined."""

import pytest
import torch

from collab_convert.architectures.source import open_model
from collab_convert.decompose.refinement import _original_attention
from collab_convert.integration import model_runs
from collab_convert.integration.capture import collect_statistics
from collab_convert.forms.collaborative.fitting import score_scale

from fixtures import SENTENCES
from fixtures.models import CharacterTokenizer, build_family, family_case

TEXT = "the cat sat on the warm mat."  # within the tiny models' positions

# (family, attention module, where the model's own attention probabilities of that module are)
CASES = [
    ("mpnet", "encoder.layer.1.attention.attn", ("attentions", 1)),
    # the first layer of each T5 stack computes the bias, the next is handed it; the decoder's is causal
    ("t5", "encoder.block.0.layer.0.SelfAttention", ("encoder_attentions", 0)),
    ("t5", "encoder.block.1.layer.0.SelfAttention", ("encoder_attentions", 1)),
    ("t5", "decoder.block.0.layer.0.SelfAttention", ("decoder_attentions", 0)),
    ("t5", "decoder.block.1.layer.0.SelfAttention", ("decoder_attentions", 1)),
]


def _models_own_attention(model, family: str, where: tuple[str, int]) -> torch.Tensor:
    ids = torch.tensor([CharacterTokenizer()([TEXT], max_length=64)["input_ids"][0]])
    model.set_attn_implementation("eager")
    inputs = {"input_ids": ids} if family == "mpnet" else {"input_ids": ids, "decoder_input_ids": ids}
    with torch.no_grad():
        output = model(**inputs, output_attentions=True)
    return getattr(output, where[0])[where[1]]


@pytest.mark.parametrize("family, module, where", CASES, ids=[case[1] for case in CASES])
def test_refinement_target_is_the_models_own_attention(tmp_path, monkeypatch, family, module, where):
    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    model = build_family(family_case(family), tmp_path / family)
    source = open_model(str(tmp_path / family))
    try:
        layer = next(layer for layer in source.layers if layer.prefix.endswith(module))
        statistics, _ = collect_statistics(source.folder, source.layout, source.family.position_bias, [layer.prefix for layer in source.layers],
                                           [TEXT], max_length=64, keep_samples=1, scratch=tmp_path / "scratch")
        projections = source.read_projections(layer)
    finally:
        source.close()
    metric = statistics[layer.prefix]
    assert metric.position_bias is not None and metric.position_bias.shape[-1] == len(TEXT)

    def target(position_bias):
        return next(_original_attention(metric.query_samples, metric.key_samples, projections.query_weight,
                                   projections.query_bias, projections.key_weight, layer.shape.num_heads,
                                   score_scale(layer, metric), layer.causal, position_bias)).target_p

    expected = _models_own_attention(model, family, where)
    error = (target(metric.position_bias) - expected).abs().max()
    without_bias = (target(None) - expected).abs().max()
    assert error < 5e-4  # refinement samples are kept in float16: equal to that rounding
    assert error < without_bias / 4  # without the bias the target would be another attention altogether


@pytest.mark.parametrize("family", ["mpnet", "t5"])
def test_relative_bias_families_are_refined_never_worse_on_held_out_sequences(tmp_path, monkeypatch, family):
    from collab_convert import CompressOptions, compress

    monkeypatch.setattr(model_runs, "calibration_tokenizer", lambda folder: CharacterTokenizer())
    build_family(family_case(family), tmp_path / family)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES[:24]) + "\n")
    monkeypatch.setattr("collab_convert.predict.can_measure", lambda source: False)  # no real tokenizer here
    result = compress(str(tmp_path / family), CompressOptions(rank=8, output=tmp_path / "out", calibration=texts,
                                                              calibration_samples=24, refine_steps=60, plots=False,
                                                              calibration_max_length=30))
    refined = [layer.refinement for layer in result.layers]
    assert all(r is not None for r in refined)
    assert all(r["steps"] > 0 and r["kl_after"] <= r["kl_before"] for r in refined)
    assert result.calibration["refinement"].startswith("Adam on the attention KL")
