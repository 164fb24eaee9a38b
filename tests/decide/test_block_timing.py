"""The budget's compiled block timing: one block run alone in every mode, as training runs it.

What must hold: a replay is priced (recompute costs more than ``off``), no ``.grad`` is touched, the random-number
state and the block's mode are as before, the training step's autocast is reproduced, and with the blocks compiled
the calibration prices modes from the compiled graphs, with bytes steps only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _torch_features import needs_compiler_budget
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.decide.block_timing import capture_block_input, saved_block_bytes, time_block_modes
from lightning_ckpt.decide.calibration import BudgetCalibration
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.measure.meter import StepMeter


def _gpt(n_layer=2, n_embd=128, block_size=128, dropout=0.1):
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=96, block_size=block_size,
                              dropout=dropout))


def _captured(model, idx, autocast=None):
    box = {}

    def capture(module, args, kwargs):
        box.setdefault("input", capture_block_input(args, kwargs))

    handle = model.transformer.h[-1].register_forward_pre_hook(capture, with_kwargs=True)
    with autocast or torch.autocast("cpu", enabled=False):
        model(idx, idx)
    handle.remove()
    return box["input"]


def test_a_replay_is_priced_and_nothing_of_training_is_touched(monkeypatch):
    """A fake clock that advances one second each time the block's attention runs (forward or replay): a mode's
    price is exactly its replay, whatever the machine's load (a verdict on measured times would hang on noise)."""
    from lightning_ckpt.decide import block_timing

    model = _gpt()
    plan = apply_policy(model, "none")
    clock = {"now": 0.0}
    monkeypatch.setattr(block_timing, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    idx = torch.randint(0, 96, (4, 128), generator=torch.Generator().manual_seed(1))
    block_input = _captured(model, idx)
    last = plan.num_blocks - 1
    seen = []

    def set_mode(mode):
        seen.append(mode)
        plan.set_modes(["off"] * last + [mode])

    model(idx, idx)[1].backward()  # mid-way through gradient accumulation: .grad holds the window's sum so far
    accumulated = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    tick = plan.blocks[last].attn.register_forward_pre_hook(lambda *_: clock.update(now=clock["now"] + 1.0))
    seconds = time_block_modes(plan.blocks[last], set_mode, block_input, ("recompute", "selective"), repeats=5)
    tick.remove()
    # off runs the attention once; both checkpointed modes replay the block's forward (selective skips the saved
    # ops, not the Python) in backward: one second more each
    assert seconds == {"recompute": 1.0, "selective": 1.0}
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), accumulated))  # accumulation untouched
    assert torch.equal(torch.get_rng_state(), rng)  # dropout in training draws what it would have drawn
    assert plan.modes == ("off",) * plan.num_blocks and seen[-1] == "off"
    assert {"off", "recompute", "selective"} <= set(seen)


def test_the_training_steps_autocast_is_captured_and_reentered():
    model = _gpt(n_embd=32, block_size=16)
    idx = torch.randint(0, 96, (2, 16))
    plain = _captured(model, idx)
    mixed = _captured(model, idx, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
    assert plain.autocast is None and mixed.autocast == (torch.bfloat16, False)
    with mixed.context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert mixed.args[0].dtype == torch.float32 and not mixed.args[0].requires_grad  # a detached copy
    args, _ = mixed.fresh()
    assert args[0].requires_grad and args[0].grad_fn is None  # a new leaf per call


class _Counting:
    """AOTAutograd with the min-cut partitioner: counts the forward and the backward graphs it runs."""

    def __init__(self):
        self.forward_calls = self.backward_calls = 0

        def forward_compiler(gm, _):
            def run(*args):
                self.forward_calls += 1
                return gm(*args)

            return run

        def backward_compiler(gm, _):
            def run(*args):
                self.backward_calls += 1
                return gm(*args)

            return run

        self.backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                                    partition_fn=min_cut_rematerialization_partition)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_with_compiled_blocks_the_calibration_prices_modes_on_the_compiled_graphs(precision, monkeypatch):
    from lightning_ckpt.decide import block_timing

    timed_under = []
    real = block_timing.time_block_modes

    def spy(call, set_mode, block_input, *args, **kwargs):
        timed_under.append(block_input.autocast)
        return real(call, set_mode, block_input, *args, **kwargs)

    monkeypatch.setattr(block_timing, "time_block_modes", spy)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=precision == "bf16-mixed")
    model = _gpt(n_layer=4, n_embd=32, block_size=32, dropout=0.0)
    counting = _Counting()
    plan = apply_policy(model, "none")
    for block in model.transformer.h:
        block.compile(backend=counting.backend)
    idx = torch.randint(0, 96, (2, 32))
    meter = StepMeter("cpu", model=model)
    calibration = BudgetCalibration(plan, meter, budget=2**40, block_caller=lambda block: block, repeats=2)
    assert [kind for _, _, kind in calibration.stages] == ["bytes"] * 5  # no time steps: blocks are timed alone
    while calibration.calibrating:
        calibration.begin_step()
        before = counting.forward_calls
        with meter.step(exact=calibration.exact_step, eager=True) as box:
            with autocast:  # Lightning's bf16-mixed: autocast around the forward, weight cache off
                loss = model(idx, idx)[1]
            loss.backward()
        assert counting.forward_calls == before  # the bytes steps run eagerly (block hooks see them)
        last_stage = len(calibration.stages) - 1 == calibration.stage
        calls = counting.forward_calls, counting.backward_calls
        calibration.end_step(int(box.reading.activations))
    # the last end_step timed one block per class, compiled: 3 modes x (1 untimed + 2 timed) forward and backward
    assert last_stage and counting.forward_calls - calls[0] == 9 and counting.backward_calls - calls[1] == 9
    assert timed_under == [(torch.bfloat16, False) if precision == "bf16-mixed" else None]  # the step's autocast
    assert set(calibration.block_seconds) == {"Block"}
    assert set(calibration.block_seconds["Block"]) == {"recompute", "selective"}
    costs = calibration.costs()
    assert costs[0].recompute_s == calibration.block_seconds["Block"]["recompute"]
    assert costs[0].selective_s == calibration.block_seconds["Block"]["selective"]
    assert calibration.chosen is not None and calibration.chosen.modes == ("off",) * 4  # a budget nothing exceeds
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
@needs_compiler_budget
def test_saved_block_bytes_sees_what_the_compiled_graph_keeps():
    model = _gpt(n_layer=2, n_embd=32, block_size=32, dropout=0.0)
    plan = apply_policy(model, "none")
    block = model.transformer.h[-1]
    block.compile(backend="aot_eager")
    idx = torch.randint(0, 96, (2, 32))
    block_input = _captured(model, idx)

    def set_mode(mode):
        plan.set_modes(["off", mode])

    kept = saved_block_bytes(block, set_mode, block_input, ("off", "compiler:0.5", "compiler:0", "recompute"),
                             list(block.parameters()))
    assert plan.modes == ("off", "off")
    assert kept["off"] > kept["compiler:0.5"] > kept["compiler:0"] == kept["recompute"] == 0  # input not counted
    meter = StepMeter("cpu", model=model)
    with meter.step(exact=True) as box:
        model(idx, idx)[1].backward()
    assert kept["off"] < box.reading.activations  # one block compiled keeps less than the whole model eagerly


@pytest.mark.slow
@needs_compiler_budget
@pytest.mark.timeout(300)
def test_the_compilers_budgets_are_priced_measured_and_verified_against_the_eager_reference():
    """With ``compiler_fractions`` the calibration prices and measures ``compiler:<f>`` on the compiled block; an
    eager step runs those blocks as ``off``, so what they save compiled (:meth:`compiled_savings`) is known apart."""
    model = _gpt(n_layer=4, n_embd=32, block_size=32, dropout=0.0)
    plan = apply_policy(model, "none")
    for block in model.transformer.h:
        block.compile(backend="aot_eager")
    idx = torch.randint(0, 96, (2, 32))
    meter = StepMeter("cpu", model=model)
    calibration = BudgetCalibration(plan, meter, budget=1, modes=("selective",), block_caller=lambda block: block,
                                    repeats=2, compiler_fractions=(0.0, 0.5))

    def step():  # as the callback steps: an eager figure, less what the plan's compiler blocks save compiled
        calibration.begin_step()
        with meter.step(exact=True, eager=True) as box:
            model(idx, idx)[1].backward()
        assert box.reading.eager_figure
        calibration.end_step(int(box.reading.activations) - calibration.compiled_savings(plan.modes))
        return int(box.reading.activations)

    while calibration.calibrating:
        step()
    kept = calibration.compiled_kept["Block"]
    assert set(kept) == {"off", "compiler:0", "compiler:0.5"} and kept["off"] > kept["compiler:0.5"] > 0
    assert {"selective", "compiler:0", "compiler:0.5"} == set(calibration.block_seconds["Block"])
    cost = calibration.costs()[1]
    options = {o.mode: o for o in cost.options(("off", "compiler"))}
    assert options["compiler:0"].kept == cost.boundary
    assert options["compiler:0.5"].kept == cost.boundary + round(cost.interior * kept["compiler:0.5"] / kept["off"])
    chosen = calibration.chosen  # budget 1 byte: the lowest peak, the compiler's full-recompute budget
    assert not chosen.fits and chosen.modes[:3] == ("compiler:0",) * 3
    savings = calibration.compiled_savings(chosen.modes)
    assert savings > 0 and calibration.compiled_savings(("off", "selective", "off", "off")) == 0
    eager = step()  # the plan's reference step, eager: the compiler blocks run as off
    assert calibration.measured == eager - savings and calibration.done
    assert calibration.chosen is chosen  # it could not fit: no correction
