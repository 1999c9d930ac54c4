"""The refinements' loop: Adam on minibatches, the average of its steps checked on held-out data, never worse than
the start there."""

import torch

from collab_convert.decompose.held_out_adam import adam_with_held_out


def _noisy_quadratic(seed: int):
    """(parameters, a minibatch loss whose minimum jitters around the target, the held-out loss: the distance to
    the target)."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(64, generator=generator)
    parameters = [torch.ones(64, requires_grad=True)]  # Adam steps by a share of the typical entry: not 0

    def minibatch_loss():
        return ((parameters[0] - target - 0.5 * torch.randn(64, generator=generator)) ** 2).sum()

    def held_out_loss():
        return float(((parameters[0].detach() - target) ** 2).sum())

    return parameters, minibatch_loss, held_out_loss


def test_the_average_of_noisy_steps_is_nearer_the_minimum_than_the_last_step():
    kept = {}
    for averaging in (0.0, 0.97):
        parameters, minibatch_loss, held_out_loss = _noisy_quadratic(0)
        best, initial, best_loss, taken = adam_with_held_out(parameters, minibatch_loss, held_out_loss, 200, 0.05,
                                                             patience=10, averaging=averaging)
        kept[averaging] = best_loss
        assert taken == 200 and best_loss < initial
    assert float(((best[0] - parameters[0].detach()) ** 2).sum()) > 0  # kept: an average, not the last step
    assert kept[0.97] < 0.5 * kept[0.0]


def test_the_checks_hear_the_average_and_training_continues_from_the_last_step():
    parameters, minibatch_loss, held_out_loss = _noisy_quadratic(1)
    heard, seen = [], []

    def checked():
        seen.append(parameters[0].detach().clone())
        return held_out_loss()

    best, _, best_loss, _ = adam_with_held_out(parameters, minibatch_loss, checked, 40, 0.05,
                                               on_check=lambda step, loss: heard.append((step, loss)))
    assert [step for step, _ in heard] == [20, 40]
    assert best_loss == min(loss for _, loss in heard)
    assert torch.equal(best[0], seen[1 + [loss for _, loss in heard].index(best_loss)])
    assert not torch.equal(parameters[0].detach(), seen[-1])  # the parameters are the last step's again


def test_a_start_no_step_improves_on_is_kept():
    parameters = [torch.zeros(8, requires_grad=True)]
    start = parameters[0].detach().clone()
    best, initial, best_loss, taken = adam_with_held_out(
        parameters, lambda: ((parameters[0] - 1) ** 2).sum(), lambda: float((parameters[0].detach() ** 2).sum()),
        200, 0.1, patience=2)
    assert torch.equal(best[0], start) and best_loss == initial == 0.0
    assert taken == 40  # two checks without a gain


def test_a_warmed_up_rate_rises_linearly_over_the_first_steps_then_stays():
    """On a constant gradient Adam moves each entry by its rate: 1/4, 2/4, 3/4 of it over a 4-step warmup, then
    all of it (the rate is the learning rate times the typical entry: 1 here)."""
    parameters = [torch.ones(4, requires_grad=True)]
    seen = []

    def minibatch_loss():
        seen.append(parameters[0].detach().clone())
        return parameters[0].sum()  # gradient 1 everywhere

    adam_with_held_out(parameters, minibatch_loss, lambda: 0.0, 6, 0.01, averaging=0.0, warmup=4)
    moves = [float(before[0] - after[0]) for before, after in zip(seen, seen[1:] + [parameters[0].detach()])]
    assert [round(move / 0.01, 4) for move in moves] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_a_check_sees_no_gradients_and_keeps_the_best_in_the_tensors_it_started_with():
    """At a check, the parameters, Adam's moments, the average, the best and the last step are held: no
    gradients beside them, and a better average is copied into the best's tensors, not into new ones."""
    import weakref

    parameters, minibatch_loss, held_out_loss = _noisy_quadratic(2)
    gradients, best_tensors = [], []

    def checked():
        gradients.append(parameters[0].grad)
        return held_out_loss()

    clone = torch.Tensor.clone

    def watched_clone(tensor, *args, **kwargs):  # the start's copy is the only best there is
        copy = clone(tensor, *args, **kwargs)
        best_tensors.append(weakref.ref(copy))
        return copy

    torch.Tensor.clone = watched_clone
    try:
        best, initial, best_loss, taken = adam_with_held_out(parameters, minibatch_loss, checked, 100, 0.05)
    finally:
        torch.Tensor.clone = clone
    assert best_loss < initial and taken == 100
    assert gradients[1:] and all(g is None for g in gradients)
    assert best_tensors[0]() is best[0]  # the start's copy, made before the first step, holds the best


def test_only_the_steps_reuse_the_heap_and_what_the_setup_freed_is_handed_back_before_them(monkeypatch):
    """The steps allocate the same working set again and again, so they, and only they, reuse glibc's heap
    (cpu.reused_heap), whose way in hands the heap's free pages back: after the start's held-out loss, before the
    first step, once. The steps' working set then grows from what is live, not on top of the setup's leftovers,
    and the setup's one-time tensors leave no holes in it."""
    import contextlib

    from collab_convert.decompose import held_out_adam

    events = []

    @contextlib.contextmanager
    def recorded_heap(top=0):
        events.append("heap reused")
        yield
        events.append("heap let go")

    monkeypatch.setattr(held_out_adam, "reused_heap", recorded_heap)
    parameters, minibatch_loss, held_out_loss = _noisy_quadratic(3)

    def step_loss():
        events.append("step")
        return minibatch_loss()

    def checked():
        events.append("check")
        return held_out_loss()

    adam_with_held_out(parameters, step_loss, checked, 3, 0.05, check_every=2)
    assert events == ["check", "heap reused", "step", "step", "check", "step", "check", "heap let go"]
