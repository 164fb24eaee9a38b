import itertools

import pytest

from lightning_ckpt.budget import BlockCost, plan_budget, predict_peak

MiB = 2**20
UNIFORM = [BlockCost(interior=10 * MiB, boundary=1 * MiB, recompute_s=0.01)] * 6


def test_peak_model_matches_the_seed_arithmetic():
    none = predict_peak(UNIFORM, [False] * 6)
    all_ = predict_peak(UNIFORM, [True] * 6)
    assert none == 60 * MiB
    # every boundary alive while the last block replays its interior: L × boundary + interior
    assert all_ == 6 * MiB + 10 * MiB
    assert predict_peak(UNIFORM, [True, False] * 3, base=5 * MiB) == 5 * MiB + 3 * MiB + 30 * MiB


def _exhaustive(costs, budget, base=0):
    best = None
    for mask in itertools.product([False, True], repeat=len(costs)):
        if predict_peak(costs, mask, base) <= budget:
            t = sum(c.recompute_s for c, m in zip(costs, mask) if m)
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("budget_mib", [16, 20, 25, 33, 45, 59, 60, 100])
def test_uniform_blocks_plan_is_optimal(budget_mib):
    plan = plan_budget(UNIFORM, budget_mib * MiB)
    assert plan.fits
    assert plan.predicted_peak <= budget_mib * MiB
    assert plan.recompute_s == pytest.approx(_exhaustive(UNIFORM, budget_mib * MiB))


def test_heterogeneous_blocks_match_exhaustive_search():
    costs = [
        BlockCost(30 * MiB, 2 * MiB, 0.002),
        BlockCost(8 * MiB, 2 * MiB, 0.020),
        BlockCost(20 * MiB, 2 * MiB, 0.005),
        BlockCost(12 * MiB, 2 * MiB, 0.030),
        BlockCost(25 * MiB, 2 * MiB, 0.004),
    ]
    for budget in (40, 50, 60, 80):
        plan = plan_budget(costs, budget * MiB, base=3 * MiB)
        best = _exhaustive(costs, budget * MiB, base=3 * MiB)
        assert plan.fits and plan.recompute_s == pytest.approx(best)


def test_unreachable_budget_checkpoints_everything_and_says_so():
    plan = plan_budget(UNIFORM, 5 * MiB)
    assert not plan.fits and plan.modes == ("recompute",) * 6
    assert "does NOT fit" in plan.describe()


def test_generous_budget_checkpoints_nothing():
    plan = plan_budget(UNIFORM, 1000 * MiB)
    assert plan.modes == ("off",) * 6 and plan.recompute_s == 0
