"""Calibrated CP fits weigh each head by how far its attention moves the layer's output: the weights, the fit
and the refinement's KL that use them, and the family data that finds each head's value and output weights."""

import json

import pytest
import torch

from collab_convert import CompressOptions, compress
from collab_convert.architectures.source import open_model
from collab_convert.decompose.als import fit_collaborative
from collab_convert.decompose.calibrated import HEAD_WEIGHT_FLOOR, InputMetric, fit_calibrated, head_weights
from collab_convert.decompose.products import HeadProducts, content_bias
from collab_convert.decompose.refinement import AttentionTarget
from fixtures.models import FAMILY_CASES, build_family


def test_a_head_with_twice_the_output_weighs_twice_as_much_and_a_silent_head_keeps_the_floor():
    g = torch.Generator().manual_seed(0)
    value = torch.randn(8, 16, generator=g, dtype=torch.float64)
    output = torch.randn(16, 8, generator=g, dtype=torch.float64)
    outputs = torch.stack([2 * output, output, output, 0 * output])  # head 3 writes nothing
    weights = head_weights(value.expand(4, 8, 16), outputs, torch.eye(16, dtype=torch.float64))
    assert weights.mean() == pytest.approx(1.0)
    assert float(weights[0] / weights[1]) == pytest.approx(2.0)  # the square root of 4x the output energy
    assert weights[1] == pytest.approx(float(weights[2]))
    assert float(weights[3] / weights[1]) == pytest.approx(HEAD_WEIGHT_FLOOR / float((1 / 1.5) ** 0.5))


def test_the_weights_follow_each_heads_output_energy_over_the_spread_of_the_keys_inputs():
    g = torch.Generator().manual_seed(1)
    values, outputs = torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    directions = torch.randn(16, 3, generator=g)
    covariance = directions @ directions.T
    weights = head_weights(values, outputs, covariance)
    energy = [float(torch.linalg.matrix_norm(outputs[i] @ values[i] @ directions) ** 2) for i in range(4)]
    expected = torch.tensor(energy, dtype=torch.float64) / (sum(energy) / 4)
    expected = expected.sqrt().clamp_min(HEAD_WEIGHT_FLOOR)
    assert torch.allclose(weights, expected / expected.mean(), atol=1e-6)


def _metric(samples):
    centred = samples - samples.mean(0)
    return InputMetric(centred.T @ centred / samples.shape[0], samples.mean(0))


def _head_logit_errors(products, factors, x, y):
    exact = torch.einsum("nq,hdq,hdk,mk->hnm", x, products.query_heads, products.key_heads, y)
    approx = torch.einsum("nq,qr,hr,kr,mk->hnm", x, factors.shared_query, factors.mixing, factors.shared_key, y)
    difference = exact - approx
    difference = difference - difference.mean(-1, keepdim=True)
    return difference.flatten(1).norm(dim=1)


def test_a_weighted_fit_spends_its_rank_on_the_heavy_head_and_stays_exact_at_full_rank():
    g = torch.Generator().manual_seed(2)
    products = HeadProducts.from_projections(torch.randn(24, 24, generator=g, dtype=torch.float64),
                                             torch.randn(24, 24, generator=g, dtype=torch.float64), 4)
    x = torch.randn(300, 24, generator=g, dtype=torch.float64)
    heavy = torch.tensor([3.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    plain, _ = fit_calibrated(products, 8, _metric(x), _metric(x))
    weighted, _ = fit_calibrated(products, 8, _metric(x), _metric(x), weights=heavy)
    assert _head_logit_errors(products, weighted.factors, x, x)[0] < 0.8 * _head_logit_errors(
        products, plain.factors, x, x)[0]
    full, correction = fit_calibrated(products, 24, _metric(x), _metric(x), weights=heavy)
    assert torch.allclose(full.factors.dense(), products.dense(), atol=1e-6)
    assert correction.abs().max() < 1e-6


def test_each_head_weighed_alone_and_averaged_gives_the_unweighted_kl():
    g = torch.Generator().manual_seed(3)
    heads, d_in = 4, 16
    wq, wk, bq = torch.randn(16, d_in, generator=g), torch.randn(16, d_in, generator=g), torch.randn(16, generator=g)
    sequences = [torch.randn(int(n), d_in, generator=g) for n in torch.randint(3, 12, (30,), generator=g)]
    start = fit_collaborative(HeadProducts.from_projections(wq, wk, heads), 5).factors
    parameters = (start.shared_query, start.shared_key, start.mixing, content_bias(wk, bq, heads))

    def held_out(weights):
        return AttentionTarget(sequences, sequences, wq, bq, wk, heads, 0.5, head_weights=weights).held_out_kl(
            parameters)

    alone = [held_out(heads * torch.eye(heads)[h]) for h in range(heads)]
    assert sum(alone) / heads == pytest.approx(held_out(None), rel=1e-5)
    assert held_out(torch.ones(heads)) == pytest.approx(held_out(None), rel=1e-6)
    assert len(set(round(a, 6) for a in alone)) == heads  # the heads do differ: the check is not vacuous


@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: c.name)
def test_every_family_names_each_heads_value_and_output_weights(case, tmp_path):
    build_family(case, tmp_path / "model")
    source = open_model(str(tmp_path / "model"), "collaborative")
    try:
        for layer in source.layers:
            found = source.read_head_outputs(layer)
            assert found is not None, f"{case.name}: no value/output projections found for {layer.prefix}"
            assert found.value_heads.shape[:2] == (layer.shape.num_heads, layer.shape.head_dim)
            assert found.output_heads.shape[0] == layer.shape.num_heads
            assert found.output_heads.shape[2] == layer.shape.head_dim
    finally:
        source.close()


@pytest.mark.parametrize("names", [{"output": "../output.missing"}, {"value": "missing"},
                                   {"value": "../output.LayerNorm"}, {"output": None}],
                         ids=["no output weight", "no value weight", "a value that is no Linear", "none named"])
def test_a_layer_whose_value_or_output_weights_are_not_found_weighs_its_heads_alike(names, tmp_path):
    import dataclasses

    build_family(next(c for c in FAMILY_CASES if c.name == "bert"), tmp_path / "model")
    source = open_model(str(tmp_path / "model"), "collaborative")
    try:
        assert source.weighs_heads(source.layers[0])  # the family's own names are found
        source.offer = dataclasses.replace(source.offer, layout=dataclasses.replace(source.layout, **names))
        assert not source.weighs_heads(source.layers[0])
        assert source.read_head_outputs(source.layers[0]) is None
    finally:
        source.close()


def _value_to_output(found):
    return sum(found.output_heads[i] @ found.value_heads[i] for i in range(found.value_heads.shape[0]))


def test_bert_reads_its_output_projection_beside_its_self_attention(tmp_path):
    model = build_family(next(c for c in FAMILY_CASES if c.name == "bert"), tmp_path / "model")
    source = open_model(str(tmp_path / "model"), "collaborative")
    attention = model.encoder.layer[1].attention
    expected = attention.output.dense.weight @ attention.self.value.weight
    found = source.read_head_outputs(source.layers[1])
    source.close()
    assert torch.allclose(_value_to_output(found).float(), expected, atol=1e-5)


def test_gpt2_reads_its_values_from_the_fused_projection(tmp_path):
    model = build_family(next(c for c in FAMILY_CASES if c.name == "gpt2"), tmp_path / "model")
    source = open_model(str(tmp_path / "model"), "collaborative")
    attention = model.h[0].attn if hasattr(model, "h") else model.transformer.h[0].attn
    width = attention.c_proj.weight.shape[0]
    expected = attention.c_proj.weight.T @ attention.c_attn.weight.T[2 * width:]  # Conv1D stores (in, out)
    found = source.read_head_outputs(source.layers[0])
    source.close()
    assert torch.allclose(_value_to_output(found).float(), expected, atol=1e-5)


def test_a_calibrated_report_says_the_heads_were_weighed(tiny_bert, calibration_file, tmp_path):
    compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / "out", calibration=calibration_file,
                                             refine_steps=20))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    objective = report["calibration"]["objective"]
    assert "each head's weighted by how far its attention moves the layer's output" in objective


def test_a_calibrated_report_says_how_the_keys_were_weighed(tiny_bert, calibration_file, tmp_path):
    objectives = {}
    for steps in (20, 0):  # sequences kept for refinement weigh the keys by the attention they get; else their spread
        compress(str(tiny_bert), CompressOptions(rank=16, output=tmp_path / f"out{steps}", calibration=calibration_file,
                                                 refine_steps=steps))
        report = json.loads((tmp_path / f"out{steps}" / "report.json").read_text())
        objectives[steps] = report["calibration"]["objective"]
    assert "keys weighed by the original attention they get" in objectives[20]
    assert "keys centred per sequence" in objectives[0]
