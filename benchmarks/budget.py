"""Speed is not the price of safety (issue 33): ``budget:`` run as a user runs it, against the fastest fixed policy
that fits, at 25, 50 and 75 % of the way from ``all`` to ``none``.

Everything goes through the public API, in one process: every configuration is a ``lightning.Trainer`` fitting its
own copy of the model (same weights, same batch) with ``ActivationCheckpointing(policy=...)`` and the callback's
defaults, stepped one step at a time from the main thread (``benchmarks/_trainer.py``), so the steps of all
configurations interleave (A/B/A/B, the order changed every round).

1. **Anchors**: the fixed policies ``none``, ``all``, ``selective``, ``every:N`` (N = 2 … L/2) and ``first:K``
   (K = 1 … L-1). Each runs two steps with every step measured; its activation bytes are the callback's own figure
   of the second (``callback.last_metrics["memory/activations_gib"]``: the figure the budget is about).
2. **Budgets**: ``all + p × (none − all)`` for p in ``--positions`` (default 0.25, 0.5, 0.75), in bytes.
3. **Ours**: ``ActivationCheckpointing(policy="budget:<bytes>")``, stepped until its calibration is over (the
   calibration's steps are counted and timed apart, never in the verdict), then one more step.
4. **The same plan, fixed**: ``policy="modes:<the plan ours runs>"``: the plan without the budget's machinery, so
   that a difference splits into the plan's choice (fixed / anchor) and the callback's own per-step work
   (ours / fixed).
5. **Screening**: one untimed round, then ``--screen`` rounds of one step each for every configuration; per budget,
   the ``--candidates`` fitting anchors with the lowest median go on, and any fitting anchor that runs one of our
   plans (three screening rounds can leave out the anchor ours equals).
6. **Verdict**: every configuration of it runs in ``--instances`` Trainers (default 3), because here the same
   computation in two Trainers reads a few per cent apart, round after round (a Trainer's own bias, not noise that
   more rounds average away); ours is calibrated in each of its Trainers. ``--rounds`` rounds in which, budget by
   budget, ours, the same plan fixed, those candidates and as many more Trainers of the first candidate (its *twin*:
   the same computation, whose ratio to it is the noise floor printed beside the verdict) run one step each back to
   back (in an order shuffled every round, seeded), so that the steps compared are seconds apart. A configuration's
   step is the mean over its Trainers of each one's median; the fastest fitting anchor is the candidate with the
   lowest. The ratio: for every pair of one of our Trainers and one of that anchor's, the median over rounds of ours
   / theirs in the same round; their geometric mean (``_trainer.instances_ratio``). Process CPU seconds are compared
   alike and printed beside (less sensitive to other processes on a shared machine).

Verdict per budget: **PASS** when that ratio is ≤ 1.00, else **MISS** with its number; beside a MISS, its
95 % bootstrap interval over the rounds, and whether that interval still holds 1.00 (a MISS this run cannot tell
from a tie: still counted a MISS). Printed beside it:
the worst step's activations against the budget (calibration included; the end-of-fit report's ``budget`` figures),
the calibration's length in steps and seconds, and the time spent pricing shapes on fake tensors.

    python benchmarks/budget.py                       # demo GPT and HF Llama, 6 x 256, micro-batch 4 x 256
    python benchmarks/budget.py --models gpt --rounds 11
    python benchmarks/budget.py --quick               # 4 x 128, micro-batch 2 x 128, 2 rounds (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _trainer as T  # noqa: E402
from _common import header_lines, load_average  # noqa: E402

MiB = 2**20
TARGET = 1.00
FRAMEWORK = {"all": "torchtitan full"}  # the other frameworks' name for the same fixed plan (frontier.py prints it)


def build(name: str, layers: int, width: int, seq: int, vocab: int = 512):
    """The demo GPT or a Hugging Face Llama built from its config (no download), dropout off."""
    from lightning_ckpt.demos import GPTLightningModule, HFCausalLMModule

    torch.manual_seed(0)
    if name == "gpt":
        return GPTLightningModule(n_layer=layers, n_embd=width, n_head=8, block_size=seq, dropout=0.0,
                                  vocab_size=vocab)
    if name == "llama":
        return HFCausalLMModule(arch="llama", n_layer=layers, n_embd=width, n_head=8, n_positions=seq,
                                vocab_size=vocab, dropout=0.0)
    raise ValueError(f"--models: unknown model {name!r}; choose among 'gpt' and 'llama'.")


def anchor_policies(blocks: int) -> List[str]:
    """The fixed anchor policies for a model of ``blocks`` blocks (``none`` first: the reference)."""
    return (["none", "all", "selective"] + [f"every:{n}" for n in range(2, blocks // 2 + 1)]
            + [f"first:{k}" for k in range(1, blocks)])


def framework_name(policy: str) -> str:
    """The anchor's name in the frameworks that ship it (torchtitan, Megatron, Hugging Face), where one does."""
    if policy.startswith("first:"):
        return f"Megatron block {policy[6:]}"
    if policy.startswith("every:"):
        return f"HF every_n_layers={policy[6:]}"
    return FRAMEWORK.get(policy, "")


def mix(modes: Sequence[str]) -> str:
    """``('off', 'recompute', 'recompute')`` → ``'1 off, 2 recompute'``."""
    counts = Counter(modes)
    return ", ".join(f"{counts[m]} {m}" for m in sorted(counts, key=lambda m: (m != "off", m)))


def _ratio_text(value: float) -> str:
    """A ratio with enough digits that a miss never reads as 1.000."""
    text = f"{value:.3f}"
    return f"{value:.4f}" if value > TARGET and float(text) <= TARGET else text


def verdict(ratio: float) -> str:
    return f"{'PASS' if ratio <= TARGET else 'MISS'} {_ratio_text(ratio)}"


def within_noise(row: Dict[str, Any]) -> bool:
    """A MISS whose ratio's 95 % interval (bootstrap over the rounds) still holds the target: this run cannot tell
    it from a tie. Reported beside the MISS, never instead of it."""
    low, high = row.get("ratio_interval") or (None, None)
    return row["verdict"].startswith("MISS") and low is not None and low <= TARGET <= high


def calibrated_seconds(budget_plan: Dict[str, Any]) -> Dict[str, float]:
    """The seconds per block that the calibration priced each mode of the chosen plan at (the report's
    ``budget_plan``: each block's mode and seconds added over ``off``), averaged over the blocks of that mode."""
    by_mode: Dict[str, List[float]] = {}
    for block in budget_plan.get("blocks", []):
        if block.get("seconds") is not None and block["mode"] != "off":
            by_mode.setdefault(block["mode"], []).append(block["seconds"])
    return {mode: statistics.mean(v) for mode, v in by_mode.items()}


def anchor_seconds(res: Dict[str, Any]) -> Dict[str, float]:
    """Seconds a block adds per mode, read off the anchors' screening medians: (T(all) − T(none)) / L for
    ``recompute``, (T(selective) − T(none)) / L for ``selective``."""
    a, blocks = res["anchors"], res["blocks"]
    out = {}
    for mode, policy in (("recompute", "all"), ("selective", "selective")):
        if policy in a and "none" in a:
            out[mode] = (a[policy]["median_s"] - a["none"]["median_s"]) / blocks
    return out


def measure_anchor(runner: T.Runner) -> int:
    """Two steps, both measured; the callback's activation figure of the second."""
    trainer = runner.trainer
    every, trainer.log_every_n_steps = trainer.log_every_n_steps, 1
    try:
        runner.run(2)
    finally:
        trainer.log_every_n_steps = every
    value = T.measured_activations(runner)
    if value is None:
        raise RuntimeError(f"{runner.name}: the callback measured no step; is measure=True?")
    return value


def instance_name(name: str, i: int) -> str:
    """The ``i``-th Trainer of a configuration: ``first:3``, ``first:3 #2``, …"""
    return name if i == 0 else f"{name} #{i + 1}"


def per_trainer(times: Dict[str, List[float]], members: Sequence[T.Runner]) -> List[List[float]]:
    """A configuration's seconds per round, one list per Trainer of it."""
    return [times[r.name] for r in members]


def compare(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> tuple:
    """Ours / theirs over their Trainers (``_trainer.instances_ratio``: a Trainer's own bias averages over them), and
    the range of the per-round ratios of every pair."""
    ratios = [a / b for o in ours for t in theirs for a, b in zip(o, t)]
    return T.instances_ratio(ours, theirs), min(ratios), max(ratios)


def typical(times: Sequence[Sequence[float]]) -> float:
    """A configuration's step: the mean over its Trainers of each one's median over rounds."""
    return statistics.fmean(statistics.median(t) for t in times)


def with_our_plans(screened: Sequence[str], fitting: Sequence[str], modes: Dict[str, tuple],
                   plans: Sequence[tuple]) -> List[str]:
    """The anchors timed for a budget's verdict: the screening's fastest, then every fitting anchor that runs one of
    our plans (a few screening rounds can leave out the very anchor ours equals)."""
    return [*screened, *(p for p in fitting if modes[p] in plans and p not in screened)]


def calibrate(r: T.Runner, limit: int) -> Dict[str, Any]:
    """Step ``r`` until its calibration is over (at most ``limit`` steps), then once more: its steps and seconds."""
    t0 = time.perf_counter()
    while r.calibrating and len(r.times) < limit:
        r.run(1)
    done = dict(steps=len(r.times), step_seconds=sum(r.times), wall=time.perf_counter() - t0, over=r.calibrating)
    r.run(1)  # the first step after the calibration: its plan, to be run fixed beside it
    return done


def worst_report(reports: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Of the end-of-fit reports' ``budget`` figures of a budget's Trainers, the one with the worst step."""
    return max(reports, key=lambda rep: rep.get("worst_step_ratio") or 0.0)


def run_case(model_name: str, args, precision: str = "32-true", log: Callable[[str], None] = print
             ) -> Dict[str, Any]:
    module = build(model_name, args.layers, args.width, args.seq)
    batch = module.example_batch(args.micro_batch, args.seq)
    blocks, k = len(T.block_names(module)), args.instances

    def get(i: int):
        return batch

    def runner(name: str, policy: str) -> T.Runner:
        return T.Runner(name, module, get, dict(policy=policy), precision=precision)

    log(f"\n{model_name}: {blocks} blocks x {args.width}, micro-batch {args.micro_batch} x {args.seq}, {precision}; "
        f"{k} Trainer(s) per configuration in the verdict; load average {load_average()}")
    anchors = {p: runner(p, p) for p in anchor_policies(blocks)}
    act = {p: measure_anchor(r) for p, r in anchors.items()}
    low, high = act["all"], act["none"]
    budgets = {pos: round(low + pos * (high - low)) for pos in args.positions}
    loosest = max(budgets.values())
    for p in [p for p in anchors if p != "none" and act[p] > loosest]:  # fits no budget: not timed
        anchors.pop(p).finish()

    ours: Dict[float, List[T.Runner]] = {}
    calibration: Dict[float, List[Dict[str, Any]]] = {}
    for pos, budget in budgets.items():
        ours[pos] = [runner(instance_name(f"budget {pos:.0%}", i), f"budget:{budget}") for i in range(k)]
        calibration[pos] = [calibrate(r, args.max_calibration) for r in ours[pos]]
        log(f"  budget {pos:.0%} = {budget / MiB:.2f} MiB: calibrated in "
            f"{', '.join(str(c['steps']) for c in calibration[pos])} steps "
            f"({', '.join(format(c['step_seconds'], '.1f') for c in calibration[pos])} s); plan "
            + " / ".join(mix(r.modes[-1]) for r in ours[pos]))
    fixed = {pos: [runner(instance_name(f"fixed {pos:.0%}", i), "modes:" + ",".join(r.modes[-1]))
                   for i, r in enumerate(rs)] for pos, rs in ours.items()}
    for r in (r for rs in fixed.values() for r in rs):
        r.run(1)  # the first step is measured: the plan's own activation figure
    fixed_act = {pos: max(T.measured_activations(r) or 0 for r in rs) or None for pos, rs in fixed.items()}

    everyone = [*anchors.values(), *(r for rs in ours.values() for r in rs), *(r for rs in fixed.values() for r in rs)]
    start = {r.name: len(r.times) for r in everyone}
    # screening: every configuration, one step a round; the candidates per budget are its fastest fitting anchors
    screen, _ = T.interleave(everyone, args.screen, warmup=1)
    candidates = {pos: sorted((p for p in anchors if act[p] <= budget), key=lambda p: statistics.median(screen[p]))
                  [:args.candidates] for pos, budget in budgets.items()}
    modes = {p: tuple(r.modes[-1]) for p, r in anchors.items()}
    candidates = {pos: with_our_plans(candidates[pos], [p for p in anchors if act[p] <= budget], modes,
                                      [tuple(r.modes[-1]) for r in ours[pos]]) for pos, budget in budgets.items()}
    # each candidate in k Trainers; the noise floor: the likeliest fastest candidate in k Trainers more
    timed = {p: [anchors[p], *(runner(instance_name(p, i), p) for i in range(1, k))]
             for p in dict.fromkeys(p for c in candidates.values() for p in c)}
    twins = {pos: [runner(instance_name(f"{c[0]} twin {pos:.0%}", i), c[0]) for i in range(k)]
             for pos, c in candidates.items() if c}
    for r in [*(r for rs in timed.values() for r in rs[1:]), *(r for rs in twins.values() for r in rs)]:
        r.run(2)
    # the verdict: per budget, ours, the same plan fixed, those candidates and the twin, back to back in every round
    configs = {pos: {"ours": ours[pos], "fixed": fixed[pos], **{p: timed[p] for p in candidates[pos]},
                     **({"twin": twins[pos]} if pos in twins else {})} for pos in budgets}
    groups = {pos: [r for rs in c.values() for r in rs] for pos, c in configs.items()}
    wall_each, cpu_each = T.interleave_groups(groups, args.rounds)
    wall = {pos: {name: per_trainer(wall_each[pos], rs) for name, rs in c.items()} for pos, c in configs.items()}
    cpu = {pos: {name: per_trainer(cpu_each[pos], rs) for name, rs in c.items()} for pos, c in configs.items()}
    # per Trainer of ours, the plans it ran during the timed rounds (more than one: its plan changed meanwhile)
    timed_modes = {pos: [sorted(set(r.modes[start[r.name] + 1:])) for r in rs] for pos, rs in ours.items()}
    for r in [*anchors.values(), *(r for rs in [*timed.values(), *fixed.values(), *twins.values()] for r in rs)]:
        r.finish()
    reports, chosen = {}, {}
    for pos, rs in ours.items():
        for r in rs:
            r.finish()
        jsons = [r.report_json() for r in rs]
        reports[pos], chosen[pos] = [j.get("budget") or {} for j in jsons], jsons[0].get("budget_plan") or {}

    rows = []
    for pos, budget in budgets.items():
        w, c = wall[pos], cpu[pos]
        fitting = [p for p in anchors if act[p] <= budget]
        fastest = min(candidates[pos], key=lambda p: typical(w[p])) if candidates[pos] else None
        plans = [list(r.modes[-1]) for r in ours[pos]]
        row = dict(position=pos, budget=budget, instances=k, modes=plans[0], instance_modes=plans,
                   modes_timed=[[list(m) for m in each] for each in timed_modes[pos]], ours_s=typical(w["ours"]),
                   ours_mean_s=statistics.fmean(x for t in w["ours"] for x in t), fixed_activations=fixed_act[pos],
                   calibration=calibration[pos][0], calibrations=calibration[pos], report=worst_report(reports[pos]),
                   reports=reports[pos], fastest=fastest, fitting=fitting, candidates=candidates[pos],
                   times=wall_each[pos], instance_times=w, budget_plan=chosen[pos],
                   calibrated_s=calibrated_seconds(chosen[pos]))
        row["vs_fixed"] = compare(w["ours"], w["fixed"])
        row["vs_fixed_cpu"] = compare(c["ours"], c["fixed"])
        if "twin" in w:  # the same policy in other Trainers: how far apart the same computation reads here
            row["twin"] = [candidates[pos][0], *compare(w["twin"], w[candidates[pos][0]])]
        row["added_ms"] = statistics.fmean(statistics.median(a - b for a, b in zip(o, f))
                                           for o in c["ours"] for f in c["fixed"]) * 1e3
        if fastest is not None:
            row.update(fastest_s=typical(w[fastest]), fastest_mean_s=statistics.fmean(x for t in w[fastest] for x in t),
                       ratio=compare(w["ours"], w[fastest]), cpu_ratio=compare(c["ours"], c[fastest]),
                       fixed_vs_fastest=compare(w["fixed"], w[fastest]),
                       instance_ratios=[T.instances_ratio([o], w[fastest]) for o in w["ours"]])
            row["ratio_of_means"] = row["ours_mean_s"] / row["fastest_mean_s"]
            row["verdict"] = verdict(row["ratio"][0])
            row["ratio_interval"] = T.instances_interval(w["ours"], w[fastest])
            row["same_plan"] = all(p == list(anchors[fastest].modes[-1]) for p in plans)
        else:
            row["verdict"] = "no anchor fits"
        rows.append(row)
    return dict(model=model_name, precision=precision, blocks=blocks, width=args.width, seq=args.seq,
                micro_batch=args.micro_batch, rounds=args.rounds, instances=k, activations=act, rows=rows,
                anchors={p: dict(activations=act[p], median_s=statistics.median(screen[p]),
                                 range_s=[min(screen[p]), max(screen[p])], modes=list(r.modes[-1]))
                         for p, r in anchors.items()})


def trainers(res: Dict[str, Any]) -> str:
    k = res["instances"]
    return "one Trainer per configuration" if k == 1 else f"each configuration in {k} Trainers"


def print_case(res: Dict[str, Any], log: Callable[[str], None] = print, label: Callable[[str], str] = str) -> None:
    """The table (``label`` names an anchor policy in it, e.g. with the frameworks' names)."""
    act = res["activations"]
    log(f"\n{res['model']} {res['blocks']} x {res['width']}, micro-batch {res['micro_batch']} x {res['seq']}, "
        f"{res['precision']}: activations all {act['all'] / MiB:.2f} MiB, none {act['none'] / MiB:.2f} MiB "
        f"(the callback's per-step figure); {res['rounds']} verdict rounds, {trainers(res)}, medians")
    width = max([12] + [len(label(r["fastest"])) for r in res["rows"] if r["fastest"] is not None])
    log(f"{'budget':>15}  {'our plan after calibration':<32}{'ours ms':>8}  {'fastest fitting anchor':<{width}}"
        f"{'ms':>7}  {'ratio (rounds)':<22}{'cpu':>6}  {'verdict':<11}{'worst step / budget':>22}"
        f"{'calib':>7}{'pricing':>9}")
    for r in res["rows"]:
        rep = r["report"]
        worst = (f"{rep['worst_step'] / MiB:.2f} MiB {rep['worst_step_ratio']:.3f}x" if rep.get("worst_step")
                 else "-")
        calib = f"{rep.get('calibration_steps', r['calibration']['steps'])}"
        pricing = f"{rep['pricing_s']:.1f} s" if rep.get("pricing_s") is not None else "-"
        if r["fastest"] is not None:
            ratio = f"{_ratio_text(r['ratio'][0])} ({r['ratio'][1]:.2f}-{r['ratio'][2]:.2f})"
            anchor = f"{label(r['fastest']):<{width}}{r['fastest_s'] * 1e3:>7.0f}"
            cpu = f"{r['cpu_ratio'][0]:>6.3f}"
        else:
            ratio, anchor, cpu = "-", f"{'-':<{width}}{'':>7}", f"{'':>6}"
        log(f"{r['position']:>4.0%} {r['budget'] / MiB:>6.2f} MiB  {mix(r['modes']):<32}{r['ours_s'] * 1e3:>8.0f}  "
            f"{anchor}  {ratio:<22}{cpu}  {r['verdict']:<11}{worst:>22}{calib:>7}{pricing:>9}"
            f"{'  (the same plan)' if r.get('same_plan') else ''}")
    log("where the time goes (ratios: the median over rounds, averaged over pairs of Trainers):")
    for r in res["rows"]:
        parts = []
        if r.get("ratio_interval"):
            low, high = r["ratio_interval"]
            parts.append(f"ratio's 95 % interval {low:.3f}-{high:.3f}"
                         + (" (holds 1.00: a MISS within this run's noise)" if within_noise(r) else ""))
        parts += [f"ours / the same plan fixed ({mix(r['modes'])}) {_ratio_text(r['vs_fixed'][0])} "
                 f"({r['vs_fixed'][1]:.2f}-{r['vs_fixed'][2]:.2f}), cpu {r['vs_fixed_cpu'][0]:.3f} "
                 f"({r['added_ms']:+.1f} ms cpu a step)"]
        if r["fastest"] is not None:
            parts.append(f"that fixed plan / {r['fastest']} {_ratio_text(r['fixed_vs_fastest'][0])}")
        if r.get("twin"):
            policy, mid, lo, hi = r["twin"]
            others = "a second Trainer" if r["instances"] == 1 else f"{r['instances']} other Trainers"
            parts.append(f"noise floor: {policy} in {others} / {policy} {mid:.3f} ({lo:.2f}-{hi:.2f})")
            parts.append(f"ratio of means {_ratio_text(r['ratio_of_means'])}")
        fixed = r["fixed_activations"]
        if fixed is not None:
            parts.append(f"the plan's activations {fixed / MiB:.2f} MiB")
        if r.get("instance_ratios") and len(r["instance_ratios"]) > 1:
            parts.append("each of our Trainers / " + r["fastest"] + " " + ", ".join(
                f"{v:.3f}" for v in r["instance_ratios"]))
        if len({tuple(m) for m in r["instance_modes"]}) > 1:
            parts.append("our Trainers' plans " + " / ".join(mix(m) for m in r["instance_modes"]))
        for i, each in enumerate(r["modes_timed"]):
            if len(each) > 1:
                parts.append(f"the plan of our Trainer {i + 1} changed during the timed rounds: "
                             + " / ".join(mix(m) for m in each))
        if r.get("calibrated_s"):
            parts.append("our first Trainer's calibration priced a block's " + ", ".join(
                f"{m} +{v * 1e3:.1f} ms" for m, v in sorted(r["calibrated_s"].items())))
        cals = r["calibrations"]
        parts.append(f"calibration {', '.join(str(c['steps']) for c in cals)} steps in "
                     f"{', '.join(format(c['step_seconds'], '.1f') for c in cals)} s"
                     + (" (NOT finished)" if any(c["over"] for c in cals) else ""))
        log(f"  {r['position']:>4.0%}: " + "; ".join(parts))
    measured = anchor_seconds(res)
    if measured:
        anchors, blocks = res["anchors"], res["blocks"]
        saves = {m: (anchors["none"]["activations"] - anchors[p]["activations"]) / blocks
                 for m, p in (("recompute", "all"), ("selective", "selective")) if p in anchors}
        log("  a block's cost per mode from the anchors' medians, (T(policy) - T(none)) / blocks: " + ", ".join(
            f"{m} +{v * 1e3:.1f} ms (saves {saves[m] / MiB:.2f} MiB)" for m, v in measured.items()))
    log("anchors: " + "; ".join(f"{p}{' (' + framework_name(p) + ')' if framework_name(p) else ''} "
                                f"{v['activations'] / MiB:.2f} MiB {v['median_s'] * 1e3:.0f} ms"
                                for p, v in res["anchors"].items()))


def parse_positions(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"--positions {text!r}: give fractions between 0 and 1, e.g. 0.25,0.5,0.75")
    return values


def add_size_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None, help="blocks (default 6; --quick 4)")
    p.add_argument("--width", type=int, default=None, help="hidden width (default 256; --quick 128)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --quick 128)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 4; --quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds of the verdict (default 9; --quick 2)")
    p.add_argument("--screen", type=int, default=None, help="screening rounds, every configuration (default 3; "
                                                             "--quick 1)")
    p.add_argument("--instances", type=int, default=None, help="Trainers per configuration in the verdict, their "
                                                                "mean step per round compared (default 3; --quick 1)")
    p.add_argument("--candidates", type=int, default=3, help="fastest fitting anchors per budget (by the screening) "
                                                             "timed beside ours for the verdict (default 3)")
    p.add_argument("--max-calibration", type=int, default=80, help="give up waiting for the calibration after this "
                                                                    "many steps (reported as not finished)")
    p.add_argument("--quick", action="store_true", help="4 x 128, micro-batch 2 x 128, 2 rounds: a smoke run")


def resolve_sizes(args: argparse.Namespace) -> None:
    small = dict(layers=4, width=128, seq=128, micro_batch=2, rounds=2, screen=1, instances=1)
    full = dict(layers=6, width=256, seq=256, micro_batch=4, rounds=9, screen=3, instances=3)
    for key, value in (small if args.quick else full).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.instances < 1:
        raise SystemExit(f"--instances {args.instances}: give 1 or more Trainers per configuration, e.g. --instances 3")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--positions", type=parse_positions, default=[0.25, 0.5, 0.75],
                   help="budgets as fractions of the way from all to none (default 0.25,0.5,0.75)")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--json", default=None)
    add_size_arguments(p)
    args = p.parse_args(argv)
    resolve_sizes(args)
    T.quiet()
    print("\n".join(header_lines([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])))
    print(f"load average at start: {load_average()}")
    results = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        res = run_case(model, args, args.precision)
        print_case(res)
        results.append(res)
    rows = [r for res in results for r in res["rows"]]
    verdicts = [r["verdict"] for r in rows]
    print(f"\nsummary: {sum(v.startswith('PASS') for v in verdicts)}/{len(verdicts)} budgets PASS (ours <= "
          f"{TARGET:.2f} x the fastest fitting anchor), {sum(v.startswith('MISS') for v in verdicts)} MISS "
          f"({sum(within_noise(r) for r in rows)} of them within the noise: 95 % interval holds {TARGET:.2f}); every "
          "step within the budget: "
          f"{all((r['report'].get('worst_step_ratio') or 0) <= 1.0 for res in results for r in res['rows'])}")
    print(f"load average at end: {load_average()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
