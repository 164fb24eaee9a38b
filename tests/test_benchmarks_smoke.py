"""Smoke test for ``benchmarks/policies.py``: the quick configuration runs and writes sane JSON.

The benchmark itself is a script (``benchmarks/`` is never collected); this runs it as a subprocess so the
script's own ``sys.path`` handling and exit status are exercised exactly as a user would run it.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from _torch_features import needs_compiler_budget

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "policies.py"
POLICIES = ("none", "every:2", "group:sqrt", "selective", "all", "offload")

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_policies_quick_json(tmp_path):
    out = tmp_path / "policies.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170,
    )
    tail_out, tail_err = proc.stdout[-4000:], proc.stderr[-4000:]
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{tail_out}\nstderr:\n{tail_err}"
    assert "command:" in proc.stdout and "torch " in proc.stdout

    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    for policy in POLICIES:
        assert policy in rows, f"no row for {policy!r}; rows: {sorted(rows)}"
        assert rows[policy]["act_peak_bytes"] > 0, rows[policy]
        assert rows[policy]["step_s_median"] > 0, rows[policy]
    assert rows["all"]["act_peak_bytes"] < rows["none"]["act_peak_bytes"]
    # checkpointing computes the same function: bitwise-equal gradients on CPU in float32
    for policy in POLICIES:
        assert rows[policy]["grad_max_abs_diff"] == 0.0, (policy, rows[policy]["grad_max_abs_diff"])
    # the tracker's self-check on a hand-computed chain is part of every run
    assert all(abs(r["measured"] - r["expected"]) < 1e-3 for r in data["tracker_check"])
    names = {t["name"] for t in data["targets"]}
    assert any(n.startswith("all: activation peak") for n in names)


def _frontier(tmp_path, *args, timeout):
    """Run ``benchmarks/frontier.py`` on the GPT in float32 with ``args``; its stdout and its one case (JSON)."""
    out = tmp_path / "frontier.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--quick", "--models", "gpt", "--precisions",
         "32-true", *args, "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (case,) = json.loads(out.read_text())
    return proc.stdout, case


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frontier_quick_json(tmp_path):
    """``benchmarks/frontier.py --quick`` on the GPT in float32: ``budget:`` through the callback at 25, 50 and 75 %
    between ``all`` and ``none``, every step within the budget (calibration included, as the callback's report says),
    a verdict with its ratio per budget beside the calibration's steps and the pricing time (the speed targets are
    read from the full run, not asserted here)."""
    stdout, case = _frontier(tmp_path, timeout=290)
    act = case["activations"]
    assert {"none", "all", "selective", "every:2", "first:1", "first:3"} <= set(act) and act["all"] < act["none"]
    assert {"none", "all"} <= set(case["anchors"])
    assert [r["position"] for r in case["rows"]] == [0.25, 0.5, 0.75]
    for row in case["rows"]:
        assert act["all"] < row["budget"] < act["none"]
        report = row["report"]
        assert 0 < report["worst_step"] <= row["budget"] and report["worst_step_ratio"] <= 1.0, row
        assert report["calibration_steps"] >= 5 and report["pricing_s"] >= 0, report
        assert row["fastest"] in row["fitting"] and row["ratio"][0] > 0, row
        assert row["verdict"].split()[0] in ("PASS", "MISS") and isinstance(row["same_plan"], bool), row
        assert row["fixed_activations"] <= row["budget"], row  # the plan, run fixed, fits too
    for word in ("worst step / budget", "calib", "pricing", "ours / the same plan fixed", "Megatron block"):
        assert word in stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_budget_quick_prints_a_verdict_per_budget_with_its_number(tmp_path):
    out = tmp_path / "budget.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "budget.py"), "--quick", "--models", "llama", "--positions", "0.5",
         "--instances", "2", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=190,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())
    (row,) = case["rows"]
    assert case["model"] == "llama" and row["report"]["worst_step_ratio"] <= 1.0
    ratio = f"{row['ratio'][0]:.3f}"
    assert f"{'PASS' if row['ratio'][0] <= 1.0 else 'MISS'} " in row["verdict"] and ratio[:4] in row["verdict"]
    assert row["verdict"] in proc.stdout and "summary: " in proc.stdout
    # every configuration of the verdict ran in two Trainers, ours calibrated in each; a round's time is their mean
    assert case["instances"] == row["instances"] == 2 and len(row["calibrations"]) == len(row["reports"]) == 2
    assert len(row["instance_modes"]) == len(row["instance_ratios"]) == 2
    for name in ("ours", "fixed", row["fastest"], "twin"):
        assert [len(t) for t in row["instance_times"][name]] == [case["rounds"]] * 2, name
    assert row["instance_times"]["ours"] == [row["times"][n] for n in ("budget 50%", "budget 50% #2")]
    assert all(rep["worst_step_ratio"] <= 1.0 for rep in row["reports"])
    assert "each configuration in 2 Trainers" in proc.stdout


@pytest.mark.slow
@needs_compiler_budget
@pytest.mark.timeout(400)
def test_frontier_compiled_rows_at_block_grain(tmp_path):
    """``--compile block``: our plan comes from the calibration run on the per-block compiled model (modes priced on
    compiled blocks), both variants' peaks come from the CPU allocator, and the budgets are re-spaced in its units
    between eager ``all`` and ``none`` (the compiled ends are recorded beside them)."""
    _, case = _frontier(tmp_path, "--budgets", "2", "--micro-batch", "4", "--compile", "block", timeout=390)
    rows = case["compiled"]
    assert [r["grain"] for r in rows] == ["block", "block"] and [r["budget"] for r in rows] == case["compiled_budgets"]
    # block by block, the compiler's budget per block is a mode too (engine.fit_start offers it there)
    assert set(rows[0]["block_seconds"]["Block"]) == {"recompute", "selective", "compiler:0", "compiler:0.25",
                                                      "compiler:0.5", "compiler:0.75"}
    low, high = rows
    assert low["allocator_budget"] < high["allocator_budget"] and low["fraction"] < high["fraction"] == 1.0
    ends = low["eager_ends"]  # a budget stands for a card: spaced between the eager ends, compiled or not
    assert (low["allocator_budget"], high["allocator_budget"]) == (ends["all"], ends["none"])
    assert low["ours_peak"] == pytest.approx(low["compiled_ends"]["all"], rel=0.05)  # our plan there: compiled all
    # all's budget: every block keeps only its input (a recompute, or the compiler's budget 0, priced alike)
    assert set(low["modes"]) <= {"recompute", "compiler:0"}
    assert low["ours_fits"] and high["ours_fits"] and high["compile_fits"]
    assert low["ours_peak"] < high["ours_peak"] and low["compile_peak"] < high["compile_peak"]
    for row in rows:
        assert row["verdict"].split()[0] in ("PASS", "TIE", "MISS"), row


@pytest.mark.slow
@needs_compiler_budget
@pytest.mark.timeout(400)
def test_frontier_compiled_rows_for_a_whole_model_compile_split_by_compile_blocks(tmp_path):
    """``--compile split``: the compiler's budget runs the user's whole-model graph, our plan the same model split
    into per-block graphs (``compile_blocks=True``), with the compiler's budget per block among its modes; at
    ``all``'s budget ours keeps what per-block ``all`` keeps, and the whole-model graph at the same fraction holds
    more."""
    stdout, case = _frontier(tmp_path, "--budgets", "2", "--micro-batch", "4", "--compile", "split", timeout=390)
    assert "split, compile_blocks=True, for ours" in stdout
    low, high = case["compiled"]
    assert low["grain"] == high["grain"] == "split"
    assert {"compiler:0", "compiler:0.5"} <= set(low["block_seconds"]["Block"])
    assert low["ours_peak"] == pytest.approx(low["compiled_ends"]["all"], rel=0.05) and low["ours_fits"]
    assert low["compile_peak"] > low["ours_peak"]  # one whole-model graph holds more at the tightest budget
    assert low["compile_peak"] < high["compile_peak"]


def _benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module (it puts ``benchmarks/`` on ``sys.path`` itself)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_lightning_ckpt_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_budget_benchmark_never_prints_a_miss_as_one():
    """A miss is reported as a miss with its number: a ratio a hair above 1.00 gets the digits that show it."""
    budget = _benchmark("budget")
    assert budget.verdict(1.0) == "PASS 1.000" and budget.verdict(0.9871) == "PASS 0.987"
    assert budget.verdict(1.0004) == "MISS 1.0004" and budget.verdict(1.0123) == "MISS 1.012"
    assert budget.anchor_policies(4) == ["none", "all", "selective", "every:2", "first:1", "first:2", "first:3"]
    assert budget.framework_name("first:3") == "Megatron block 3" and budget.mix(["off", "recompute", "off"]) == \
        "2 off, 1 recompute"



def test_a_miss_within_the_noise_is_still_a_miss_with_its_interval_beside_it():
    """Rounds whose ratios straddle 1.00 give a median above it (a MISS) whose bootstrap interval holds 1.00: said
    beside the MISS, which stays one; rounds all clearly above give an interval above 1.00 (a plain MISS)."""
    budget, trainer = _benchmark("budget"), _benchmark("_trainer")
    straddling = [1.03, 0.97, 1.02, 0.99, 1.04, 0.98, 1.01]
    low, high = trainer.instances_interval([straddling], [[1.0] * len(straddling)])
    assert low < 1.0 < high
    row = dict(verdict=budget.verdict(1.01), ratio_interval=(low, high))
    assert row["verdict"] == "MISS 1.010" and budget.within_noise(row)
    clear = trainer.instances_interval([[1.05, 1.06, 1.04, 1.07, 1.05]], [[1.0] * 5])
    assert clear[0] > 1.0 and not budget.within_noise(dict(verdict="MISS 1.050", ratio_interval=clear))
    assert not budget.within_noise(dict(verdict="PASS 0.990", ratio_interval=(0.95, 1.02)))


def test_the_anchor_that_runs_our_plan_is_timed_whatever_its_screening():
    """A budget's verdict times the screening's fastest anchors and, after them, every fitting anchor that runs one
    of our Trainers' plans: the anchor ours equals is never left out by a few noisy screening rounds."""
    budget = _benchmark("budget")
    modes = {"every:2": ("recompute", "off") * 2, "first:2": ("recompute",) * 2 + ("off",) * 2,
             "all": ("recompute",) * 4, "first:1": ("recompute",) + ("off",) * 3}
    ours = [("recompute", "recompute", "off", "off"), ("recompute", "off", "recompute", "off")]
    assert budget.with_our_plans(["all"], ["every:2", "first:2", "all"], modes, ours) == ["all", "every:2", "first:2"]
    assert budget.with_our_plans(["first:2"], ["first:1", "first:2"], modes, ours[:1]) == ["first:2"]
    assert budget.with_our_plans(["all"], ["all"], modes, ours) == ["all"]  # first:2 does not fit: not timed


def test_a_configuration_in_several_trainers_is_compared_over_every_pair_of_them():
    """Each Trainer's own bias averages out (the geometric mean over pairs: a Trainer reading 2 x ours and one 0.5 x
    give 1.00), a slow step is the median's (one 9 x round leaves the ratio at 1.00), and with one Trainer each the
    ratio and its interval are those of the per-round ratios."""
    trainer = _benchmark("_trainer")
    assert trainer.instances_ratio([[2.0, 2.0, 2.0]], [[1.0, 1.0, 1.0], [4.0, 4.0, 4.0]]) == pytest.approx(1.0)
    assert trainer.instances_ratio([[1.0, 1.0, 9.0], [3.0, 3.0, 3.0]], [[1.0] * 3, [3.0] * 3]) == pytest.approx(1.0)
    assert trainer.instances_ratio([[1.0, 1.0, 9.0]], [[1.0] * 3]) == pytest.approx(1.0)
    ours, theirs = [1.03, 0.97, 1.02, 0.99, 1.04], [1.0] * 5
    assert trainer.instances_ratio([ours], [theirs]) == pytest.approx(1.02)
    rng, ratios = random.Random(0), [a / b for a, b in zip(ours, theirs)]  # one Trainer each: the rounds' bootstrap
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    assert trainer.instances_interval([ours], [theirs]) == pytest.approx((medians[50], medians[1949]))
    low, high = trainer.instances_interval([ours, [x * 0.9 for x in ours]], [theirs, theirs])
    assert low <= trainer.instances_ratio([ours, [x * 0.9 for x in ours]], [theirs, theirs]) <= high < 1.02


def test_grouped_rounds_step_every_member_once_in_a_new_order_each_round():
    """``interleave_groups``: every member of a group steps once a round (a runner in two groups once in each), each
    group's order changes from round to round (rotated, a runner would keep its neighbours), seeded."""
    trainer = _benchmark("_trainer")

    class Fake:
        def __init__(self, name, log):
            self.name, self.cpu, self.log = name, [], log

        def run(self, steps):
            self.log.append(self.name)
            self.cpu.append(0.01)
            return [0.1 * steps]

    def schedule(seed):
        log = []
        shared = Fake("s", log)
        groups = {"a": [Fake(f"a{i}", log) for i in range(4)] + [shared], "b": [Fake("b0", log), shared]}
        wall, _ = trainer.interleave_groups(groups, rounds=6, warmup=1, seed=seed)
        assert all(len(times) == 6 for g in wall.values() for times in g.values())
        return log

    log = schedule(0)
    assert len(log) == 7 * (5 + 2) and log.count("s") == 14
    rounds_a = [[n for n in log[i:i + 7] if n.startswith("a") or n == "s"] for i in range(0, len(log), 7)]
    assert len({tuple(r) for r in rounds_a}) > 3  # the order inside the group changes
    assert schedule(0) == log and schedule(1) != log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_trainer_runners_take_turns_one_step_at_a_time():
    """``benchmarks/_trainer.py``: several Trainer fits in one process, stepped from the main thread: no two steps
    overlap in time, each round runs every runner, and the callback's measured activation figure is read."""
    trainer = _benchmark("_trainer")
    trainer.quiet()
    from lightning_ckpt.demos import GPTLightningModule

    module = GPTLightningModule(n_layer=2, n_embd=32, n_head=2, block_size=16, dropout=0.0)
    batch = module.example_batch(2, 16)
    runners = [trainer.Runner(p, module, lambda i: batch, dict(policy=p)) for p in ("none", "all")]
    wall, cpu = trainer.interleave(runners, rounds=3, warmup=1)
    assert all(len(wall[r.name]) == len(cpu[r.name]) == 3 and len(r.times) == 4 for r in runners)
    spans = sorted(s for r in runners for s in r.spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one step at a time
    none, full = (trainer.measured_activations(r) for r in runners)
    assert 0 < full < none and runners[1].modes[-1] == ("recompute", "recompute")
    assert not runners[0].calibrating
    for r in runners:
        r.finish()
    assert runners[0].report_json()["policy"] == "none"


def test_compile_benchmark_leaves_gradient_buffers_out_of_the_activation_peak():
    """``benchmarks/compile.py``'s instrument (``_common.allocation_peaks``, shared with ``frontier.py``): a 4 MiB
    weight gradient accumulated into a kept ``.grad`` is in the step peak and not in the activation peak; the saved
    activations (a 32 KiB hidden state) are in both."""
    import torch

    bench = _benchmark("compile")
    torch.manual_seed(0)
    first, second = torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1, bias=False)
    x = torch.randn(8, 1024)

    def step():
        hidden = torch.relu(first(x))  # 32 KiB kept for backward
        second(hidden).sum().backward()

    params = [first.weight, second.weight]
    step()  # .grad allocated and kept from now on: the next backward accumulates into it
    step_peak, activation_peak = bench.C.allocation_peaks(step, params)
    KiB = 2**10
    assert 4096 * KiB <= step_peak < 4096 * KiB + 256 * KiB, step_peak
    assert 32 * KiB <= activation_peak < 256 * KiB, activation_peak
    for p in params:  # the hooks are removed
        assert not p._backward_hooks


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [["--model", "gpt2"], ["--log-every", "3"]], ids=["host gpt2", "interval 3"])
def test_overhead_host_and_interval_runs_follow_the_schedule_and_write_their_verdict(tmp_path, extra):
    """``--host`` keeps the model's structure with its arithmetic shrunk and judges host time per measured step;
    ``--log-every N`` measures one step in each block of N (the script asserts that schedule itself)."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--host", "--rounds", "2", "--json", str(out),
         *extra],
        cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    n = int(extra[1]) if extra[0] == "--log-every" else 1
    assert data["host"] and data["log_every"] == n and len(data["step_s"]) == (4 + 4 * 2) * n
    if n == 1:  # the host-time verdict, against the model's own target
        assert data["host_target_ms"] == 3.0 and "host time added per measured step" in proc.stdout
        assert "Hugging Face GPT-2 2x64" in proc.stdout
    else:  # at an interval the verdict is the step-time ratio
        assert data["host_target_ms"] is None and data["target"] == 1.02


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shapes_quick_compares_the_three_ways_and_writes_every_verdicts_figure(tmp_path):
    out = tmp_path / "shapes.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "shapes.py"), "--quick", "--models", "gpt", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=290,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a MISS (--quick is noise)
    (case,) = json.loads(out.read_text())
    assert set(case["tokens_per_s"]) == {"per shape", "one plan", "anchor", "none"} and case["ceiling"] > 0
    assert 0 < case["worst"] <= case["budget"] and case["rows"] and 0 < case["curriculum"]["peak"] <= case["budget"]
    assert case["calibration_steps"] and case["report"]["calibration_steps"] == case["calibration_steps"]
    errors = [r["error"] for r in case["rows"] if r["error"] is not None]
    assert errors and all(abs(e) < 0.05 for e in errors)  # CPU: the trace is the meter's own count
    for word in ("(a)/(c) tokens/s", "largest step (the callback's figure", "prediction error", "curriculum"):
        assert word in proc.stdout


@pytest.mark.timeout(120)
def test_plan_model_times_and_weighs_the_command_a_user_types():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_model.py"), "--factory",
         "lightning_ckpt.demos.factories:gpt2_config", "--seq-len", "64"],
        cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "try first" in proc.stdout
    for name in ("wall time", "peak memory"):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert "target <" in line and line.split()[-1] in ("PASS", "MISS")
