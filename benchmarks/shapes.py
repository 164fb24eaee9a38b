"""Issue 25 / issue 33: ``budget:`` planned per batch shape, on a realistic spread of lengths, against one plan for the
longest batch and against the fastest fixed policy that fits the longest batch.

Batches are padded to their own longest sequence; the padded length of each is drawn from a long-tailed
distribution (log-normal, median a quarter of the maximum, sigma 0.7, fixed seed, clipped to [16, maximum]; the
longest draw is set to the maximum, so the longest bucket is met), as instruction tuning with dynamic padding
produces. The budget is ``all``'s activation figure at the maximum length plus half the gap to ``none``'s there, so
that at the longest length only a partly checkpointed plan fits.

Everything goes through the public API, as a user runs it: every configuration is a ``lightning.Trainer`` with
``ActivationCheckpointing(policy=...)`` on its own copy of the model, and their steps interleave in one process
(``benchmarks/_trainer.py``). Compared over the same batch sequence, one pass per configuration per round:

- **(a) per shape**: ``policy="budget:<bytes>"`` with its defaults. Its stream starts with 40 batches of the first
  batch's length (the calibration measures real steps of that exact length only, so on the raw sequence, where a
  length rarely repeats, it would take hundreds of steps; the docs advise padding to a multiple), then the sequence:
  each bucket priced on fake tensors and planned before its first step. Before the timed rounds it runs one pass
  over the sequence with every step measured (``log_every_n_steps=1``): each step's prediction error
  (``memory/prediction_error_ratio``) comes from there, and the worst step (calibration included) from the end-of-fit
  report; timed passes log as Lightning does by default;
- **(b) one plan**: ``policy="modes:<(a)'s plan for the longest bucket>"``, for every batch (``budget:`` as it was:
  one plan, sized for the longest shape it must survive);
- **(c) the fastest anchor** fitting the longest batch, among ``all``, ``selective``, ``every:N`` and ``first:K``,
  chosen by timing them (and ``none``) at the maximum length in interleaved rounds;
- **(d) none** on every batch, a reference only (over the budget on the longest batches): the most any plan could
  gain over (c) on this sequence. Short batches spend most of a step outside the blocks (the head, the optimizer),
  so (c)'s overhead there is below T(c)/T(none) at the maximum length, and (d)/(c) can fall short of the target.

Memory is the callback's own per-step activation figure (the figure the budget is about). Also a curriculum: a fresh
``budget:`` run on 64-token batches (it calibrates there), then the maximum: the first long step must stay within the
budget.

Targets (float32, both models): (a) recovers at least half of (c)'s overhead, i.e. tokens/s (a)/(c) ≥
1 + ½ (T(c)/T(none) − 1) with T at the maximum length, measured in the same run; no step over the budget by more than
2 %; prediction error ≤ 5 % after the first step of each bucket; the curriculum's first long step within the budget.

Usage::

    python benchmarks/shapes.py                      # GPT and Llama 6 x 256, float32
    python benchmarks/shapes.py --models gpt --rounds 5
    python benchmarks/shapes.py --quick --precision bf16-mixed   # bf16 autocast at 4 x 128
    python benchmarks/shapes.py --quick              # smoke: 4 x 128, 12 batches, 1 round
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _trainer as T  # noqa: E402
import budget as B  # noqa: E402
from _common import header_lines, load_average  # noqa: E402

from lightning_ckpt.core.units import format_bytes  # noqa: E402

OVER = 1.02  # a step may read this much above the budget
ERROR = 0.05  # prediction error allowed after a bucket's first step
CURRICULUM = 64  # the curriculum's short length
CURRICULUM_STEPS = 40  # steps at that length before the first long one (the calibration ends within them)
CALIBRATION = 40  # (a)'s steps at the first batch's length before the sequence (its calibration ends within them)
ERROR_KEY = "memory/prediction_error_ratio"


def lengths(count: int, longest: int, seed: int = 0) -> List[int]:
    """Padded batch lengths: log-normal, median ``longest / 4``, sigma 0.7, clipped to [16, longest]; the longest draw
    is raised to ``longest``."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(count).log_normal_(math.log(longest / 4), 0.7, generator=g)
    out = [int(min(longest, max(16, round(float(x))))) for x in draws]
    out[out.index(max(out))] = longest
    return out


def bucket_length(length: int) -> int:
    """The bucket's length (the plugin's rule: a power of two, at least 8), for grouping rows by bucket."""
    return max(8, 1 << (length - 1).bit_length())


def run_case(model_name: str, args, precision: str) -> Dict[str, Any]:
    module = B.build(model_name, args.layers, args.width, args.seq)
    longest, mb = args.seq, args.micro_batch
    sequence = lengths(args.batches, longest, seed=args.seed)
    blocks = len(T.block_names(module))
    cache: Dict[int, Any] = {}

    def batch_of(length: int):
        if length not in cache:
            cache[length] = module.example_batch(mb, length)
        return cache[length]

    def runner(name: str, policy: str, source) -> T.Runner:
        return T.Runner(name, module, source, dict(policy=policy), precision=precision)

    def at_longest(i: int):
        return batch_of(longest)

    def in_sequence(i: int):
        return batch_of(sequence[i % len(sequence)])

    def calibrated_first(i: int):  # (a): CALIBRATION steps of the first batch's length, then the sequence
        return batch_of(sequence[0] if i < CALIBRATION else sequence[(i - CALIBRATION) % len(sequence)])

    print(f"\n{model_name}: {blocks} blocks x {args.width}, micro-batch {mb}, lengths 16..{longest}; load average "
          f"{load_average()}", flush=True)
    # the anchors at the maximum length: activations (every step measured), then their times and none's
    anchors = {p: runner(p, p, at_longest) for p in B.anchor_policies(blocks)}
    act = {p: B.measure_anchor(r) for p, r in anchors.items()}
    low, high = act["all"], act["none"]
    budget = round(low + (high - low) / 2)
    fitting = [p for p in anchors if p != "none" and act[p] <= budget]
    for p in [p for p in anchors if p != "none" and p not in fitting]:
        anchors.pop(p).finish()
    wall_max, _ = T.interleave(list(anchors.values()), args.rounds, warmup=1)
    medians = {p: statistics.median(v) for p, v in wall_max.items()}
    anchor = min(fitting, key=medians.get) if fitting else None
    overhead = medians[anchor] / medians["none"] if anchor else None
    for r in anchors.values():
        r.finish()

    # (a): calibrated on the first batch's length, then one pass over the sequence with every step measured
    ours = runner("per shape", f"budget:{budget}", calibrated_first)
    while ours.calibrating and len(ours.times) < CALIBRATION:
        ours.run(1)
    calibration_steps = len(ours.times) if not ours.calibrating else None
    ours.run(CALIBRATION - len(ours.times))
    trainer = ours.trainer
    every, trainer.log_every_n_steps = trainer.log_every_n_steps, 1
    first_measured = len(ours.times)
    ours.run(len(sequence))
    trainer.log_every_n_steps = every
    seen, rows = set(), []
    for i in range(first_measured, len(ours.times)):
        length = sequence[(i - CALIBRATION) % len(sequence)]
        bucket = bucket_length(length)
        metrics = ours.metrics[i] or {}
        rows.append(dict(length=length, bucket=bucket, modes=list(ours.modes[i]), measured=ours.activations[i],
                         error=metrics.get(ERROR_KEY), first=bucket not in seen))
        seen.add(bucket)
    plans = {str(shape): list(plan.modes) for shape, plan in ours.callback.shape_plans.items()}
    top = [plan.modes for shape, plan in ours.callback.shape_plans.items()
           if shape.samples == mb and shape.lengths and shape.lengths[-1] >= longest]
    single = tuple(top[0]) if top else tuple(ours.modes[first_measured + sequence.index(longest)])


    # the sequence, interleaved: (a) per shape, (b) one plan, (c) the fastest anchor
    kinds = [ours, runner("one plan", "modes:" + ",".join(single), in_sequence)]
    if anchor:
        kinds.append(runner("anchor", anchor, in_sequence))
    kinds.append(runner("none", "none", in_sequence))  # (d): the ceiling, over the budget on the long batches
    for r in kinds[1:]:
        r.run(len(sequence))  # a warm pass (the first step is a measured reference step)
    first_timed = {r.name: len(r.times) for r in kinds}
    wall, _ = T.interleave(kinds, args.rounds, steps=len(sequence), warmup=0)
    # per bucket: (a)'s step time over (d)'s for the same batch of the same pass, the median over its steps
    by_bucket: Dict[int, List[float]] = {}
    d = kinds[-1]
    for k in range(args.rounds * len(sequence)):
        a_s, d_s = ours.times[first_timed[ours.name] + k], d.times[first_timed[d.name] + k]
        by_bucket.setdefault(bucket_length(sequence[k % len(sequence)]), []).append(a_s / d_s)
    tokens = sum(mb * n for n in sequence)
    tps = {r.name: [tokens / s for s in wall[r.name]] for r in kinds}
    for r in kinds:
        r.finish()
    figures = ours.report_json().get("budget") or {}

    # curriculum: a fresh budget run at 64 tokens (calibrated there), then the maximum, every step measured
    short = min(CURRICULUM, longest)
    cur = runner("curriculum", f"budget:{budget}",
                 lambda i: batch_of(short if i < CURRICULUM_STEPS else longest))
    cur.trainer.log_every_n_steps = 1
    cur.run(CURRICULUM_STEPS)
    cur_calibrated = not cur.calibrating
    cur.run(1)
    cur.finish()

    ratio_b = [a / b for a, b in zip(tps["per shape"], tps["one plan"])]
    ratio_c = [a / c for a, c in zip(tps["per shape"], tps["anchor"])] if anchor else []
    ceiling = [d / c for d, c in zip(tps["none"], tps["anchor"])] if anchor else []
    ratio_d = [a / d for a, d in zip(tps["per shape"], tps["none"])]
    later = [abs(r["error"]) for r in rows if not r["first"] and r["error"] is not None]
    measured = [r["measured"] for r in rows if r["measured"] is not None]
    return dict(
        model=model_name, precision=precision, longest=longest, micro_batch=mb, blocks=blocks, sequence=sequence,
        budget=budget, at_max=act, anchor=anchor, anchor_overhead=overhead, anchor_times_max=medians,
        calibration_steps=calibration_steps, plans=plans, single=list(single), report=figures,
        tokens_per_s={k: statistics.median(v) for k, v in tps.items()},
        ratio_b=statistics.median(ratio_b), ratio_b_range=(min(ratio_b), max(ratio_b)),
        ratio_c=statistics.median(ratio_c) if ratio_c else None,
        ratio_c_range=(min(ratio_c), max(ratio_c)) if ratio_c else None,
        per_bucket_vs_none={b: statistics.median(v) for b, v in sorted(by_bucket.items())},
        ceiling=statistics.median(ceiling) if ceiling else None, ratio_d=statistics.median(ratio_d),
        ratio_d_range=(min(ratio_d), max(ratio_d)),
        worst=max([figures.get("worst_step") or 0, *measured]), rows=rows,
        max_error_after_first=max(later, default=0.0), errors_measured=len(later),
        curriculum=dict(plan=list(cur.modes[-1]), peak=cur.activations[-1], budget=budget,
                        calibrated=cur_calibrated, report=cur.report_json().get("budget") or {}),
    )


def print_case(res: Dict[str, Any]) -> bool:
    at = res["at_max"]
    print(f"\n{res['model']} {res['blocks']} blocks, {res['precision']}, micro-batch {res['micro_batch']}, lengths "
          f"16..{res['longest']} (median {statistics.median(res['sequence']):.0f}, {len(res['sequence'])} batches); "
          f"budget {format_bytes(res['budget'])} (all {format_bytes(at['all'])}, none {format_bytes(at['none'])} at "
          f"{res['longest']}; the callback's activation figure)")
    rep = res["report"]
    steps = res["calibration_steps"]
    print(f"  (a) calibrated in {steps if steps is not None else f'NOT {CALIBRATION}'} steps of {res['sequence'][0]} "
          f"tokens (report: {rep.get('calibration_steps')}); "
          f"{rep.get('pricing_s', 0.0):.1f} s pricing shapes on fake tensors; worst step "
          f"{format_bytes(rep['worst_step']) if rep.get('worst_step') else '-'}"
          f" ({(rep.get('worst_step_ratio') or 0):.3f} x the budget, calibration included)")
    for bucket, modes in sorted(res["plans"].items(), key=lambda kv: int(kv[0].split("x")[-1].strip())):
        print(f"  bucket {bucket:<10} {B.mix(modes)}")
    if res["anchor"]:
        print(f"  (b) one plan for the longest: {B.mix(res['single'])}; (c) fastest anchor fitting the longest: "
              f"{res['anchor']} (T(c)/T(none) at {res['longest']}: {res['anchor_overhead']:.3f}; at the maximum "
              "length: " + ", ".join(f"{p} {s * 1e3:.0f} ms" for p, s in res["anchor_times_max"].items()) + ")")
    print("  tokens/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in res["tokens_per_s"].items()))
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
        lo, hi = res["ratio_d_range"]
        print(f"  ceiling: (d) none on every batch (over the budget on the longest) / (c) tokens/s "
              f"{res['ceiling']:.3f}; "
              f"(a)/(d) {res['ratio_d']:.3f} (rounds {lo:.3f}..{hi:.3f}); step time (a)/(d) per bucket: "
              + ", ".join(f"{b}: {v:.3f}" for b, v in res["per_bucket_vs_none"].items()))
    verdict(res["worst"] <= OVER * res["budget"], f"largest step (the callback's figure, calibration included) "
                                                   f"{format_bytes(res['worst'])} <= {OVER:.2f} x budget "
                                                   f"{format_bytes(res['budget'])}")
    verdict(res["max_error_after_first"] <= ERROR, f"prediction error after each bucket's first step: max "
                                                   f"{res['max_error_after_first']:.1%} <= {ERROR:.0%} "
                                                   f"({res['errors_measured']} steps)")
    first = [r for r in res["rows"] if r["first"]]
    print("  first step of each bucket: " + ", ".join(
        f"{r['length']}: {r['error']:+.1%}" if r["error"] is not None else f"{r['length']}: -" for r in first))
    cur = res["curriculum"]
    verdict(cur["peak"] is not None and cur["peak"] <= OVER * cur["budget"],
            f"curriculum ({CURRICULUM} tokens for {CURRICULUM_STEPS} steps, "
            f"{'calibrated' if cur['calibrated'] else 'calibration NOT over'}, then {res['longest']}): first long "
            f"step {format_bytes(cur['peak']) if cur['peak'] else '-'} under {B.mix(cur['plan'])} <= budget")
    return ok


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--batches", type=int, default=None, help="batches in the sequence (default 32; --quick 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    B.add_size_arguments(p)
    args = p.parse_args(argv)
    args.batches = args.batches or (12 if args.quick else 32)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    B.resolve_sizes(args)
    T.quiet()
    print("\n".join(header_lines([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])))
    print(f"load average at start: {load_average()}")
    results, ok = [], True
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        res = run_case(model, args, args.precision)
        ok &= print_case(res)
        results.append(res)
    print(f"\nload average at end: {load_average()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
