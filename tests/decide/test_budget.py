import itertools

import pytest

from lightning_ckpt.decide.budget import BlockCost, plan_budget, predict_peak

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


def test_budget_policy_in_a_trainer_calibrates_then_fits(tmp_path):
    from _lightning_models import TinyTransformer, trainer_kwargs
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_ckpt import ActivationCheckpointing

    def peak(policy):
        seed_everything(0)
        cb = ActivationCheckpointing(policy=policy)
        Trainer(**trainer_kwargs(tmp_path / policy, max_steps=2, log_every_n_steps=1), callbacks=[cb]).fit(
            TinyTransformer(batch_size=16))
        return cb.last_result.ledger.activations

    none, every2, all_ = peak("none"), peak("every:2"), peak("all")
    budget = every2 + (none - every2) // 4  # two checkpointed blocks fit, one does not

    class Record(Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows.append((cb.plan.modes, cb.last_result.ledger.activations))

    cb, rec = ActivationCheckpointing(policy=f"budget:{budget}"), Record()
    seed_everything(0)
    Trainer(**trainer_kwargs(tmp_path / "budget", max_steps=5, log_every_n_steps=1),
            callbacks=[cb, rec]).fit(TinyTransformer(batch_size=16))
    chosen = cb.calibration.chosen
    assert cb.calibration.done and chosen.fits
    assert sum(m != "off" for m in chosen.modes) == 2
    assert all(act <= budget for _, act in rec.rows[2:])
    assert cb.calibration.measured == pytest.approx(chosen.predicted_peak, rel=0.10)
    assert all_ < every2 < none


def test_budget_with_auto_threshold_or_fraction_without_capacity_is_refused():
    from lightning_ckpt import ActivationCheckpointing

    with pytest.raises(ValueError, match="cannot be combined with auto_threshold"):
        ActivationCheckpointing(policy="budget:1GiB", auto_threshold="1GiB")
    with pytest.raises(ValueError, match="capacity='24GiB'"):
        ActivationCheckpointing(policy="budget:0.5")
    assert ActivationCheckpointing(policy="budget:0.5", capacity="8GiB").settings.budget.budget == 0.5
