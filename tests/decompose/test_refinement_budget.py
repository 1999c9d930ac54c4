"""Refinement steps go where the error is."""

from collab_convert.decompose.refinement import share_steps


def test_steps_follow_each_layers_error():
    steps = share_steps([0.01, 0.02, 0.03, 0.04], total=400)
    assert steps == sorted(steps) and steps[-1] > 2 * steps[0]
    assert abs(sum(steps) - 400) <= 4


def test_equal_errors_share_evenly_and_no_error_takes_nothing():
    assert share_steps([0.2, 0.2, 0.2], total=300) == [100, 100, 100]
    assert share_steps([0.0, 0.5], total=200)[0] == 0


def test_one_bad_layer_cannot_take_every_step():
    steps = share_steps([1.0, 1e-3, 1e-3, 1e-3], total=400, most=3.0)
    assert steps[0] == 300  # three times the even share at most
    assert all(s >= 20 for s in steps[1:])  # every layer with an error gets at least one held-out check
