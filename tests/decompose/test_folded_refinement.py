"""Layers refined in the same steps (their batches side by side, their losses summed) end where each would alone:
each layer's gradient is its own, its draws are the ones it would take alone, and a layer with fewer key slots than
another takes zero slots that stay zero."""

from types import SimpleNamespace

import pytest
import torch

from collab_convert.decompose import shared_key_refinement
from collab_convert.decompose.shared_key import KeyRanks
from collab_convert.decompose.shared_key_refinement import LayerToRefine, foldable, refine_shared_keys
from collab_convert.decompose.value_latent import fit_value_latent, output_metric
from collab_convert.streaming import FoldedFits
from fixtures.attention_samples import GEOMETRY, layer_with_samples

LENGTHS = (24, 17, 24, 9, 24, 24, 20, 24, 24, 13, 22, 24)


def layer(seed: int, ranks: KeyRanks, lengths=LENGTHS, values: bool = False) -> LayerToRefine:
    """A small random layer (fixtures.attention_samples) with its calibration samples, which carry their attention
    output as the calibration pass records it, and its shared key fitted at `ranks`."""
    samples, _, factors, setting, moment = layer_with_samples(seed, recorded=True, lengths=lengths, ranks=ranks)
    latent = fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY), 8, 2) if values else None
    return LayerToRefine(samples, factors, GEOMETRY, setting, latent)


@pytest.fixture
def float32_steps(monkeypatch):
    """Steps in float32 wherever the CPU would take bfloat16: so alone and together differ only by rounding."""
    monkeypatch.setattr(shared_key_refinement, "training_products", lambda device: torch.float32)


def each_alone(layers, **settings):
    return [refine_shared_keys([one], **settings)[0] for one in layers]


def test_layers_refined_in_the_same_steps_end_where_each_alone_would(float32_steps):
    # three layers of different widths: the narrower two take zero slots up to the widest's
    ranks = [KeyRanks((1, 1, 1, 1), 0), KeyRanks((2, 1, 0, 1), 0), KeyRanks((2, 2, 1, 1), 0)]
    settings = {"steps": 60, "batch_sequences": 4, "query_rows": 8}
    layers = [layer(seed, r) for seed, r in enumerate(ranks)]
    assert foldable(layers)
    together = refine_shared_keys(layers, **settings)
    alone = each_alone([layer(seed, r) for seed, r in enumerate(ranks)], **settings)
    assert any(one.loss_after < one.loss_before for one in together)
    for one, other, own in zip(together, alone, ranks, strict=True):
        assert one.factors.ranks == own and one.factors.key_mixing.shape == other.factors.key_mixing.shape
        assert one.steps == other.steps and one.loss_after <= one.loss_before
        assert one.loss_after == pytest.approx(other.loss_after, rel=1e-4)
        assert one.kl_after == pytest.approx(other.kl_after, rel=1e-4)
        for got, expected in ((one.factors.key_mixing, other.factors.key_mixing),
                              (one.factors.query_core, other.factors.query_core)):
            assert torch.allclose(got, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()))


def test_a_key_and_value_latent_refined_with_another_layers_end_as_alone(float32_steps):
    settings = {"steps": 40, "batch_sequences": 4, "query_rows": 8}
    ranks = KeyRanks((1, 1, 1, 1), 0)
    together = refine_shared_keys([layer(seed, ranks, values=True) for seed in (5, 6)], **settings)
    alone = each_alone([layer(seed, ranks, values=True) for seed in (5, 6)], **settings)
    for one, other in zip(together, alone, strict=True):
        assert one.objective == "attention output" and one.values.up.shape == other.values.up.shape == (4, 8, 8)
        assert one.loss_after == pytest.approx(other.loss_after, rel=1e-4)
        assert torch.allclose(one.values.down, other.values.down, rtol=1e-3,
                              atol=1e-4 * float(other.values.down.abs().max()))


def test_layers_whose_sequences_differ_are_refined_one_at_a_time():
    ranks = KeyRanks((1, 1, 1, 1), 0)
    settings = {"steps": 20, "batch_sequences": 4, "query_rows": 8}
    shorter = LENGTHS[:-1] + (11,)
    assert not foldable([layer(0, ranks), layer(1, ranks, shorter)])
    together = refine_shared_keys([layer(0, ranks), layer(1, ranks, shorter)], **settings)
    alone = each_alone([layer(0, ranks), layer(1, ranks, shorter)], **settings)
    assert [r.loss_after for r in together] == [r.loss_after for r in alone]  # the same computation: bit for bit


def test_folded_fits_refine_up_to_the_group_size_and_hand_each_layer_its_own_result():
    """Asked for the first layer of a group, the fitter starts the next ones in order, refines the group in one
    call and keeps the others' results until the writer asks; a layer that is not refined is fitted alone."""
    layers = [SimpleNamespace(prefix=f"h.{i}") for i in range(6)]
    calls = []

    def start(member, announce):
        calls.append(("start", member.prefix))
        return {"prefix": member.prefix, "refine": member.prefix != "h.2"}

    def together(states, announce):
        announce("refining")
        calls.append(("together", [state["prefix"] for state in states]))
        return states

    fits = FoldedFits(layers, start, together, lambda member, state: (member.prefix, state["prefix"]),
                      joins=lambda state: state["refine"], size=3,
                      labels={m.prefix: f"layer {i + 1}/6" for i, m in enumerate(layers)})
    shown = []
    results = [fits(member, lambda stage, done, total: shown.append(stage)) for member in layers]
    assert results == [(m.prefix, m.prefix) for m in layers]
    assert [c for c in calls if c[0] == "together"] == [("together", ["h.0", "h.1", "h.3"]),
                                                         ("together", ["h.4", "h.5"])]
    assert sum(c[0] == "start" for c in calls) == 6  # every layer started once
    assert any("layers 1-4/6" in stage for stage in shown) and any("layers 5-6/6" in stage for stage in shown)
