"""The shared-key refinement moves the weights that read the keys (and a value latent's down-projection, which reads
the values) in coordinates preconditioned by those inputs' second moment: the same function in other coordinates,
so what comes back is the layer's own weights, and badly conditioned inputs are what it is for."""

import pytest
import torch

from collab_convert.decompose.preconditioning import InputPreconditioner, second_moment
from collab_convert.decompose.shared_key import slot_frequencies
from collab_convert.decompose.shared_key_batches import StackedSequences
from collab_convert.decompose.shared_key_refinement import LayerToRefine, refine_shared_key, refine_shared_keys
from collab_convert.decompose.value_latent import fit_value_latent, output_metric, value_moment
from fixtures.attention_samples import GEOMETRY, layer_with_samples

LENGTHS = (24, 17, 24, 9, 24, 24, 20, 24, 24, 13, 22, 24)


def badly_conditioned_inputs(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(500, 16, generator=generator) * torch.logspace(-2, 1, 16)


def test_the_moved_coordinates_read_back_to_the_same_weight():
    inputs = badly_conditioned_inputs()
    conditioner = InputPreconditioner.of(second_moment([inputs]))
    weight = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    moved = conditioner.moved(weight)
    assert torch.allclose(conditioner.readable(moved), weight, atol=1e-4)
    assert not torch.allclose(moved, weight, atol=1e-2)  # other coordinates


def test_the_quarter_power_takes_the_square_root_of_the_inputs_condition():
    """x S^(-1/4) has the second moment S^(1/2): its eigenvalues spread as the square roots of the inputs' (the ridge
    aside)."""
    inputs = badly_conditioned_inputs()
    moment = second_moment([inputs]).double()
    conditioner = InputPreconditioner.of(moment, ridge=0.0)
    spread = torch.linalg.eigvalsh(moment)
    seen = torch.linalg.eigvalsh(second_moment([inputs @ conditioner.reading]).double())
    assert float(spread[-1] / spread[0]) > 1e5
    assert float(seen[-1] / seen[0]) == pytest.approx(float(spread[-1] / spread[0]) ** 0.5, rel=0.2)


def test_a_power_of_zero_leaves_the_coordinates_as_they_are():
    conditioner = InputPreconditioner.of(second_moment([badly_conditioned_inputs()]), power=0.0)
    assert torch.allclose(conditioner.reading, torch.eye(16), atol=1e-5)


def test_the_second_moment_counts_every_row_of_every_sequence():
    generator = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, 2, 8, generator=generator).half() for n in (5, 9, 3)]
    flat = torch.cat([p.float().reshape(len(p), 16) for p in parts])
    assert torch.allclose(second_moment(parts), flat.T @ flat / len(flat), atol=1e-6)


def badly_conditioned_layer():
    """Keys whose dimensions' scales span 300x, over 24 sequences (the last two held out)."""
    order = torch.randperm(16, generator=torch.Generator().manual_seed(105))
    scales = (torch.logspace(-1.5, 1, 16)[order] * 3).view(2, 8)
    samples, _, factors, setting, _ = layer_with_samples(5, recorded=True, lengths=LENGTHS * 2, key_scales=scales)
    return samples, factors, setting


def test_the_steps_move_the_key_mixing_in_the_keys_preconditioned_coordinates(monkeypatch):
    from collab_convert.decompose import shared_key_refinement

    samples, factors, setting = badly_conditioned_layer()
    started = []
    adam = shared_key_refinement.adam_with_held_out_groups
    monkeypatch.setattr(shared_key_refinement, "adam_with_held_out_groups",
                        lambda groups, *rest, **named: started.append([t.detach().clone() for t in groups[0]])
                        or adam(groups, *rest, **named))
    refine_shared_key(samples, factors, GEOMETRY, setting, steps=5)
    training = [sample.keys for sample in samples[:-2]]  # a tenth held out: 2 of 24
    expected = InputPreconditioner.of(second_moment(training)).moved(factors.key_mixing.float())
    assert torch.allclose(started[0][0], expected, atol=1e-5)
    assert torch.equal(started[0][1], factors.query_core.float())  # the cores read no inputs: left as they are

    # a value latent's down-projection reads the values: moved by theirs
    started.clear()
    samples, factors, setting = badly_conditioned_layer()
    moment = sum(value_moment(sample.values.float()) for sample in samples)
    latent = fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY), 8, 2)
    refine_shared_keys([LayerToRefine(samples, factors, GEOMETRY, setting, latent)], steps=5)
    expected = InputPreconditioner.of(second_moment([sample.values for sample in samples[:-2]])).moved(
        latent.down.float())
    assert torch.allclose(started[0][3], expected, atol=1e-5)


def test_the_refined_factors_are_the_layers_own_not_the_moved_coordinates():
    samples, factors, setting = badly_conditioned_layer()
    result = refine_shared_key(samples, factors, GEOMETRY, setting, steps=120)
    assert result.loss_after < result.loss_before
    held_out = StackedSequences(samples[-2:], GEOMETRY, setting, slot_frequencies(result.factors.ranks)).problems()
    state = [t.float() for t in (result.factors.key_mixing, result.factors.query_core, result.factors.pass_core)]
    losses = [problem.loss(*state) for problem in held_out]
    assert float(sum(loss for loss, _ in losses)) / sum(norm for _, norm in losses) == pytest.approx(
        result.loss_after, rel=1e-3)
