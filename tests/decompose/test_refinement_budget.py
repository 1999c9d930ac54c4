"""Refinement steps go where the error is."""

from collab_convert.decompose.held_out_adam import share_steps


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


def test_a_layers_attention_target_is_freed_as_soon_as_it_is_dropped():
    """Every layer's target is built, judged and dropped in turn; a reference cycle would keep each one's held-out
    attention alive until the cyclic collector happened to run, memory that grows with depth."""
    import gc
    import weakref

    import torch

    from collab_convert.decompose.refinement import AttentionTarget

    inputs = [torch.randn(9, 16) for _ in range(12)]
    target = AttentionTarget(inputs, inputs, torch.randn(16, 16), None, torch.randn(16, 16), 4, 0.5, causal=True)
    target.minibatch_kl([torch.randn(16, 8), torch.randn(16, 8), torch.randn(4, 8), torch.randn(4, 16)],
                        torch.Generator().manual_seed(0), 2, 4)  # the training pool built too
    gone = weakref.ref(target)
    gc.disable()
    try:
        del target
        assert gone() is None
    finally:
        gc.enable()
