"""Per-bucket plans of one budget (:class:`lightning_ckpt.decide.shape_plans.ShapePlanner`), on constructed costs."""

from __future__ import annotations

import pytest

from lightning_ckpt.decide.budget import BlockCost, predict_peak
from lightning_ckpt.decide.pricing import ShapeCosts
from lightning_ckpt.decide.shape_plans import ShapePlanner
from lightning_ckpt.decide.shapes import Shape

KiB = 1024
SHORT, LONG = Shape(4, (64,)), Shape(4, (256,))


def _fake(shape: Shape, blocks: int = 4, quadratic: bool = True) -> ShapeCosts:
    """Bytes that grow with tokens, and (``quadratic``) with the square of the length: an attention matrix."""
    tokens, length = shape.tokens, shape.lengths[0]
    interior = 10 * tokens + (shape.samples * length * length // 8 if quadratic else 0)
    cost = BlockCost(interior=interior, boundary=tokens, recompute_s=0.0, selective_kept=tokens + interior // 2,
                     selective_s=0.0, recompute_replay=interior, selective_replay=interior // 2)
    return ShapeCosts((cost,) * blocks, (2 * tokens, tokens))


def _measured(shape: Shape, factor: float = 1.25) -> tuple:
    """What a real calibration at ``shape`` reads: the fake bytes times ``factor`` (another device's kernels), and
    real times."""
    fake = _fake(shape)
    costs = [BlockCost(interior=round(c.interior * factor), boundary=c.boundary, recompute_s=1.0,
                       selective_kept=round(c.selective_kept * factor), selective_s=0.6,
                       recompute_replay=round(c.recompute_replay * factor),
                       selective_replay=round(c.selective_replay * factor)) for c in fake.costs]
    return costs, (round(fake.base[0] * factor), fake.base[1])


def test_each_bucket_is_priced_once_and_gets_a_plan_that_fits_it():
    priced = []
    planner = ShapePlanner(60 * KiB, ("recompute", "selective"), lambda b: priced.append(b) or _fake(b))
    short, long = planner.plan(SHORT), planner.plan(LONG)
    assert short.fits and long.fits and short.source == long.source == "fake only"
    assert sum(m != "off" for m in long.modes) > sum(m != "off" for m in short.modes)  # longer: more checkpointed
    assert planner.plan(LONG) is long and priced == [SHORT, LONG]  # reused, never priced twice
    assert long.predicted_peak == predict_peak(list(_fake(LONG).costs), long.modes, _fake(LONG).base)


def test_after_calibration_fake_bytes_are_carried_into_the_measured_units_and_times_scale_with_the_work():
    planner = ShapePlanner(10**9, ("recompute", "selective"), _fake)
    planner.plan(LONG)  # a plan from before the calibration: dropped, it was priced without times
    costs, base = _measured(SHORT)
    planner.set_reference(SHORT, costs, base)
    assert LONG not in planner.plans
    carried, carried_base, source = planner.costs(LONG)
    fake_short, fake_long = _fake(SHORT), _fake(LONG)
    ratio = fake_long.costs[0].interior / fake_short.costs[0].interior
    assert source == "fake"
    assert carried[0].interior == round(costs[0].interior * ratio)  # measured x fake(long) / fake(short)
    assert carried[0].boundary == fake_long.costs[0].boundary  # the factor was 1 there: the fake's own
    assert carried[0].recompute_s == pytest.approx(1.0 * ratio) and carried[0].selective_s == pytest.approx(0.6 * ratio)
    assert carried_base == (round(base[0] * fake_long.base[0] / fake_short.base[0]), fake_long.base[1])
    assert planner.costs(SHORT)[2] == "calibration" and planner.costs(SHORT)[0] == costs


def test_a_reading_at_the_buckets_own_shape_becomes_its_peak_and_one_above_elsewhere_raises_the_bucket():
    planner = ShapePlanner(70 * KiB, ("recompute", "selective"), _fake)
    first = planner.plan(LONG)
    predicted = planner.predict(LONG, first.modes)
    # at the bucket's own shape the reading is the plan's peak there, below or above the prediction
    assert planner.observe(LONG, first.modes, predicted - 100, step_s=0.5, tokens_per_sec=2048.0) < 0
    assert planner.predict(LONG, first.modes) == predicted - 100
    assert planner.plans[LONG] is first and first.steps == 1
    # a shorter batch of the bucket is predicted through the fitted model, and reading above it raises the bucket
    shorter = Shape(4, (200,))
    expected = planner.predict(LONG, first.modes, shorter)
    assert expected < predicted - 100
    over = 4 * KiB
    assert planner.observe(LONG, first.modes, expected + over, shape=shorter) == pytest.approx(over / expected)
    assert planner.predict(LONG, first.modes, shorter) >= expected + over - 1  # never again predicted below it
    assert planner.plans[LONG] is first and first.stale  # now predicted over the budget: chosen again when next used
    again = planner.plan(LONG)
    assert again is not first and not again.stale and again.steps == 2 and again.measured_peak == expected + over
    assert again.step_s == 0.5 and again.tokens_per_sec == 2048.0  # what the bucket did is kept
    assert again.predicted_peak <= 70 * KiB and sum(m == "recompute" for m in again.modes) > sum(
        m == "recompute" for m in first.modes)  # a stronger plan, within the budget
    assert planner.observe(SHORT, ("off",) * 4, 1) is None  # a bucket never planned: nothing to check


def test_the_fitted_model_finds_a_quadratic_term_from_two_lengths_and_carries_it_to_a_third():
    planner = ShapePlanner(10**9, ("recompute",), _fake)
    modes = ("off",) * 4
    for length in (150, 200, 250):  # inside the 256 bucket, fitted through 128 and 256
        shape = Shape(4, (length,))
        truth = predict_peak(list(_fake(shape).costs), modes, _fake(shape).base)
        assert planner.model_peak(LONG, modes, shape) == pytest.approx(truth, rel=1e-3)
    linear = ShapePlanner(10**9, ("recompute",), lambda b: _fake(b, quadratic=False))
    shape = Shape(3, (200,))  # fewer samples too: linear in samples
    truth = predict_peak(list(_fake(shape, quadratic=False).costs), modes, _fake(shape, quadratic=False).base)
    assert linear.model_peak(LONG, modes, shape) == pytest.approx(truth, rel=1e-3)


def test_each_plan_chosen_is_traced_and_a_traced_peak_over_the_budget_is_chosen_again():
    """The peak model is an approximation; with a tracer every plan the solver picks is traced at the bucket's shape
    and only a traced fit is kept."""
    traced = []

    def trace(bucket, plans):  # the truth: 30 % above the peak model for any plan with a block 'off'
        traced.extend(plans)
        fake = _fake(bucket)
        return [round(predict_peak(list(fake.costs), m, fake.base) * (1.3 if "off" in m else 1.0)) for m in plans]

    model_only = ShapePlanner(60 * KiB, ("recompute",), _fake).plan(LONG)
    planner = ShapePlanner(60 * KiB, ("recompute",), _fake, trace)
    plan = planner.plan(LONG)
    assert "off" in model_only.modes and traced[0] == model_only.modes  # the model's choice, traced first
    assert plan.fits and plan.predicted_peak == trace(LONG, [plan.modes])[0] <= 60 * KiB
    assert plan.modes != model_only.modes


def test_the_table_and_the_report_name_every_bucket():
    planner = ShapePlanner(60 * KiB, ("recompute",), _fake)
    planner.plan(LONG)
    planner.observe(LONG, planner.plans[LONG].modes, 50 * KiB, 0.1, 10240.0)
    text = planner.table()
    assert "4 x 256" in text and "10,240" in text and "recompute" in text
    data = planner.plans[LONG].as_dict()
    assert data["bucket"] == "4 x 256" and data["steps"] == 1 and isinstance(data["modes"], list)


def test_the_compilers_savings_are_the_shapes_own_and_a_reading_does_not_move_them():
    """A ``compiler:<f>`` block runs ``off`` on the eager reference step its figure comes from; what it saves compiled
    is priced at the step's shape (a longer batch's compiled blocks save more than the calibration's did), from the
    blocks' costs, not from a peak the plan read at the corner (itself corrected by these savings)."""
    import dataclasses

    costs, base = _measured(SHORT)
    costs = [dataclasses.replace(c, compiler=(("compiler:0", c.boundary, 0.1),)) for c in costs]
    planner = ShapePlanner(10**9, ("recompute", "compiler"), _fake)
    planner.set_reference(SHORT, costs, base)
    modes = ("off", "off", "compiler:0", "compiler:0")
    assert planner.compiled_savings(SHORT, ("off",) * 4) == 0
    short, long = planner.compiled_savings(SHORT, modes), planner.compiled_savings(LONG, modes)
    assert short == predict_peak(costs, ("off",) * 4, base) - predict_peak(costs, modes, base) > 0
    assert long == planner.predict(LONG, ("off",) * 4) - planner.predict(LONG, modes) > 2 * short
    planner.plan(LONG)
    planner.observe(LONG, modes, planner.predict(LONG, modes) + 50 * KiB)  # read above the model at the corner
    assert planner.compiled_savings(LONG, modes) == long
    inside = Shape(4, (200,))
    assert short < planner.compiled_savings(LONG, modes, inside) < long


def test_a_traced_plan_with_compiled_blocks_is_known_less_their_savings():
    """A fake trace runs ``compiler:<f>`` blocks eagerly (``off``): its peak, carried into device bytes, is the
    compiled plan's only once their savings come off; otherwise a plan that fits reads over the budget."""
    import dataclasses

    def eager(modes):
        return tuple("off" if m.startswith("compiler:") else m for m in modes)

    def trace(bucket, plans):
        fake = _fake(bucket)
        costs = [dataclasses.replace(c, compiler=(("compiler:0", c.boundary, 0.0),)) for c in fake.costs]
        return [predict_peak(costs, eager(m), fake.base) for m in plans]

    costs, base = _fake(SHORT).costs, _fake(SHORT).base
    costs = [dataclasses.replace(c, recompute_s=1.0, selective_s=0.6, compiler=(("compiler:0", c.boundary, 0.0),))
             for c in costs]
    chosen = ShapePlanner(10**9, ("recompute", "compiler"), _fake).plan(SHORT)
    planner = ShapePlanner(70 * KiB, ("recompute", "compiler"), lambda b: _fake(b), trace)
    planner.set_reference(SHORT, costs, base, chosen, measured_peak=predict_peak(costs, chosen.modes, base))
    plan = planner.plan(LONG)
    assert "compiler:0" in plan.modes and plan.fits
    traced = trace(LONG, [plan.modes])[0]
    assert planner.known(LONG)[plan.modes] == traced - planner.compiled_savings(LONG, plan.modes) < traced


def test_when_every_trace_reads_over_the_budget_the_plan_kept_is_one_that_was_traced_and_says_it_does_not_fit():
    """The choose-trace loop gives up after its checks with the lowest traced peak, never an untraced plan said to
    fit (before: the fifth choice, untraced, marked as fitting)."""
    traced = {}

    def trace(bucket, plans):  # 50 % above the model for every plan: nothing the model picks really fits
        fake = _fake(bucket)
        peaks = [round(predict_peak(list(fake.costs), m, fake.base) * 1.5) for m in plans]
        traced.update(zip(map(tuple, plans), peaks))
        return peaks

    planner = ShapePlanner(60 * KiB, ("recompute", "selective"), _fake, trace)
    plan = planner.plan(LONG)
    assert plan.modes in traced and plan.predicted_peak == traced[plan.modes]
    assert plan.predicted_peak == min(traced.values()) and not plan.fits


def test_the_calibrations_own_shape_is_a_bucket_whose_plan_a_reading_over_it_chooses_again():
    """One source of truth: the calibration's plan is the plan of its shape in ``plans``, so a step of that shape
    reading over the budget marks it stale and the next step of that shape runs a stronger plan."""
    from lightning_ckpt.decide.budget import plan_budget

    planner = ShapePlanner(60 * KiB, ("recompute",), _fake)
    fake = _fake(LONG)
    chosen = plan_budget(list(fake.costs), planner.target, base=fake.base, modes=("recompute",))
    peak = predict_peak(list(fake.costs), chosen.modes, fake.base)
    planner.set_reference(LONG, list(fake.costs), fake.base, chosen=chosen, measured_peak=peak)
    first = planner.plan(LONG)
    assert planner.plans[LONG] is first and first.modes == tuple(chosen.modes) and first.source == "calibration"
    planner.observe(LONG, first.modes, 61 * KiB)  # the calibration's own shape steps over the budget
    assert first.stale
    again = planner.plan(LONG)
    assert sum(m == "recompute" for m in again.modes) > sum(m == "recompute" for m in first.modes)
