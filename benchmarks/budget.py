"""Does ``budget:`` pick a plan that fits, and is it as fast as the best simple plan that fits?

One process, one model, one batch. Candidates: ``first:K`` for every K, ``every:N`` for N = 2…L/2, ``all``.
Each candidate's activation peak is measured with :class:`lightning_ckpt.measure.meter.StepMeter` (the figure the
budget is about); the budget calibration (:class:`lightning_ckpt.decide.budget.BudgetCalibration`) runs exactly as
the callback drives it; then every fitting candidate and the chosen plan are timed in interleaved rounds
(median of per-round ratios to the chosen plan).

Targets (issue "Auto-toggle and budget"): the chosen plan's measured peak ≤ budget, and its step time within
3 % of the fastest fitting candidate.

    python benchmarks/budget.py                 # demo GPT 12 x 512, batch 4 x 512, budget half-way
    python benchmarks/budget.py --quick         # tiny model, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import build_gpt, header_lines, load_average, median, mib, timed_step  # noqa: E402

from lightning_ckpt import apply_policy  # noqa: E402
from lightning_ckpt.decide.budget import BudgetCalibration  # noqa: E402
from lightning_ckpt.demos.gpt import GPTConfig  # noqa: E402
from lightning_ckpt.measure.meter import StepMeter  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few rounds")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=5, help="timing rounds")
    p.add_argument("--position", type=float, default=0.5,
                   help="budget = all + position x (none - all) activation peak (default 0.5)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    cfg = GPTConfig.tiny() if args.quick else GPTConfig.benchmark()
    batch, seq = (2, 64) if args.quick else (args.batch, args.seq)
    reps = 2 if args.quick else args.reps
    print("\n".join(header_lines(argv if argv is not None else sys.argv)))
    print(f"load average at start: {load_average()}")
    model = build_gpt(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    plan = apply_policy(model, "none")
    meter = StepMeter("cpu", model=model)
    L = plan.num_blocks

    def step():
        return model(idx, idx)[1]

    def peak(modes) -> int:
        plan.set_modes(modes)
        model.zero_grad(set_to_none=True)
        meter.start_step()
        step().backward()
        return meter.stop_step().activations

    peak(["off"] * L)  # warm-up and replay calibration of the meter
    candidates: Dict[str, tuple] = {f"first:{k}": tuple("recompute" if i < k else "off" for i in range(L))
                                    for k in range(L + 1)}
    candidates.update({f"every:{n}": tuple("recompute" if i % n == 0 else "off" for i in range(L))
                       for n in range(2, L // 2 + 1)})
    candidates["all"] = ("recompute",) * L
    peaks = {name: peak(list(modes)) for name, modes in candidates.items()}
    budget = int(peaks["all"] + args.position * (peaks["first:0"] - peaks["all"]))

    calibration = BudgetCalibration(plan, meter, budget)
    while not calibration.done:
        calibration.begin_step()
        model.zero_grad(set_to_none=True)
        meter.start_step()
        step().backward()
        calibration.end_step(meter.stop_step().activations)
    chosen_modes = tuple(plan.modes)
    chosen_peak = peak(list(chosen_modes))
    for line in calibration.messages:
        print(line)

    fitting = {n: m for n, m in candidates.items() if peaks[n] <= budget}
    timed = dict(fitting, chosen=chosen_modes)
    times: Dict[str, List[float]] = {n: [] for n in timed}
    for _ in range(1):  # warm-up round
        for modes in timed.values():
            plan.set_modes(list(modes))
            timed_step(model, step)
    for r in range(reps):
        order = list(timed) if r % 2 == 0 else list(reversed(timed))
        for name in order:
            plan.set_modes(list(timed[name]))
            times[name].append(timed_step(model, step).total)
    ratio = {n: median([a / b for a, b in zip(times[n], times["chosen"])]) for n in timed}
    best = min(fitting, key=lambda n: ratio[n]) if fitting else None

    print(f"\nmodel {L} blocks x width {cfg.n_embd}, batch {batch} x seq {seq}; budget {mib(budget):.1f} MiB "
          f"(all {mib(peaks['all']):.1f}, none {mib(peaks['first:0']):.1f})")
    print(f"{'plan':<12}{'ckpt':>6}{'act MiB':>10}{'fits':>6}{'median s':>10}{'time/chosen':>13}")
    for name in list(candidates) + ["chosen"]:
        modes = chosen_modes if name == "chosen" else candidates[name]
        act = chosen_peak if name == "chosen" else peaks[name]
        t = f"{median(times[name]):>10.3f}{ratio[name]:>13.3f}" if name in times else f"{'-':>10}{'-':>13}"
        print(f"{name:<12}{sum(m != 'off' for m in modes):>6}{mib(act):>10.1f}{str(act <= budget):>6}{t}")
    ok_fit = chosen_peak <= budget
    verdict = "PASS" if ok_fit else "MISS"
    print(f"\n{verdict}  chosen plan fits: {mib(chosen_peak):.1f} MiB <= budget {mib(budget):.1f} MiB")
    if best is not None:
        speed = 1.0 / ratio[best]  # chosen time / best time
        print(f"{'PASS' if speed <= 1.03 else 'MISS'}  chosen plan time / fastest fitting simple plan ({best}) = "
              f"{speed:.3f} (median of {reps} rounds) <= 1.03")
    print(f"load average at end: {load_average()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"budget": budget, "peaks": peaks, "chosen": list(chosen_modes), "chosen_peak": chosen_peak,
                       "times": times, "ratio_to_chosen": ratio, "best": best}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
