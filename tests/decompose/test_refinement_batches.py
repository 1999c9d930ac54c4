"""A shared-key refinement step gathers its batch from sequences stacked once per layer, with the original
attention's output computed once for every position: what it gathers must be what those sequences say, at the
rows it draws, whatever their lengths."""

from dataclasses import replace

import pytest
import torch

from collab_convert.decompose.rotary_ops import rotate_half_dims
from collab_convert.decompose.shared_key import HeadGeometry, KeyRanks, fit_shared_key, slot_frequencies, statistics_of
from collab_convert.decompose.quadratic_error import QuadraticError, QuadraticTargets
from collab_convert.decompose.shared_key_batches import AttentionSetting, SharedKeySample, StackedSequences

GEOMETRY = HeadGeometry(num_heads=6, kv_heads=2, head_dim=8, rotary_dim=8)
LENGTHS = [24, 13, 20, 9, 24, 17]


def sequences_and_setting(seed: int = 0, output: bool = True):
    generator = torch.Generator().manual_seed(seed)
    samples = [SharedKeySample(*(torch.randn(n, heads, 8, generator=generator).half() for heads in (6, 2, 2)))
               for n in LENGTHS]
    angles = torch.arange(24).float()[:, None] * 0.3 ** torch.arange(4).float()
    setting = AttentionSetting(8 ** -0.5, torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1),
                               output_weight=torch.randn(16, 48, generator=generator) if output else None)
    statistics = sum((statistics_of(s.queries.float(), s.keys.float(), GEOMETRY) for s in samples[1:]),
                     statistics_of(samples[0].queries.float(), samples[0].keys.float(), GEOMETRY))
    factors = fit_shared_key(statistics, GEOMETRY, KeyRanks((1, 1, 1, 1), 0))
    return samples, setting, factors


def rows_of(picks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's query positions as a step's batch takes them: (positions, which are real), both padded to
    the most positions (refinement.drawn_rows)."""
    width = max(len(pick) for pick in picks)
    positions, real = torch.zeros(len(picks), width, dtype=torch.long), torch.zeros(len(picks), width, dtype=bool)
    for i, pick in enumerate(picks):
        positions[i, : len(pick)], real[i, : len(pick)] = pick, True
    return positions, real


def original_output(sample: SharedKeySample, setting: AttentionSetting, rows: torch.Tensor) -> torch.Tensor:
    """The layer's attention output at `rows`, written out head by head from the raw sequence."""
    n = sample.keys.shape[0]
    cos, sin = setting.cos[:n], setting.sin[:n]
    queries = rotate_half_dims(sample.queries.float().transpose(0, 1), cos, sin, 8)  # (H, n, d)
    keys = rotate_half_dims(sample.keys.float().transpose(0, 1), cos, sin, 8)  # (G, n, d)
    heads = []
    for head in range(6):
        group = head // 3
        scores = queries[head] @ keys[group].T * setting.scaling
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ sample.values.float()[:, group])
    return (torch.cat(heads, -1) @ setting.output_weight.T)[rows]


def test_the_stacked_targets_are_each_sequences_own_attention_output_at_the_drawn_rows():
    samples, setting, factors = sequences_and_setting()
    slots = slot_frequencies(factors.ranks)
    stacked = StackedSequences(samples, GEOMETRY, setting, slots, targets=True)
    chosen = torch.tensor([3, 0, 5])
    picks = [torch.tensor([0, 4, 8]), torch.tensor([1, 2, 23]), torch.tensor([16])]
    problem = stacked.problem(chosen, rows_of(picks))
    for i, (sequence, rows) in enumerate(zip(chosen.tolist(), picks)):
        expected = original_output(samples[sequence], setting, rows)
        assert torch.allclose(problem.target_output[i, : len(rows)], expected, atol=1e-4)
    assert problem.rows.tolist() == [[True] * 3, [True] * 3, [True, False, False]]
    assert problem.raw_keys.shape[1] == 24  # keys up to the longest chosen sequence


def test_a_gathered_step_scores_the_shared_form_as_its_sequences_alone_would():
    for output in (True, False):  # the attention output's error, and the attention KL
        samples, setting, factors = sequences_and_setting(seed=1, output=output)
        slots = slot_frequencies(factors.ranks)
        parameters = (factors.key_mixing.float(), factors.query_core.float(), factors.pass_core.float())
        chosen, picks = torch.tensor([4, 1]), [torch.tensor([2, 3, 19]), torch.tensor([0, 12])]
        gathered = StackedSequences(samples, GEOMETRY, setting, slots, targets=True).problem(chosen, rows_of(picks))
        alone = StackedSequences([samples[i] for i in chosen], GEOMETRY, setting, slots).problem(torch.arange(2),
                                                                                          rows_of(picks))
        (loss, norm), (expected, expected_norm) = gathered.loss(*parameters), alone.loss(*parameters)
        assert loss > 0 and torch.isclose(loss, expected, rtol=1e-5) and abs(norm - expected_norm) < 1e-4 * norm


def test_at_full_width_every_gathered_row_is_reproduced():
    samples, setting, _ = sequences_and_setting(seed=2)
    full = fit_shared_key(sum((statistics_of(s.queries.float(), s.keys.float(), GEOMETRY) for s in samples[1:]),
                              statistics_of(samples[0].queries.float(), samples[0].keys.float(), GEOMETRY)),
                          GEOMETRY, KeyRanks.full(GEOMETRY))
    stacked = StackedSequences(samples, GEOMETRY, setting, slot_frequencies(full.ranks), targets=True)
    problem = stacked.problem(torch.tensor([1, 3, 2]), rows_of([torch.tensor([0, 5, 12]), torch.tensor([8]),
                                                                torch.tensor([3, 19])]))
    loss, norm = problem.loss(full.key_mixing.float(), full.query_core.float(), full.pass_core.float())
    assert float(loss) < 1e-8 * norm


def test_queries_may_read_keys_of_another_length():
    # encoder-decoder attention: every query sees all of another sequence's keys, of another length
    samples, setting, factors = sequences_and_setting(seed=3)
    generator = torch.Generator().manual_seed(4)
    crossed = [SharedKeySample(torch.randn(n, 6, 8, generator=generator).half(), s.keys, s.values)
               for n, s in zip([5, 24, 11, 16, 8, 21], samples)]
    setting.causal = False
    stacked = StackedSequences(crossed, GEOMETRY, setting, slot_frequencies(factors.ranks), targets=True)
    problem = stacked.problem(torch.tensor([0, 3]), rows_of([torch.tensor([1, 4]), torch.tensor([0, 15])]))
    for i, (sample, rows) in enumerate(zip([crossed[0], crossed[3]], [torch.tensor([1, 4]), torch.tensor([0, 15])])):
        queries = rotate_half_dims(sample.queries.float().transpose(0, 1), setting.cos[: len(sample.queries)],
                                   setting.sin[: len(sample.queries)], 8)
        m = sample.keys.shape[0]
        keys = rotate_half_dims(sample.keys.float().transpose(0, 1), setting.cos[:m], setting.sin[:m], 8)
        heads = [torch.softmax(queries[h] @ keys[h // 3].T * setting.scaling, -1) @ sample.values.float()[:, h // 3]
                 for h in range(6)]
        expected = (torch.cat(heads, -1) @ setting.output_weight.T)[rows]
        assert torch.allclose(problem.target_output[i], expected, atol=1e-4)
    every = stacked.problems()[0]
    assert every.rows.sum(1).tolist() == [5, 24, 11, 16, 8, 21]  # each sequence's own queries, no more


def test_the_stacked_targets_hold_one_small_problem_at_a_time(monkeypatch):
    """Each problem keeps its original attention (a few MB per sequence), so the targets are computed a few
    sequences at a time, each problem let go before the next is made: with all of SmolLM2's 34 problems alive at
    once, stacking one layer's sequences held hundreds of MB."""
    import gc
    import weakref

    from collab_convert.decompose import shared_key_batches

    samples, setting, factors = sequences_and_setting(seed=5)
    alive, most, sizes = [], [0], []
    made = shared_key_batches.AttentionProblem.__init__

    def counted(self, queries, *args, **kwargs):
        gc.collect()
        alive[:] = [ref for ref in alive if ref() is not None]
        alive.append(weakref.ref(self))
        most[0], sizes[len(sizes):] = max(most[0], len(alive)), [queries.shape[0]]
        made(self, queries, *args, **kwargs)

    monkeypatch.setattr(shared_key_batches.AttentionProblem, "__init__", counted)
    stacked = StackedSequences(samples, GEOMETRY, setting, slot_frequencies(factors.ranks), targets=True)
    assert most[0] <= 2 and max(sizes) <= 2 and sum(sizes) == len(LENGTHS)
    for sequence, sample in enumerate(samples):  # and the targets are every sequence's own output, as before
        rows = torch.arange(sample.queries.shape[0])
        assert torch.allclose(stacked.target_output[sequence, : len(rows)], original_output(sample, setting, rows),
                              atol=1e-4)


def test_steps_in_bfloat16_read_their_operands_kept_in_it_and_score_as_float32_does():
    """With the targets stacked, the keys, values and output projection are only the steps' operands: kept in the
    products' dtype (no conversion at every step), the loss is float32's up to bfloat16 rounding."""
    samples, setting, factors = sequences_and_setting(seed=3)
    slots = slot_frequencies(factors.ranks)
    parameters = (factors.key_mixing.float(), factors.query_core.float(), factors.pass_core.float())
    chosen, picks = torch.tensor([0, 2, 5]), [torch.tensor([1, 7, 20]), torch.tensor([0, 19]), torch.tensor([4])]
    exact = StackedSequences(samples, GEOMETRY, setting, slots, targets=True)
    halved = StackedSequences(samples, GEOMETRY, setting, slots, targets=True, products=torch.bfloat16)
    assert halved.keys.dtype == halved.values.dtype == halved.setting.output_weight.dtype == torch.bfloat16
    assert torch.equal(halved.target_output, exact.target_output)  # computed in float32 before
    (loss, norm) = halved.problem(chosen, rows_of(picks), torch.bfloat16).loss(*parameters)
    (expected, expected_norm) = exact.problem(chosen, rows_of(picks)).loss(*parameters)
    assert norm == expected_norm and abs(float(loss) - float(expected)) < 0.03 * float(expected)


def recorded(samples, setting):
    """The samples with the attention output the calibration pass records beside them (float16, as it keeps them)."""
    for sample in samples:
        sample.target_output = original_output(sample, setting, torch.arange(sample.queries.shape[0])).half()
    return samples


def test_with_recorded_targets_bfloat16_steps_gather_float32_rows_kept_in_the_records_dtype():
    """Where the steps' products round to bfloat16 anyway, the stacked targets and the queries' slot coordinates
    wait in the record's float16 (half of float32's bytes); a step gathers them as float32: the targets exactly as
    recorded, the loss float32's up to bfloat16 rounding."""
    samples, setting, factors = sequences_and_setting(seed=4)
    samples = recorded(samples, setting)
    slots = slot_frequencies(factors.ranks)
    parameters = (factors.key_mixing.float(), factors.query_core.float(), factors.pass_core.float())
    chosen, picks = torch.tensor([1, 3, 4]), [torch.tensor([0, 5, 12]), torch.tensor([2, 8]), torch.tensor([23])]
    exact = StackedSequences(samples, GEOMETRY, setting, slots, targets=True)
    narrow = StackedSequences(samples, GEOMETRY, setting, slots, targets=True, products=torch.bfloat16)
    assert exact.target_output.dtype == exact.slot_queries.dtype == torch.float32
    assert narrow.target_output.dtype == narrow.slot_queries.dtype == torch.float16
    assert narrow.keys.dtype == narrow.values.dtype == torch.bfloat16
    gathered, expected = (s.problem(chosen, rows_of(picks), torch.bfloat16) for s in (narrow, exact))
    assert gathered.target_output.dtype == torch.float32
    assert torch.equal(gathered.target_output, expected.target_output)
    assert torch.allclose(gathered._slot_queries, expected._slot_queries, rtol=1e-3, atol=1e-3)
    (loss, norm), (loss_exact, norm_exact) = (p.loss(*parameters) for p in (gathered, expected))
    assert norm == norm_exact and abs(float(loss) - float(loss_exact)) < 0.03 * float(loss_exact)


def test_with_recorded_targets_float32_steps_keep_keys_and_values_as_recorded_and_score_the_same():
    """Where a step's products are float32, the keys and values (only its operands once the targets are known) wait
    in the record's float16, half of float32's bytes, and so do the queries' slot coordinates where no rotation
    turns them; a step casts what it gathers, so its loss and gradient are those of a float32 stack exactly."""
    for geometry, rotary in ((GEOMETRY, 8), (HeadGeometry(num_heads=6, kv_heads=2, head_dim=8, rotary_dim=0), 0)):
        samples, setting, _ = sequences_and_setting(seed=7)
        setting = replace(setting, cos=setting.cos[:, :rotary], sin=setting.sin[:, :rotary])
        generator = torch.Generator().manual_seed(8)
        for sample in samples:  # any recorded outputs: what matters is that both stacks read the same numbers
            sample.target_output = torch.randn(sample.queries.shape[0], 16, generator=generator).half()
        statistics = sum((statistics_of(s.queries.float(), s.keys.float(), geometry) for s in samples[1:]),
                         statistics_of(samples[0].queries.float(), samples[0].keys.float(), geometry))
        factors = fit_shared_key(statistics, geometry, KeyRanks((1,) * (rotary // 2), 0 if rotary else 3))
        slots = slot_frequencies(factors.ranks)
        widened = [SharedKeySample(*(part.float() for part in (s.queries, s.keys, s.values, s.target_output)))
                   for s in samples]
        kept = StackedSequences(samples, geometry, setting, slots, targets=True)
        wide = StackedSequences(widened, geometry, setting, slots, targets=True)
        assert kept.keys.dtype == kept.values.dtype == torch.float16 and wide.keys.dtype == torch.float32
        assert kept.slot_queries.dtype == (torch.float32 if rotary else torch.float16)
        chosen, picks = torch.tensor([0, 3, 5]), [torch.tensor([2, 6, 19]), torch.tensor([1, 8]), torch.tensor([16])]
        losses, gradients = [], []
        for stack in (kept, wide):
            parameters = [t.float().requires_grad_(True) for t in (factors.key_mixing, factors.query_core,
                                                                    factors.pass_core)]
            loss, _ = stack.problem(chosen, rows_of(picks)).loss(*parameters)
            loss.backward()
            losses.append(loss.detach())
            gradients.append([p.grad for p in parameters])
        assert torch.equal(losses[0], losses[1])
        assert gradients[0][0] is not None
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(*gradients, strict=True))


def test_consumed_samples_are_let_go_as_they_are_stacked_and_stack_the_same():
    """A refinement that reads its samples once lets each sample's tensors go as it stacks them, so a layer's
    calibration record is not held beside its stacked copy while the steps run."""
    kept_samples, setting, factors = sequences_and_setting(seed=6)
    consumed_samples, _, _ = sequences_and_setting(seed=6)
    slots = slot_frequencies(factors.ranks)
    for products in (torch.float32, torch.bfloat16):
        kept = StackedSequences(recorded(kept_samples, setting), GEOMETRY, setting, slots, targets=True,
                                products=products)
        consumed = StackedSequences(recorded(consumed_samples, setting), GEOMETRY, setting, slots, targets=True,
                                    products=products, consume=True)
        assert all(part is None for sample in consumed_samples
                   for part in (sample.queries, sample.keys, sample.values, sample.target_output))
        assert all(sample.queries is not None for sample in kept_samples)
        for name in ("slot_queries", "keys", "values", "target_output", "query_lengths", "key_lengths"):
            assert torch.equal(getattr(consumed, name), getattr(kept, name)), name
        consumed_samples, _, _ = sequences_and_setting(seed=6)


def test_a_step_draws_distinct_sorted_rows_within_each_sequence_in_one_draw():
    from collab_convert.decompose.refinement import drawn_rows

    lengths = torch.tensor([24, 3, 13])
    positions, real = drawn_rows(lengths, 5, torch.Generator().manual_seed(0))
    assert positions.shape == real.shape == (3, 5)
    assert real.tolist() == [[True] * 5, [True] * 3 + [False] * 2, [True] * 5]
    for row, length in zip(positions, lengths.tolist()):
        drawn = row[: min(length, 5)]
        assert torch.equal(drawn, drawn.sort().values) and len(set(drawn.tolist())) == len(drawn)
        assert int(drawn.max()) < length
    assert sorted(positions[1, :3].tolist()) == [0, 1, 2]  # a short sequence gives all its rows
    again, _ = drawn_rows(lengths, 5, torch.Generator().manual_seed(0))
    assert torch.equal(positions, again)  # a seed draws the same rows
    for asked in (None, 99):  # every row, or more than the longest has: as many as the longest has
        assert drawn_rows(lengths, asked, torch.Generator().manual_seed(0))[0].shape == (3, 24)


def test_a_refinement_that_consumes_its_samples_refines_as_one_that_keeps_them():
    """Whether or not some sequences are held out (ten or more), consuming the samples changes nothing of the result;
    with too few to hold any out, the checks read the training samples, which are stacked for the steps after."""
    from collab_convert.decompose.shared_key_refinement import refine_shared_key

    for copies in (1, 2):  # 6 sequences: none held out; 12: one held out
        results = []
        for consume in (False, True):
            samples, setting, factors = sequences_and_setting(seed=7)
            more, _, _ = sequences_and_setting(seed=8)
            samples = recorded((samples + more)[: 6 * copies], setting)
            results.append(refine_shared_key(samples, factors, GEOMETRY, setting, steps=6, consume=consume))
        kept, consumed = results
        assert kept.loss_after == consumed.loss_after and kept.steps == consumed.steps
        assert torch.equal(kept.factors.query_core, consumed.factors.query_core)


def test_held_out_checks_of_wide_layers_score_fewer_sequences_at_a_time_to_the_same_losses(monkeypatch):
    """A check scores every row of its held-out sequences, as many sequences a problem as fit in CHECK_BYTES of
    shared queries (at most 8): a wide layer's checks take fewer at once, and find the same losses."""
    from collab_convert.decompose import shared_key_refinement
    from collab_convert.decompose.shared_key_refinement import refine_shared_key

    sizes, results = [], []
    each_problem = StackedSequences.each_problem

    def recorded_size(self, size=8):
        sizes.append(size)
        return each_problem(self, size)

    monkeypatch.setattr(StackedSequences, "each_problem", recorded_size)
    for room in (shared_key_refinement.CHECK_BYTES, 1):  # 8 sequences a problem, then one
        samples, setting, factors = sequences_and_setting(seed=7)
        more, _, _ = sequences_and_setting(seed=8)
        samples = recorded(samples + more + sequences_and_setting(seed=9)[0] + sequences_and_setting(seed=10)[0],
                           setting)  # 24: two held out, scored together or one at a time
        monkeypatch.setattr(shared_key_refinement, "CHECK_BYTES", room)
        sizes.clear()
        results.append(refine_shared_key(samples, factors, GEOMETRY, setting, steps=6, consume=True))
        assert sizes[0] == (8 if room > 1 else 1)  # the checks' problems, made first
    wide, narrow = results
    assert narrow.loss_before == pytest.approx(wide.loss_before, rel=1e-5)
    assert narrow.kl_before == pytest.approx(wide.kl_before, rel=1e-5)
    assert narrow.loss_after == pytest.approx(wide.loss_after, rel=1e-4) and narrow.steps == wide.steps


def test_consumed_float32_factors_are_refined_in_their_own_tensors_to_the_same_result():
    """Where the caller hands over float32 factors with its samples (consume), their tensors become the
    parameters: no copy of them sits beside the parameters, and the result is the float64 start's."""
    from dataclasses import replace

    from collab_convert.decompose.shared_key_refinement import refine_shared_key

    results = []
    for in_float32 in (False, True):
        samples, setting, factors = sequences_and_setting(seed=7)
        more, _, _ = sequences_and_setting(seed=8)
        samples = recorded((samples + more)[:12], setting)
        if in_float32:
            factors = replace(factors, key_mixing=factors.key_mixing.float(), query_core=factors.query_core.float(),
                              pass_core=factors.pass_core.float())
            start = factors.key_mixing.clone()
        results.append(refine_shared_key(samples, factors, GEOMETRY, setting, steps=6, consume=True))
    from_float64, from_float32 = results
    assert from_float32.loss_after == from_float64.loss_after and from_float32.steps == from_float64.steps
    assert torch.equal(from_float32.factors.key_mixing, from_float64.factors.key_mixing.float())
    assert not torch.equal(factors.key_mixing, start)  # the handed-over tensor was the parameter Adam moved


def test_the_quadratic_error_has_the_plain_errors_value_and_gradient():
    """|R W^T - T|^2 = R.(R G - 2 T W) + |T|^2 with G = W^T W, and its gradient is 2 (R G - T W): the value and
    the gradient of the plain error, in float64 exactly, with padded rows weighing nothing."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 32, generator=generator, dtype=torch.float64)
    target = torch.randn(3, 7, 40, generator=generator, dtype=torch.float64)
    rows = torch.rand(3, 7, generator=generator) > 0.3
    targets = QuadraticTargets.of(target, weight, torch.float64)
    read = torch.randn(3, 7, 32, generator=generator, dtype=torch.float64, requires_grad=True)
    plain = (((read @ weight.T - target) ** 2).sum(-1) * rows).sum()
    (plain_gradient,) = torch.autograd.grad(plain, read)
    quadratic = QuadraticError.apply(read, targets.gram, targets.back, rows) + (targets.energy * rows).sum()
    (quadratic_gradient,) = torch.autograd.grad(quadratic, read)
    assert torch.isclose(quadratic, plain, rtol=1e-10)
    assert torch.allclose(quadratic_gradient, plain_gradient, rtol=1e-10, atol=1e-12)
    assert float(quadratic_gradient[~rows].abs().max()) == 0.0


def test_steps_take_the_quadratic_error_where_the_heads_are_no_wider_than_the_model():
    """Adam's steps (for_steps) read T W and |T|^2 instead of the targets and get the plain loss's gradient with
    respect to every parameter; where the output projection is narrower than the heads (D < H d, Gemma's shape)
    the plain error stays, as it is the cheaper there; the held-out checks' rows keep the plain error."""
    samples, setting, factors = sequences_and_setting(seed=6)
    chosen, picks = torch.tensor([2, 0, 5]), [torch.tensor([1, 6, 19]), torch.tensor([0, 23]), torch.tensor([11])]
    slots = slot_frequencies(factors.ranks)
    assert StackedSequences(samples, GEOMETRY, setting, slots, targets=True, for_steps=True).quadratic is None
    setting.output_weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(7))
    losses, gradients = [], []
    for for_steps in (False, True):
        stacked = StackedSequences(samples, GEOMETRY, setting, slots, targets=True, for_steps=for_steps)
        assert (stacked.quadratic is not None) == for_steps and (stacked.target_output is None) == for_steps
        parameters = [t.float().clone().requires_grad_(True)
                      for t in (factors.key_mixing, factors.query_core, factors.pass_core)]
        loss, norm = stacked.problem(chosen, rows_of(picks)).loss(*parameters)
        losses.append((float(loss.detach()), norm))
        gradients.append(torch.autograd.grad(loss, parameters[:2]))
    (plain, plain_norm), (quadratic, quadratic_norm) = losses
    assert abs(quadratic - plain) < 1e-4 * plain_norm and abs(quadratic_norm - plain_norm) < 1e-4 * plain_norm
    for expected, got in zip(*gradients):
        assert torch.allclose(got, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()))


def test_a_shared_key_refinement_checks_its_held_out_sequences_every_forty_steps(monkeypatch):
    """The held-out curves still fall at the last step, so checks every 40 steps keep the same state as every 20
    at half the checks' cost; the last step is always checked. Its rate warms up over the first 10 steps."""
    from collab_convert.decompose import held_out_adam, shared_key_refinement

    samples, setting, factors = sequences_and_setting(seed=8)
    samples = samples + [SharedKeySample(s.queries, s.keys, s.values) for s in samples]  # 12: one held out
    checked, settings, adam = [], [], held_out_adam.adam_with_held_out_groups

    def heard(*args, **kwargs):
        settings.append({name: kwargs[name] for name in ("check_every", "patience", "warmup")})
        return adam(*args, **kwargs, on_check=lambda step, losses: checked.append(step))

    monkeypatch.setattr(shared_key_refinement, "adam_with_held_out_groups", heard)
    shared_key_refinement.refine_shared_key(samples, factors, GEOMETRY, setting, steps=100, batch_sequences=2)
    assert checked == [40, 80, 100]  # every 40 steps, and the last
    assert settings == [{"check_every": 40, "patience": 3, "warmup": 10}]  # no gain in 3 checks: it stops


def test_quadratic_targets_wait_in_float32_where_float16_cannot_hold_them():
    """Float16 records keep T W in float16 (half the bytes) unless it overflows there: then in float32, exact."""
    target = torch.full((3, 4, 8), 200.0).half()
    for scale, dtype in ((0.01, torch.float16), (100.0, torch.float32)):
        weight = torch.full((8, 8), scale)
        targets = QuadraticTargets.of(target, weight, torch.float32)
        assert targets.back.dtype == dtype and torch.isfinite(targets.back).all()
        assert torch.allclose(targets.back.float(), target.float() @ weight, rtol=1e-3)
