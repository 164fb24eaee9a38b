"""Issue 25: ``budget:`` planned per batch shape, on a realistic spread of lengths, against one plan for the longest.

Batches are padded to their own longest sequence; the padded length of each is drawn from a long-tailed
distribution (log-normal, median a quarter of the maximum, sigma 0.7, fixed seed, clipped to [16, maximum]), as
instruction tuning with dynamic padding produces. The budget is the activation peak of ``all`` at the maximum length
plus half the gap to ``none`` there, so that at the longest length only a partly checkpointed plan fits.

Compared in one process, in interleaved rounds over the same batch sequence (the optimizer's state carries on):

- **(a) per shape**: the plugin's :class:`~lightning_ckpt.decide.shape_plans.ShapePlanner` as the callback runs it:
  calibrated on real steps of the first batch's shape, every bucket priced on fake tensors, each step under its
  bucket's plan;
- **(b) one budget plan**: the plan the same solver chooses for the longest batch, for every batch (``budget:`` as it
  was: one plan, sized for the longest shape it must survive);
- **(c) the fastest anchor** that fits the longest batch: torchtitan ``full`` (every block), torchtitan op-level SAC,
  Megatron ``selective`` and ``block N``, Hugging Face ``every_n_layers``, timed at the maximum length.

Memory is read by PyTorch's MemTracker (the running peak of its ACT line), never by the plugin's meter: the largest
step peak of (a) over the sequence (each bucket's longest batch under its plan), and each step's prediction error
(the planner's prediction for that batch's shape against MemTracker; the planner then sees the reading, as the
callback's measured steps make it). Also a curriculum: 20 batches of 64 tokens (calibrated there), then the maximum:
the first long step must stay within the budget.

Targets (float32, both models): (a) recovers at least half of (c)'s overhead, i.e. tokens/s (a)/(c) ≥
1 + ½ (T(c)/T(none) − 1) with T at the maximum length, measured in the same run; no step over the budget by more than
2 %; prediction error ≤ 5 % after the first step of each bucket; the curriculum's first long step within the budget.

Usage::

    python benchmarks/shapes.py                      # GPT and Llama 8 x 256, float32
    python benchmarks/shapes.py --models gpt --rounds 5
    python benchmarks/shapes.py --small --precisions bf16-mixed   # bf16 autocast at 4 x 128
    python benchmarks/shapes.py --quick              # smoke: 4 x 128, 12 batches, 1 round
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frontier as F  # noqa: E402
from _common import header_lines, load_average, measure_memory  # noqa: E402

from lightning_ckpt.core.units import format_bytes  # noqa: E402
from lightning_ckpt.core.wrap import apply_policy, remove_checkpointing  # noqa: E402
from lightning_ckpt.decide.budget import BudgetCalibration, mode_mix  # noqa: E402
from lightning_ckpt.decide.pricing import price_shape, trace_plans  # noqa: E402
from lightning_ckpt.decide.shape_plans import ShapePlanner  # noqa: E402
from lightning_ckpt.decide.shapes import Shape, bucket_of, resize_batch, shape_of  # noqa: E402
from lightning_ckpt.forecast.load import lightning_step, make_optimizers, step_loss  # noqa: E402
from lightning_ckpt.forecast.precision import parse_precision  # noqa: E402
from lightning_ckpt.measure.meter import StepMeter  # noqa: E402

OVER = 1.02  # a step may read this much above the budget
ERROR = 0.05  # prediction error allowed after a bucket's first step


def lengths(count: int, longest: int, seed: int = 0) -> List[int]:
    """Padded batch lengths: log-normal, median ``longest / 4``, sigma 0.7, clipped to [16, longest]."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(count).log_normal_(math.log(longest / 4), 0.7, generator=g)
    return [int(min(longest, max(16, round(float(x))))) for x in draws]


class Run:
    """One model in one precision: its steps on batches of any length."""

    def __init__(self, module, longest: int, micro_batch: int, precision: str) -> None:
        self.module, self.precision = module, parse_precision(precision)
        if self.precision.param_dtype is not None:
            module.to(self.precision.param_dtype)
        module.train()
        self.longest, self.micro_batch = longest, micro_batch
        self.opts = make_optimizers(module, None)
        self.blocks = [b for _, b in F.find_blocks(module)]
        self._batches: Dict[int, Any] = {}
        self.step(self.batch(longest))  # the optimizer's state exists from here on

    def batch(self, length: int) -> Any:
        if length not in self._batches:
            self._batches[length] = self.module.example_batch(self.micro_batch, length)
        return self._batches[length]

    def step(self, batch: Any) -> None:
        lightning_step(self.module, batch, self.opts, self.precision)

    def loss(self, batch: Any) -> torch.Tensor:
        return step_loss(self.module, batch)

    def peak(self, batch: Any) -> int:
        """MemTracker's activation peak of one forward + backward (the plugin's exact line under autocast, as in
        benchmarks/frontier.py)."""

        def fwd_bwd() -> None:
            with self.precision.forward_context("cpu"):
                loss = self.loss(batch)
            loss.backward()
            del loss
            self.module.zero_grad(set_to_none=True)

        if self.precision.autocast_dtype is not None:
            meter = StepMeter("cpu", model=self.module)
            with meter.step(exact=True) as box:
                fwd_bwd()
            return int(box.reading.activations or 0)
        tensors = [t for t in batch.values() if isinstance(t, torch.Tensor)]
        return measure_memory(fwd_bwd, external=(self.module, *tensors)).act_peak


def calibrated_planner(run: Run, plan, calibration_length: int, budget: int) -> Tuple[ShapePlanner, Dict[str, Any]]:
    """The planner as the callback builds it: a real calibration at one shape, fake pricing for every bucket."""
    batch = run.batch(calibration_length)
    shape = shape_of(batch)
    meter = StepMeter("cpu", model=run.module)
    calibration = BudgetCalibration(plan, meter, budget)

    def step(exact: bool) -> int:
        with meter.step(exact=exact, eager=True) as box:
            run.step(batch)
        return int(box.reading.activations or 0)

    calibration.run(step)
    plan.set_modes(calibration.chosen.modes)
    verified = step(True)  # the verifying step of the calibration's own plan
    context = run.precision.forward_context
    timing = {"priced_s": 0.0, "buckets": 0}

    def price(bucket: Shape):
        t0 = time.perf_counter()
        try:
            return price_shape(run.module, plan, run.loss, resize_batch(batch, shape, bucket),
                               ("recompute", "selective"), context=lambda: context("cpu"))
        finally:
            timing["priced_s"] += time.perf_counter() - t0
            timing["buckets"] += 1

    def trace(bucket: Shape, plans):
        t0 = time.perf_counter()
        try:
            return trace_plans(run.module, plan, run.loss, resize_batch(batch, shape, bucket), plans,
                               context=lambda: context("cpu"))
        finally:
            timing["priced_s"] += time.perf_counter() - t0

    planner = ShapePlanner(budget, ("recompute", "selective"), price, trace)
    planner.set_reference(shape, calibration.costs(), calibration.base, calibration.chosen,
                          measured=dict(calibration.measured_plans), measured_peak=verified)
    return planner, timing


def walk(run: Run, plan, planner: ShapePlanner, sequence: Sequence[int], measure_all: bool) -> Dict[str, Any]:
    """Each batch under its bucket's plan, in order: predicted against MemTracker, the reading fed back. Measured:
    every step with ``measure_all``, else the first and the longest batch of each bucket."""
    seen: Dict[Shape, int] = {}
    longest: Dict[Shape, int] = {}
    for length in sequence:
        bucket = bucket_of(Shape(run.micro_batch, (length,)))
        longest[bucket] = max(longest.get(bucket, 0), length)
    rows, worst = [], 0
    for length in sequence:
        shape = Shape(run.micro_batch, (length,))
        bucket = bucket_of(shape)
        bucket_plan = planner.plan(bucket)
        first = bucket not in seen
        seen[bucket] = seen.get(bucket, 0) + 1
        if not (measure_all or first or length == longest[bucket]):
            continue
        plan.set_modes(bucket_plan.modes)
        predicted = planner.predict(bucket, bucket_plan.modes, shape)
        measured = run.peak(run.batch(length))
        worst = max(worst, measured)
        planner.observe(bucket, bucket_plan.modes, measured, shape=shape)
        rows.append(dict(length=length, bucket=str(bucket), modes=list(bucket_plan.modes), predicted=predicted,
                         measured=measured, error=measured / predicted - 1, first=first))
    return {"rows": rows, "worst": worst}


def run_case(model_name: str, precision: str, args) -> Dict[str, Any]:
    torch.manual_seed(0)
    module, longest = F.build(model_name, args.quick or args.small)
    run = Run(module, longest, args.micro_batch, precision)
    n_blocks = len(run.blocks)
    sequence = lengths(args.batches, longest, seed=args.seed)

    # the budget: all at the maximum length plus half the gap to none there
    anchors = F.anchor_wrappers(n_blocks)
    at_max: Dict[str, int] = {}
    for name, (mask, context_fn) in anchors.items():
        wrap = F.AnchorWrap(run.blocks, mask, context_fn)
        try:
            at_max[name] = run.peak(run.batch(longest))
        finally:
            wrap.remove()
    low, high = at_max["torchtitan full"], at_max["none"]
    budget = round(low + (high - low) / 2)

    plan = apply_policy(run.module, "none")
    planner, pricing = calibrated_planner(run, plan, sequence[0], budget)
    walked = walk(run, plan, planner, sequence, args.measure_all)
    top = bucket_of(Shape(run.micro_batch, (longest,)))
    single = planner.plan(top).modes  # (b): the plan for the longest batch, for every batch

    # curriculum: calibrated at 64 tokens for 20 steps, then the maximum
    fresh, _ = calibrated_planner(run, plan, min(64, longest), budget)
    long_modes = fresh.plan(top).modes
    plan.set_modes(long_modes)
    first_long = run.peak(run.batch(longest))
    remove_checkpointing(run.module)

    # (c): the anchors that fit the longest batch, timed there; the fastest
    fitting = [n for n in anchors if n != "none" and at_max[n] <= budget]

    def anchor_config(name):
        holder = {}
        mask, context_fn = anchors[name]
        return (lambda: holder.__setitem__("w", F.AnchorWrap(run.blocks, mask, context_fn)),
                lambda: holder.pop("w").remove())

    at_longest = {name: [] for name in ["none", *fitting]}
    batch = run.batch(longest)
    for r in range(args.rounds + 1):
        names = list(at_longest)
        for name in names[r % len(names):] + names[:r % len(names)]:
            install, remove = anchor_config(name)
            install()
            try:
                t0 = time.perf_counter()
                run.step(batch)
                seconds = time.perf_counter() - t0
            finally:
                remove()
            if r:
                at_longest[name].append(seconds)
    medians = {n: statistics.median(v) for n, v in at_longest.items()}
    anchor = min(fitting, key=medians.get) if fitting else None

    # the sequence, interleaved: (a) per shape, (b) one plan, (c) the fastest anchor
    plan = apply_policy(run.module, "none")
    by_bucket = {bucket_of(Shape(run.micro_batch, (n,))): None for n in sequence}
    per_shape = {b: planner.plan(b).modes for b in by_bucket}
    tokens = sum(run.micro_batch * n for n in sequence)

    def run_sequence(kind: str) -> float:
        holder = {}
        if kind == "anchor":
            install, remove = anchor_config(anchor)
            remove_checkpointing(run.module)
            install()
        else:
            holder["plan"] = apply_policy(run.module, "none")
        t0 = time.perf_counter()
        try:
            for n in sequence:
                modes = per_shape[bucket_of(Shape(run.micro_batch, (n,)))] if kind == "per shape" else single
                if kind != "anchor" and holder["plan"].modes != modes:  # as the callback: only when it changes
                    holder["plan"].set_modes(modes)
                run.step(run.batch(n))
        finally:
            if kind == "anchor":
                remove()
        return time.perf_counter() - t0

    kinds = ["per shape", "one plan"] + (["anchor"] if anchor else [])
    seconds: Dict[str, List[float]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            s = run_sequence(kind)
            remove_checkpointing(run.module)
            if r:
                seconds[kind].append(s)
    tps = {k: [tokens / s for s in v] for k, v in seconds.items()}
    ratio_b = [a / b for a, b in zip(tps["per shape"], tps["one plan"])]
    ratio_c = [a / c for a, c in zip(tps["per shape"], tps["anchor"])] if anchor else []
    overhead = medians[anchor] / medians["none"] if anchor else None
    later = [r["error"] for r in walked["rows"] if not r["first"]]
    return dict(
        model=model_name, precision=precision, longest=longest, micro_batch=run.micro_batch, blocks=n_blocks,
        sequence=sequence, budget=budget, at_max=at_max, calibrated_at=sequence[0], pricing=pricing,
        plans={str(b): mode_mix(m) for b, m in per_shape.items()}, single=mode_mix(single), anchor=anchor,
        anchor_overhead=overhead, tokens_per_s={k: statistics.median(v) for k, v in tps.items()},
        ratio_b=statistics.median(ratio_b), ratio_b_range=(min(ratio_b), max(ratio_b)),
        ratio_c=statistics.median(ratio_c) if ratio_c else None,
        ratio_c_range=(min(ratio_c), max(ratio_c)) if ratio_c else None,
        worst=walked["worst"], rows=walked["rows"], max_error_after_first=max((abs(e) for e in later), default=0.0),
        curriculum=dict(plan=mode_mix(long_modes), peak=first_long, budget=budget),
    )


def print_case(res: Dict[str, Any]) -> bool:
    print(f"\n{res['model']} {res['blocks']} blocks, {res['precision']}, micro-batch {res['micro_batch']}, lengths "
          f"16..{res['longest']} (median {statistics.median(res['sequence']):.0f}, {len(res['sequence'])} batches); "
          f"budget {format_bytes(res['budget'])} (all {format_bytes(res['at_max']['torchtitan full'])}, none "
          f"{format_bytes(res['at_max']['none'])} at {res['longest']})")
    print(f"  calibrated at {res['calibrated_at']} tokens; {res['pricing']['buckets']} buckets priced on fake tensors "
          f"in {res['pricing']['priced_s']:.1f} s (once per bucket)")
    for bucket, mix in sorted(res["plans"].items(), key=lambda kv: int(kv[0].split(" x ")[1])):
        print(f"  bucket {bucket:<10} {mix}")
    print(f"  (b) one plan for the longest: {res['single']}; (c) fastest anchor fitting the longest: {res['anchor']} "
          f"(T(c)/T(none) at {res['longest']}: {res['anchor_overhead']:.3f})" if res["anchor"] else "")
    tps = res["tokens_per_s"]
    print("  tokens/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in tps.items()))
    ok = True

    def verdict(passed: bool, text: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"  {'PASS' if passed else 'MISS'}  {text}")

    lo, hi = res["ratio_b_range"]
    print(f"  (a)/(b) tokens/s {res['ratio_b']:.3f} (rounds {lo:.3f}..{hi:.3f})")
    if res["ratio_c"] is not None:
        target = 1 + 0.5 * (res["anchor_overhead"] - 1)
        lo, hi = res["ratio_c_range"]
        verdict(res["ratio_c"] >= target, f"(a)/(c) tokens/s {res['ratio_c']:.3f} (rounds {lo:.3f}..{hi:.3f}) >= "
                                          f"1 + 1/2 (T(c)/T(none) - 1) = {target:.3f}")
    verdict(res["worst"] <= OVER * res["budget"], f"largest step peak (MemTracker) {format_bytes(res['worst'])} "
                                                   f"<= {OVER:.2f} x budget {format_bytes(res['budget'])}")
    verdict(res["max_error_after_first"] <= ERROR, f"prediction error after each bucket's first step: max "
                                                   f"{res['max_error_after_first']:.1%} <= {ERROR:.0%}")
    first = [r for r in res["rows"] if r["first"]]
    print("  first step of each bucket: " + ", ".join(f"{r['length']}: {r['error']:+.1%}" for r in first))
    cur = res["curriculum"]
    verdict(cur["peak"] <= OVER * cur["budget"], f"curriculum (64 tokens, then {res['longest']}): first long step "
                                                 f"{format_bytes(cur['peak'])} under {cur['plan']} <= budget")
    return ok


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--precisions", default="32-true")
    p.add_argument("--small", action="store_true", help="4 blocks x 128 (bf16 autocast on this CPU is slow)")
    p.add_argument("--quick", action="store_true", help="smoke: 4 x 128, 12 batches, 1 round")
    p.add_argument("--batches", type=int, default=None, help="batches in the sequence (default 32; --quick 12)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure-all", action="store_true", help="MemTracker on every step, not each bucket's first and "
                                                              "longest")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.batches = args.batches or (12 if args.quick else 32)
    args.rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for line in header_lines([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]):
        print(line)
    print(f"load average at start: {load_average()}")
    results, ok = [], True
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            res = run_case(model.strip(), precision.strip(), args)
            ok &= print_case(res)
            results.append(res)
    print(f"\nload average at end: {load_average()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
