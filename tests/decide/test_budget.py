import collections
import itertools
import time

import pytest
import torch

from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.decide.budget import (
    BlockCost,
    ModeCost,
    plan_budget,
    predict_peak,
    smallest_budget,
)
from lightning_ckpt.decide.calibration import TIME_KINDS, BudgetCalibration
from lightning_ckpt.decide.choose import TIME_TIE
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.measure.tracker import LiveBytes

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


def test_unreachable_budget_takes_the_lowest_peak_and_names_the_smallest_feasible_budget():
    plan = plan_budget(UNIFORM, 5 * MiB)
    # the last block is replayed right after the forward: keeping it un-checkpointed costs no more memory (15 MiB)
    # than replaying it would, so the lowest peak is 5 boundaries + one interior, not 6 + one interior
    assert not plan.fits and plan.modes == ("recompute",) * 5 + ("off",)
    assert plan.predicted_peak == plan.smallest_budget == 15 * MiB == smallest_budget(UNIFORM)
    assert "does NOT fit: the smallest feasible budget is 15.0 MiB" in plan.describe()
    with pytest.raises(ValueError, match=r"budget 5.0 MiB cannot be met: the smallest feasible activation budget "
                                         r"with modes \['off', 'selective', 'recompute', 'offload', 'compiler'\] "
                                         r"is 15.0 MiB"):
        plan_budget(UNIFORM, 5 * MiB, strict=True)


def test_generous_budget_checkpoints_nothing():
    plan = plan_budget(UNIFORM, 1000 * MiB)
    assert plan.modes == ("off",) * 6 and plan.recompute_s == 0


@pytest.mark.slow
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
            self.rows, self.exact = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # after cb's: the step is open
            if cb.calibration.calibrating:
                kind = cb.calibration.stages[cb.calibration.stage][2]
                self.exact.append((kind, cb.calibration.exact_step, cb._engine.monitor.meter.live_bytes() is not None))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows.append((cb.plan.modes, cb.last_result.ledger.activations))

    cb, rec = ActivationCheckpointing(policy=f"budget:{budget}"), Record()
    seed_everything(0)
    Trainer(**trainer_kwargs(tmp_path / "budget", max_steps=36, log_every_n_steps=1),
            callbacks=[cb, rec]).fit(TinyTransformer(batch_size=16))
    chosen = cb.calibration.chosen
    assert cb.calibration.done and chosen.fits
    assert 1 <= sum(m != "off" for m in chosen.modes) < 4
    calibration_steps = len(cb.calibration.stages)
    # every block recomputed once, then bytes and time steps per mode and parity; those predicted over the budget
    # (half the blocks off) replaced by stronger ones before they run
    assert 13 < calibration_steps <= 30
    # bytes steps are exact; time steps are not (per-operator tracking would inflate the block times)
    assert rec.exact == [(kind, kind == "bytes", kind == "bytes") for kind, _, _ in rec.exact]
    assert len(rec.exact) == calibration_steps
    assert all(act <= budget for _, act in rec.rows)  # the calibration's steps included
    assert cb.calibration.measured == pytest.approx(chosen.predicted_peak, rel=0.10)
    assert all_ < every2 < none


def test_budget_time_steps_stay_cheap_when_every_step_is_asked_to_be_exact(tmp_path):
    """``exact_every_n_steps=1`` makes every measured step exact, except the calibration's time steps: per-operator
    tracking there would inflate the block times the plan is chosen on."""
    from _lightning_models import TinyTransformer, trainer_kwargs
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_ckpt import ActivationCheckpointing

    cb = ActivationCheckpointing(policy="budget:1GiB", exact_every_n_steps=1)

    class Record(Callback):
        rows = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            kind = cb.calibration.stages[cb.calibration.stage][2] if cb.calibration.calibrating else "planned"
            self.rows.append((kind, cb._engine.monitor.meter.live_bytes() is not None))

    seed_everything(0)
    Trainer(**trainer_kwargs(tmp_path, max_steps=15, log_every_n_steps=1), callbacks=[cb, Record()]).fit(
        TinyTransformer(batch_size=16))
    assert [kind for kind, _ in Record.rows] == [s[2] for s in cb.calibration.stages] + ["planned"] * 2
    assert Record.rows == [(kind, kind not in TIME_KINDS) for kind, _ in Record.rows]


def test_budget_with_auto_threshold_or_fraction_without_capacity_is_refused():
    from lightning_ckpt import ActivationCheckpointing

    with pytest.raises(ValueError, match="cannot be combined with auto_threshold"):
        ActivationCheckpointing(policy="budget:1GiB", auto_threshold="1GiB")
    with pytest.raises(ValueError, match="capacity='24GiB'"):
        ActivationCheckpointing(policy="budget:0.5")
    assert ActivationCheckpointing(policy="budget:0.5", capacity="8GiB").settings.budget.budget == 0.5


def _random_costs(rng, n, offload, compiler=False):
    costs = []
    for _ in range(n):
        interior, boundary = rng.randint(8, 40) * MiB, rng.randint(1, 4) * MiB
        budgets = tuple((f"compiler:{f:g}", boundary + int(f * interior), rng.uniform(0.0, 0.04))
                        for f in (0.0, 0.5, 0.75)) if compiler else ()
        costs.append(BlockCost(interior, boundary, recompute_s=rng.uniform(0.005, 0.05),
                               selective_kept=boundary + rng.randint(1, interior // MiB - 1) * MiB,
                               selective_s=rng.uniform(0.001, 0.02),
                               offload_s=rng.uniform(0.001, 0.08) if offload else None, compiler=budgets))
    return costs


def _brute_force(costs, budget, base, modes):
    best = None
    for plan in itertools.product(*[[o.mode for o in c.options(modes)] for c in costs]):
        if predict_peak(costs, plan, base) <= budget:
            t = sum(c.option(m).seconds for c, m in zip(costs, plan))
            best = t if best is None else min(best, t)
    return best


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_mixed_mode_solver_is_optimal_against_brute_force(seed):
    import random

    rng = random.Random(seed)
    offload, compiler = seed % 2 == 0, seed % 3 == 0
    costs, base = _random_costs(rng, 5, offload, compiler), rng.randint(0, 8) * MiB
    modes = ("off", "selective", "recompute", "offload") if offload else ("off", "selective", "recompute")
    modes += ("compiler",) * compiler
    floor = min(predict_peak(costs, plan, base)
                for plan in itertools.product(*[[o.mode for o in c.options(modes)] for c in costs]))
    assert smallest_budget(costs, base, modes) == floor
    none = predict_peak(costs, ["off"] * 5, base)
    for fraction in (0.0, 0.2, 0.5, 0.8, 1.0):
        budget = int(floor + fraction * (none - floor))
        plan = plan_budget(costs, budget, base, modes)
        assert plan.fits and plan.predicted_peak == predict_peak(costs, plan.modes, base) <= budget
        assert plan.recompute_s == pytest.approx(_brute_force(costs, budget, base, modes))
        assert {m.split(":")[0] for m in plan.modes} <= set(modes)


# offload's backward prefetch: the interiors of these blocks, offloaded, tell which block's bytes were prefetched
_A = BlockCost(interior=10 * MiB, boundary=1 * MiB, recompute_s=0.01, offload_s=0.002)
_B = BlockCost(interior=12 * MiB, boundary=1 * MiB, recompute_s=0.01, offload_s=0.002)
_C = BlockCost(interior=20 * MiB, boundary=2 * MiB, recompute_s=0.01, offload_s=0.002)


@pytest.mark.parametrize("blocks, plan, without_prefetch", [
    ([_A, _C], ("offload", "offload"), 20),  # adjacent: C's backward brings back its 20 MiB, then A's 10
    ([_A, _B, _C], ("offload", "recompute", "offload"), 21),  # B's boundary + C, then A's 10 prefetched
    ([_A, _B, _C], ("offload", "off", "offload"), 32),  # B kept + C, then A's 10 prefetched
    # the recompute block between them binds: A's interior, prefetched by C, is back while B replays its 40 MiB
    ([_A, BlockCost(40 * MiB, 1 * MiB, 0.01), BlockCost(4 * MiB, 1 * MiB, 0.01, offload_s=0.002)],
     ("offload", "recompute", "offload"), 41),
])
def test_the_peak_counts_the_offloaded_block_prefetched_by_the_next_offloaded_one(blocks, plan, without_prefetch):
    """The old model (no prefetch) read ``without_prefetch``: low by exactly the prefetched interior, A's."""
    assert predict_peak(blocks, plan) == without_prefetch * MiB + _A.interior
    base = (5 * MiB, 3 * MiB)  # the backward's base under it
    assert predict_peak(blocks, plan, base) == 3 * MiB + without_prefetch * MiB + _A.interior


def test_nothing_is_prefetched_without_an_offloaded_block_on_each_side():
    assert predict_peak([_A, _B], ("offload", "recompute")) == 13 * MiB  # no offloaded block after A prefetches it
    assert predict_peak([_B, _C], ("recompute", "offload")) == 21 * MiB  # nothing offloaded before C
    assert predict_peak([_A, _C], ("offload", "off")) == 20 * MiB  # the end of the forward: C kept


def test_a_plan_that_fits_only_without_the_prefetch_is_not_chosen():
    """Offload is the cheapest mode here: the old model put three adjacent offloaded blocks at one interior
    (10 MiB) and chose them under 16 MiB; each one's backward also holds the previous one's interior (20 MiB)."""
    costs, modes = [_A] * 4, ("off", "recompute", "offload")
    three = ("offload", "offload", "offload", "off")
    plan = plan_budget(costs, 16 * MiB, modes=modes)
    assert plan.fits and plan.modes != three and plan.modes.count("offload") == 1
    assert predict_peak(costs, three) == 20 * MiB
    assert plan.predicted_peak == predict_peak(costs, plan.modes) <= 16 * MiB
    assert smallest_budget(costs, modes=modes) == 12 * MiB


@pytest.mark.parametrize("seed", range(8))
def test_the_solver_is_exact_with_several_offloaded_blocks_between_other_modes(seed):
    """Brute force over every plan of 6 blocks where offload is cheap, so the best plans offload several blocks
    apart: the dynamic programme's branch at each offloaded block (another one follows, or none) is exact."""
    import random

    rng = random.Random(100 + seed)
    costs = [BlockCost(rng.randint(4, 40) * MiB, rng.randint(1, 4) * MiB, recompute_s=rng.uniform(0.005, 0.05),
                       offload_s=rng.uniform(0.0005, 0.01)) for _ in range(6)]
    base, modes = (rng.randint(0, 20) * MiB, rng.randint(0, 20) * MiB), ("off", "recompute", "offload")
    plans = list(itertools.product(*[[o.mode for o in c.options(modes)] for c in costs]))
    peaks = {plan: predict_peak(costs, plan, base) for plan in plans}
    floor, none = min(peaks.values()), peaks[("off",) * 6]
    assert smallest_budget(costs, base, modes) == floor
    for fraction in (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75):  # the plans chosen offload 2 to 5 blocks, mixed
        budget = int(floor + fraction * (none - floor))
        plan = plan_budget(costs, budget, base, modes)
        assert plan.fits and plan.predicted_peak == peaks[plan.modes] <= budget
        best = min(sum(c.option(m).seconds for c, m in zip(costs, p)) for p in plans if peaks[p] <= budget)
        assert plan.recompute_s == pytest.approx(best)


def test_equally_fast_plans_change_the_fewest_blocks():
    """A mode measured as free (a compiled ``selective`` can time at 0.0 s within noise) ties with ``off``: with
    room to spare the plan leaves the blocks alone; where memory binds the free mode is taken."""
    costs = [BlockCost(20 * MiB, 2 * MiB, recompute_s=0.03, selective_kept=8 * MiB, selective_s=0.0)] * 4
    assert plan_budget(costs, 10**12).modes == ("off",) * 4
    tight = plan_budget(costs, 3 * 20 * MiB + 8 * MiB + 4 * MiB)
    assert tight.fits and tight.recompute_s == 0.0 and tight.modes.count("selective") == 1


def test_the_compilers_budgets_are_options_only_when_asked_for_and_replay_at_most_a_full_replay():
    cost = BlockCost(20 * MiB, 2 * MiB, 0.010, compiler=(("compiler:0", 2 * MiB, 0.008),
                                                          ("compiler:0.5", 12 * MiB, 0.003)))
    assert [o.mode for o in cost.options(("off", "recompute"))] == ["off", "recompute"]
    options = {o.mode: o for o in cost.options(("off", "recompute", "compiler"))}
    assert options["compiler:0"] == ModeCost("compiler:0", 2 * MiB, 22 * MiB, 0.008)
    assert options["compiler:0.5"].replay == 22 * MiB  # boundary + interior: its backward recomputes at most that
    # cheaper than recompute at the same bytes: the compiler's full-recompute budget wins at the tightest budget
    plan = plan_budget([cost] * 4, 30 * MiB, modes=("off", "recompute", "compiler"))
    assert plan.fits and "recompute" not in plan.modes and "compiler:0" in plan.modes
    assert "compiler:0" in plan.summary() and "compiler:0" in plan.describe()


def test_summary_explains_each_block():
    costs = [BlockCost(20 * MiB, 2 * MiB, 0.010, selective_kept=6 * MiB, selective_s=0.002)] * 4
    plan = plan_budget(costs, 50 * MiB, modes=("off", "selective", "recompute"))
    assert plan.fits and "selective" in plan.modes
    rows = plan.summary().splitlines()
    assert rows[1].split() == ["block", "mode", "kept", "saves", "replay", "peak", "adds", "ms"]
    selective = next(r for r in rows[2:] if "selective" in r)
    assert "6.0 MiB" in selective and "14.0 MiB" in selective and "2.00" in selective


def test_compiler_fractions_need_compiled_blocks_and_fractions_in_range():
    plan = apply_policy(GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8)), "none")
    with pytest.raises(ValueError, match=r"compiler_fractions=\[0.5\] needs blocks that run compiled one by one"):
        BudgetCalibration(plan, None, 1, compiler_fractions=(0.5,))
    with pytest.raises(ValueError, match=r"compiler_fractions \[1.5\] are outside \[0, 1\]"):
        BudgetCalibration(plan, None, 1, block_caller=lambda b: b, compiler_fractions=(0.5, 1.5))
    with pytest.raises(ValueError, match=r"budget modes \['compiler'\] are not calibrated modes"):
        BudgetCalibration(plan, None, 1, modes=("recompute", "compiler"))


def test_unknown_solver_mode_is_refused():
    with pytest.raises(ValueError, match=r"budget modes \['turbo'\] are not solver modes; choose among"):
        plan_budget(UNIFORM, 20 * MiB, modes=("off", "turbo"))


def _calibrated_step(module, precision: str):
    """Calibrate ``budget:`` on ``module`` as the callback does (exact bytes steps, timed steps), and return the
    calibration and a function measuring a plan's activation figure on an exact step (the figure the budget is
    held to)."""
    from lightning_ckpt.forecast.load import lightning_step, make_optimizers
    from lightning_ckpt.forecast.precision import parse_precision
    from lightning_ckpt.measure.meter import StepMeter

    module.train()
    batch, optimizers, parsed = module.example_batch(2, 64), make_optimizers(module, None), parse_precision(precision)
    plan, meter = apply_policy(module, "none"), StepMeter("cpu", model=module)

    def step(exact: bool) -> int:
        with meter.step(exact=exact) as box:
            lightning_step(module, batch, optimizers, parsed)
        return int(box.reading.activations or 0)

    def measure(modes) -> int:
        plan.set_modes(list(modes))
        return step(True)

    calibration = BudgetCalibration(plan, meter, budget=2**62)
    calibration.run(step)
    return calibration, measure


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_calibrated_peak_model_predicts_plans_it_never_ran(arch, precision):
    """Plans the calibration did not run are predicted within 3 % of ``none``'s peak, in both phases. Two errors
    this catches: under autocast the kept bytes counted the weights' bf16 copies (which the activation figure leaves
    out): every off block read ~15 % high on the demo GPT; and on a model whose logits outweigh a block (the Llama's
    vocabulary) a step that peaks at the end of the forward was read as a backward peak, which set the backward base
    to the logits' size (plans ending in a recompute read ~6 % high)."""
    from lightning_ckpt.demos import GPTLightningModule, HFCausalLMModule

    torch.manual_seed(0)
    if arch == "gpt":
        module = GPTLightningModule(n_layer=4, n_embd=64, n_head=4, block_size=64, dropout=0.0)
    else:
        module = HFCausalLMModule(arch="llama", n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=2048)
    calibration, measure = _calibrated_step(module, precision)
    costs, base = calibration.costs(), calibration.base
    plans = [("off",) * 4, ("recompute",) * 4, ("selective",) * 4, ("off", "recompute") * 2,
             ("off", "off", "recompute", "recompute"), ("recompute", "selective") * 2,
             ("off", "off", "off", "selective")]
    measured = {plan: measure(plan) for plan in plans}
    tolerance = 0.03 * measured[plans[0]]
    errors = {plan: predict_peak(costs, plan, base) - peak for plan, peak in measured.items()}
    assert all(abs(error) <= tolerance for error in errors.values()), (errors, tolerance)


@pytest.mark.parametrize("modes", [("off", "selective", "recompute", "off"), ("selective", "recompute", "selective",
                                                                              "recompute"), ("recompute", "off", "off",
                                                                                             "selective")])
def test_mixed_plans_keep_float32_gradients_bitwise(modes):
    import torch

    from lightning_ckpt.core.wrap import apply_policy
    from lightning_ckpt.demos.gpt import GPT, GPTConfig

    def grads(plan_modes):
        torch.manual_seed(0)
        model = GPT(GPTConfig.tiny(n_layer=4, n_embd=64, n_head=4, vocab_size=96, block_size=32, dropout=0.1))
        plan = apply_policy(model, "none")
        if plan_modes is not None:
            plan.set_modes(plan_modes)
        idx = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)  # the dropout masks: a replay must draw the same ones
        model(idx, idx)[1].backward()
        return [p.grad for p in model.parameters()]

    plain, mixed = grads(None), grads(modes)
    assert all(torch.equal(a, b) for a, b in zip(plain, mixed))


@pytest.mark.slow
def test_budget_plan_is_explained_in_the_summary_the_report_and_tensorboard_tags(tmp_path):
    import json

    from _lightning_models import TinyTransformer, trainer_kwargs
    from lightning.pytorch import Trainer, seed_everything

    from lightning_ckpt import ActivationCheckpointing

    seed_everything(0)
    cb = ActivationCheckpointing(policy="budget:600KiB")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=24, log_every_n_steps=1), callbacks=[cb])
    trainer.fit(TinyTransformer(batch_size=16))
    chosen = cb.calibration.chosen
    assert cb.calibration.done
    summary = cb.plan.summary()
    assert all("keeps " in row and "saves " in row for row in summary.splitlines()[2:2 + cb.plan.num_blocks])
    text = cb.report(trainer)
    assert "per block, as the budget chose:" in text and chosen.describe() in text
    data = json.loads((tmp_path / "csv" / "version_0" / "lightning_ckpt_report.json").read_text())
    assert [b["mode"] for b in data["budget_plan"]["blocks"]] == list(chosen.modes)
    assert data["budget_plan"]["budget"] == 600 * 1024
    logged = cb.last_metrics
    for i, (c, _) in enumerate(chosen.choices):
        assert logged[f"blocks/{i:02d}_kept_gib"] * 2**30 == pytest.approx(c.kept)
        assert logged[f"blocks/{i:02d}_replay_gib"] * 2**30 == pytest.approx(c.replay)


# ------------------------------------------------------------------------------ a calibration that runs out of memory


def _hand_driven_calibration(budget: int = 2**62):
    """A calibration of the demo GPT (4 blocks, float32) driven step by step as the callback drives it; returns the
    calibration, the plan and ``step(exact)`` (one optimizer step, its activation peak)."""
    from lightning_ckpt.demos import GPTLightningModule
    from lightning_ckpt.forecast.load import lightning_step, make_optimizers
    from lightning_ckpt.forecast.precision import parse_precision
    from lightning_ckpt.measure.meter import StepMeter

    torch.manual_seed(0)
    module = GPTLightningModule(n_layer=4, n_embd=64, n_head=4, block_size=64, dropout=0.0)
    module.train()
    batch, optimizers = module.example_batch(2, 64), make_optimizers(module, None)
    plan, meter = apply_policy(module, "none"), StepMeter("cpu", model=module)

    def step(exact: bool) -> int:
        with meter.step(exact=exact) as box:
            lightning_step(module, batch, optimizers, parse_precision("32-true"))
        return int(box.reading.activations or 0)

    return BudgetCalibration(plan, meter, budget=budget), plan, step


def test_a_calibration_stage_that_runs_out_of_memory_is_replaced_and_its_retry_never_recorded():
    """Stage 1 (recompute on blocks 0 and 2, the others off) runs out of memory: what it measured is taken back, its
    plan is recorded as not fitting, the retried step (under 'all') measures and records nothing, the stage is
    replaced by two stronger ones (one off block each), and its time stage (the same plan) is replaced without
    being run. The calibration completes: every block priced off, no plan as weak as the unfit one run or chosen."""
    calibration, plan, step = _hand_driven_calibration()
    calibration.begin_step()
    calibration.end_step(step(calibration.exact_step))  # stage 0: every block recomputed
    before = (list(calibration.interior), {m: list(v) for m, v in calibration.kept.items()})
    calibration.begin_step()
    failed = tuple(plan.modes)
    assert failed == ("recompute", "off", "recompute", "off")
    step(True)  # the failed attempt measured its blocks before the error
    assert calibration.interior[1] > 0
    calibration.out_of_memory()
    assert calibration.unfit == [failed]
    assert (calibration.interior, calibration.kept) == before  # taken back
    assert calibration.stages[1:3] == [("recompute", ("recompute", "off", "recompute", "recompute"), "bytes"),
                                       ("recompute", ("recompute", "recompute", "recompute", "off"), "bytes")]
    plan.set_modes(["recompute"] * 4)  # the retry, one rung up
    peaks = list(calibration._calibration_peaks)
    calibration.end_step(step(True))
    assert calibration.stage == 1 and calibration._calibration_peaks == peaks  # the retry is no stage
    assert (calibration.interior, calibration.kept) == before  # nor measured as one
    ran = []
    while calibration.calibrating:
        calibration.begin_step()
        if calibration.calibrating:
            ran.append(tuple(plan.modes))
            calibration.end_step(step(calibration.exact_step))
    assert failed not in ran and not any(calibration._dominated(modes) for modes in ran)
    assert calibration._measured_off == {0, 1, 2, 3}
    assert failed not in calibration.measured_plans and calibration.chosen is not None
    assert not calibration._dominated(calibration.chosen.modes)
    # every plan measured is timed in two steps, the stronger ones that replaced the unfit plan too
    timed = collections.Counter(modes for _, modes, kind in calibration.stages if kind in TIME_KINDS)
    assert {timed[modes] for _, modes, kind in calibration.stages[1:] if kind == "bytes"} == {2}
    for i in range(4):  # each time step reads each block once
        assert len(calibration.forward_seconds["recompute"][i]) == sum(
            kind in TIME_KINDS and modes[i] == "recompute" for _, modes, kind in calibration.stages)


def test_a_verifying_step_that_runs_out_of_memory_is_chosen_again_and_verified_on_the_next_step():
    """With an unbounded budget the calibration chooses every block off; that plan runs out of memory on the
    verifying step: it joins the plans that do not fit, a plan predicted below it is chosen, the retried step is
    not taken as the verification, and the next step applies and verifies the new choice."""
    calibration, plan, step = _hand_driven_calibration()
    calibration.run(step)
    first = calibration.chosen.modes
    assert first == ("off",) * 4 and tuple(plan.modes) == first
    calibration.begin_step()
    calibration.out_of_memory()
    second = calibration.chosen
    assert first in calibration.unfit and second.modes != first and not calibration.done
    assert second.predicted_peak < predict_peak(calibration.costs(), first, calibration.base)
    plan.set_modes(["recompute"] * 4)  # the retry, one rung up
    calibration.end_step(step(False))
    assert calibration.measured is None and not calibration.done  # the retry verifies nothing
    calibration.begin_step()
    assert tuple(plan.modes) == second.modes
    calibration.end_step(step(False))
    assert calibration.done and calibration.measured is not None


class FakeCapacity(LiveBytes):
    """A device of ``capacity`` bytes, on the CPU: follows every storage an operator creates and raises
    ``torch.OutOfMemoryError`` from the operator that takes the live bytes above ``capacity`` (``None``: only
    measure), as the caching allocator does. ``on_oom()`` tells what was running then."""

    def __init__(self, capacity=None, on_oom=None):
        super().__init__(torch.device("cpu"))
        self.capacity, self.on_oom, self.ooms = capacity, on_oom, []

    def _add(self, st, key, copy, *made):
        from torch._subclasses.fake_tensor import is_fake

        if len(made) > 1 and made[1] is not None and is_fake(made[1]):  # fake tensors take no device memory
            return
        super()._add(st, key, copy, *made)
        if self.capacity is not None and self.live + self.copies_live > self.capacity:
            self.ooms.append(self.on_oom() if self.on_oom is not None else None)
            raise torch.OutOfMemoryError(f"CPU out of memory (a fake capacity of {self.capacity} bytes)")


def _fit_under(tmp_path, capacity, policy, modes=None, steps=3, callbacks=(), on_oom=None):
    """Train the tiny Transformer (SGD) with every storage made during ``fit`` counted against ``capacity``;
    ``modes`` fixes the blocks' modes before every step. Returns the callback, the device and its per-step peaks."""
    from _lightning_models import TinyTransformer, trainer_kwargs
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_ckpt import ActivationCheckpointing

    # the data's own shape: no search for the longest length (its batches, resized, would count on this device)
    cb = ActivationCheckpointing(policy=policy, max_shape="16x8")
    device = FakeCapacity(capacity, on_oom=on_oom and (lambda: on_oom(cb)))
    peaks = []

    class Fix(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if modes is not None:
                cb.plan.set_modes(list(modes))
            device.reset_peak()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            peaks.append(device.total_peak)

    seed_everything(0)
    trainer = Trainer(callbacks=[cb, Fix(), *callbacks], **trainer_kwargs(
        tmp_path, max_steps=steps, log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0))
    with device:
        trainer.fit(TinyTransformer(batch_size=16, optimizer="sgd"))
    return cb, device, peaks


@pytest.mark.slow
@pytest.mark.parametrize("room", ["just above all", "one block off"])
def test_a_budget_on_a_card_that_only_just_holds_all_completes_its_calibration_and_fits(tmp_path, room):
    """The device holds every block recomputed ('all') and, in the second case, also one block off (the last, whose
    backward comes first), never two: the calibration's own stages (half the blocks off) run out of memory. The
    calibration completes anyway, with the default on_oom='raise' (the calibration retries its own steps): each
    stage that ran out of memory is recorded as not fitting and never with a figure, every figure recorded is of a
    step that ran its stage's plan to the end, and the chosen plan trains without one more error."""
    from lightning.pytorch import Callback

    from lightning_ckpt import ActivationCheckpointing

    off_last = ("recompute",) * 3 + ("off",)
    _, _, all_peaks = _fit_under(tmp_path / "all", None, "all")
    _, _, last_peaks = _fit_under(tmp_path / "last", None, "all", modes=off_last)
    _, _, first_peaks = _fit_under(tmp_path / "first", None, "all", modes=("off",) + ("recompute",) * 3)
    all_peak, last_peak, first_peak = max(all_peaks), max(last_peaks), max(first_peaks)
    assert all_peak < last_peak < first_peak
    capacity = (all_peak + last_peak) // 2 if room == "just above all" else (last_peak + first_peak) // 2

    steps, ooms = [], []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.ooms = len(ooms)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
            steps.append((tuple(cb.plan.modes), len(ooms) > self.ooms, cb.last_result.ledger.activations,
                          cb.calibration.done))

    def running(cb):  # what ran out of memory: the plan, and whether the calibration was over
        ooms.append((tuple(cb.plan.modes), cb.calibration.done))
        return ooms[-1]

    cb, device, _ = _fit_under(tmp_path / "budget", capacity, "budget:1GiB", steps=60, callbacks=[Steps()],
                               on_oom=running)
    calibration = cb.calibration
    assert calibration.done and calibration.chosen is not None
    assert device.ooms and not any(done for _, done in device.ooms)  # errors in the calibration only
    assert set(calibration.unfit) == {modes for modes, _ in device.ooms}
    assert calibration.unfit and not set(calibration.unfit) & set(calibration.measured_plans)
    clean = {(modes, activations) for modes, failed, activations, _ in steps if not failed}
    assert all((modes, peak) in clean for modes, peak in calibration._calibration_peaks)
    after = [(modes, failed) for modes, failed, _, done in steps if done]
    assert len(after) >= 2 and all(modes == calibration.chosen.modes and not failed for modes, failed in after)
    if room == "one block off":
        assert off_last in calibration.measured_plans and 3 in calibration._measured_off


def test_a_verifying_step_off_by_more_than_the_margin_is_corrected_and_the_correction_verified_in_turn():
    """The first verifying step reads far above its prediction (a one-off: the next reads what the model says):
    the prediction is corrected by the difference and a stronger plan chosen, verified on the next step (the old
    code corrected once and never verified the correction, crediting the old plan's reading to it); that plan
    holds, so it is kept, with its own reading."""
    calibration, plan, step = _hand_driven_calibration()
    calibration.run(step)
    first = calibration.chosen
    assert not calibration.done and first.modes == ("off",) * 4
    calibration.budget = first.predicted_peak + 1000  # a budget the chosen plan just meets, by prediction
    calibration._choose()
    first = calibration.chosen
    overshoot = int(first.predicted_peak * 0.5)
    calibration.begin_step()
    step(False)
    calibration.end_step(first.predicted_peak + overshoot)  # read far above its prediction
    second = calibration.chosen
    assert not calibration.done and second.modes != first.modes and second.fits
    assert calibration.measured_plans[first.modes] == first.predicted_peak + overshoot
    calibration.begin_step()
    assert tuple(plan.modes) == second.modes  # the correction runs, to be verified
    readings = {}
    while True:  # each choice verified on its own step, a bounded number of them
        modes = tuple(plan.modes)
        readings[modes] = step(False)
        calibration.end_step(readings[modes])
        if calibration.done:
            break
        calibration.begin_step()
    from lightning_ckpt.decide.choose import MAX_CHECKS

    assert 2 <= calibration.verifications <= MAX_CHECKS
    chosen = calibration.chosen
    assert chosen.modes != first.modes  # the plan that read over the budget is never taken again
    assert tuple(plan.modes) == chosen.modes and calibration.measured == readings[chosen.modes] <= calibration.budget


# ------------------------------------------------------------------------------ what a mode adds to a step's time


class _SlowAfterOldTensors(torch.autograd.Function):
    """Sleeps in its forward; its backward sleeps long unless its block was replayed since (the tensors it reads are
    fresh): what a cache does to a backward that follows a replay, made large and certain."""

    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner, ctx.calls = owner, owner.calls
        time.sleep(owner.forward_s)
        out = x.clone()
        ctx.save_for_backward(out)  # a replay runs this forward again to recreate it
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 (a recomputed block replays here)
        replayed = ctx.owner.calls > ctx.calls
        time.sleep(ctx.owner.fresh_backward_s if replayed else ctx.owner.stale_backward_s)
        return grad, None


class _SleepyBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.calls, self.forward_s, self.stale_backward_s, self.fresh_backward_s = 0, 0.015, 0.030, 0.0

    def forward(self, x):
        self.calls += 1
        return x + _SlowAfterOldTensors.apply(torch.tanh(self.linear(x)), self)


def test_a_mode_is_priced_by_what_it_adds_to_the_blocks_backward_not_by_its_replay_alone():
    """A recompute replays a block's 15 ms forward, and the backward after it runs 30 ms faster (its tensors are
    fresh): the mode adds nothing to a step. Priced by its replay alone, as it was, the calibration charged it
    15 ms a block, and the budget took 'selective' blocks over fewer recomputed ones that were as fast (the demo
    GPT's recompute priced +16.5 ms where the step read +10.2 ms). Each block's whole backward is timed now."""
    from lightning_ckpt.measure.meter import StepMeter

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_SleepyBlock(16) for _ in range(4))
    plan, meter = apply_policy(model, "none", blocks=["layers"]), StepMeter("cpu", model=model)
    x = torch.randn(2, 8, 16, requires_grad=True)

    def step(exact: bool) -> int:
        with meter.step(exact=exact) as box:
            h = x
            for layer in model.layers:
                h = layer(h)
            h.sum().backward()
        return int(box.reading.activations or 0)

    calibration = BudgetCalibration(plan, meter, budget=2**62, modes=("recompute",))
    calibration.run(step)
    recompute = calibration.costs()[1].recompute_s
    assert recompute < 0.0075, f"recompute priced at {recompute * 1e3:.1f} ms a block; it adds nothing to a step"
    assert calibration.mode_seconds["recompute"][1], "the replay was timed too (the price when no backward is)"


def test_plans_within_the_timing_noise_of_the_fastest_run_the_fewest_checkpointed_blocks():
    """Two recomputed blocks (2 x 10 ms) against one recomputed and two selective (10 + 2 x 4.8 ms = 19.6 ms): the
    mix is priced 2 % faster, within the noise of timed medians, so the run-time choice (``tie``) checkpoints the
    fewer blocks; so it does for the mix the calibration priced on the demo GPT (recompute 12.8 ms, selective
    4.6 ms: 22.0 ms against 25.6 ms, 14 % faster, and 2 % slower per step when run); a mix clearly faster
    (2 x 2 ms: 30 % faster) is still taken, and without ``tie`` the solver is exact."""
    def costs(selective_s):
        return [BlockCost(20 * MiB, 2 * MiB, recompute_s=0.010, selective_kept=12 * MiB,
                          selective_s=selective_s)] * 4

    budget = 46 * MiB  # two blocks recomputed fit; so does one recomputed with two selective
    exact = plan_budget(costs(0.0048), budget)
    assert sorted(exact.modes) == ["off", "recompute", "selective", "selective"]
    assert exact.recompute_s == pytest.approx(0.0196)
    tied = plan_budget(costs(0.0048), budget, tie=TIME_TIE)
    assert tied.fits and sorted(tied.modes) == ["off", "off", "recompute", "recompute"]
    demo = [BlockCost(20 * MiB, 2 * MiB, recompute_s=0.0128, selective_kept=12 * MiB, selective_s=0.0046)] * 4
    assert sorted(plan_budget(demo, budget).modes) == ["off", "recompute", "selective", "selective"]
    assert sorted(plan_budget(demo, budget, tie=TIME_TIE).modes) == ["off", "off", "recompute", "recompute"]
    clear = plan_budget(costs(0.002), budget, tie=TIME_TIE)
    assert sorted(clear.modes) == ["off", "recompute", "selective", "selective"]
    assert clear.recompute_s == pytest.approx(0.014)
