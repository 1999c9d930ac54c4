"""The value latent of the multi-query form: exact at full width, the best output-weighted subspace below it, and
refined together with the shared key against the attention output, never worse on held-out sequences."""

import pytest
import torch

from collab_convert.decompose.shared_key import KeyRanks, fit_shared_key
from collab_convert.decompose.shared_key import slot_frequencies
from collab_convert.decompose.shared_key_batches import StackedSequences
from collab_convert.decompose.shared_key_refinement import attention_output_errors, refine_shared_key
from collab_convert.decompose.value_latent import (
    fit_value_latent,
    head_up_projections,
    output_metric,
    value_moment,
    value_spectrum,
)
from fixtures.attention_samples import GEOMETRY, layer_with_samples



def values_and_output(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(16, 16, generator=generator) * torch.logspace(0, -2, 16)  # a few strong directions
    values = (torch.randn(400, 16, generator=generator) @ mixing).reshape(400, 2, 8)
    return values, torch.randn(32, 32, generator=generator)


def test_every_value_is_the_latent_read_back_at_full_width():
    values, output = values_and_output()
    latent = fit_value_latent(value_moment(values), output_metric(output, GEOMETRY), 16, 2)
    stacked = values.reshape(400, -1).double()
    read_back = torch.einsum("gdw,nw->ngd", latent.up, stacked @ latent.down.T).reshape(400, -1)
    assert torch.allclose(read_back, stacked, atol=1e-10) and latent.lost_energy == 0.0
    assert torch.allclose(latent.down.norm(dim=1), torch.ones(16, dtype=torch.float64))  # the values' own scale


def test_the_output_metric_decides_which_directions_stay():
    values, output = values_and_output()
    moment = value_moment(values)
    spectrum = value_spectrum(moment, output_metric(output, GEOMETRY))
    assert abs(fit_value_latent(moment, output_metric(output, GEOMETRY), 8, 2).lost_energy
               - float(spectrum[8:].sum() / spectrum.sum())) < 1e-9
    # every head of a group reads the same token's value here: its errors add up before the output does
    half = fit_value_latent(moment, output_metric(output, GEOMETRY, summed=True), 8, 2)

    def output_error(latent):
        stacked = values.reshape(400, -1).double()
        read = torch.einsum("gdw,nw->ngd", latent.up, stacked @ latent.down.T).reshape(400, -1)
        error = (read - stacked).reshape(400, 2, 8)[:, GEOMETRY.group_of_head]  # each head reads its group
        return float((torch.einsum("nhd,ohd->no", error, output.double().reshape(32, 4, 8)) ** 2).sum())

    unweighted = fit_value_latent(moment, torch.eye(16, dtype=torch.float64), 8, 2)
    assert output_error(half) < output_error(unweighted)


def test_refining_the_key_and_values_together_never_loses_on_held_out_sequences():
    samples, statistics, factors, setting, moment = layer_with_samples(lengths=(24,) * 20)
    latent = fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY), 8, 2)
    full_key = fit_shared_key(statistics, GEOMETRY, KeyRanks((2, 2, 2, 2), 0))
    full_values = fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY), 16, 2)
    assert attention_output_errors(samples, full_key, GEOMETRY, setting, [full_values])[0] < 1e-6  # exact, full width
    assert attention_output_errors(samples, factors, GEOMETRY, setting, [latent])[0] > 1e-3
    refined = refine_shared_key(samples, factors, GEOMETRY, setting, steps=60, values=latent)
    assert refined.objective == "attention output" and refined.loss_after <= refined.loss_before
    assert refined.values.up.shape == (4, 8, 8)  # one up-projection per head once refined
    assert head_up_projections(latent, GEOMETRY.group_of_head).shape == (4, 8, 8)


def _each_alone(samples, factors, setting, latent) -> float:
    """A candidate's output error as a batch's own loss gives it, one problem at a time."""
    slots = slot_frequencies(factors.ranks)
    start = [factors.key_mixing.float(), factors.query_core.float(), factors.pass_core.float()]
    if latent is not None:
        start += [latent.down.float(), latent.up[GEOMETRY.group_of_head].float()]
    total, energy = 0.0, 0.0
    for problem in StackedSequences(samples, GEOMETRY, setting, slots).each_problem():
        loss, norm = problem.loss(*start)
        total, energy = total + float(loss), energy + norm
    return total / energy


def test_candidate_value_latents_scored_together_score_as_each_alone():
    samples, _, factors, setting, moment = layer_with_samples()
    candidates = [None, fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY), 8, 2),
                  fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY, summed=True), 4, 2)]
    together = attention_output_errors(samples, factors, GEOMETRY, setting, candidates)
    alone = [_each_alone(samples, factors, setting, latent) for latent in candidates]
    assert together == pytest.approx(alone, rel=1e-6)
    assert together[0] < together[1] < together[2]  # narrower latents lose more of the output


def test_candidates_are_scored_against_the_outputs_the_calibration_pass_recorded():
    samples, _, factors, setting, moment = layer_with_samples(recorded=True)
    latent = fit_value_latent(moment, output_metric(setting.output_weight, GEOMETRY), 8, 2)
    recorded = attention_output_errors(samples, factors, GEOMETRY, setting, [latent])[0]
    assert recorded == pytest.approx(_each_alone(samples, factors, setting, latent), rel=1e-2)  # float16 targets
    for sample in samples:  # other recorded outputs: the score follows them rather than computing its own
        sample.target_output = sample.target_output * 2
    shifted = attention_output_errors(samples, factors, GEOMETRY, setting, [latent])[0]
    assert abs(shifted - recorded) > 0.1 * recorded


def test_each_head_reads_the_latent_through_its_own_up_projection():
    samples, _, factors, setting, _ = layer_with_samples(recorded=True)
    problem = StackedSequences(samples, GEOMETRY, setting, slot_frequencies(factors.ranks), targets=True).problem(
        torch.arange(len(samples)))
    generator = torch.Generator().manual_seed(5)
    probabilities = torch.softmax(torch.randn(problem.target_output.shape[0], 4, problem.target_output.shape[1], 24,
                                              generator=generator), dim=-1)
    down = torch.randn(6, 16, generator=generator)
    up = torch.randn(4, 8, 6, generator=generator)  # every head its own
    latent = problem.stacked_values.float() @ down.T  # (B, m, W); the values wait in the record's float16
    heads = [probabilities[:, head] @ latent @ up[head].T for head in range(4)]  # each head alone: (B, rows, d)
    written_out = torch.cat(heads, -1) @ setting.output_weight.T
    expected = ((written_out - problem.target_output) ** 2).sum(-1)[problem.rows].sum()
    assert float(problem.output_error(probabilities, down, up)) == pytest.approx(float(expected), rel=1e-5)
