"""``lightning-ckpt`` / ``python -m lightning_ckpt``: the command line.

Sub-commands:

- ``plan``: predict the training-memory ledger for a card you do not have, from numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

__all__ = ["main"]


def _plan_parser(sub) -> None:
    from lightning_ckpt.planner import DEFAULT_POLICIES, KORTHIKANTI_TENSORS

    p = sub.add_parser("plan", help="predict the memory ledger from numbers",
                       description="Predict parameters, gradients, optimizer state and activations per policy.")
    p.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 1.3e9")
    p.add_argument("--param-dtype", default="bf16")
    p.add_argument("--grad-dtype", default="bf16")
    p.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, momentum, adafactor, lion")
    p.add_argument("--moment-dtype", default="fp32")
    p.add_argument("--master-dtype", default="none", help="dtype of a master copy of the weights, or none")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--act-dtype", default="bf16")
    p.add_argument("--tensors-per-block", type=float, default=KORTHIKANTI_TENSORS,
                   help=f"hidden-width tensors a block keeps for backward (default {KORTHIKANTI_TENSORS}, after "
                        "Korthikanti et al. with a fused attention kernel; the seed's simplified example uses 6)")
    p.add_argument("--attention", default="fused", choices=["fused", "eager"])
    p.add_argument("--capacity", default=None, help="device capacity, e.g. 24GiB")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes) instead of a table")


def _run_plan(args) -> int:
    from lightning_ckpt.planner import LedgerInputs, plan_from_numbers
    from lightning_ckpt.units import parse_size

    if args.capacity is not None and args.capacity.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"--capacity={args.capacity!r} needs a unit, e.g. '24GiB' or '80GB'.")
    inputs = LedgerInputs(
        params=args.params, param_dtype=args.param_dtype, grad_dtype=args.grad_dtype, optimizer=args.optimizer,
        moment_dtype=args.moment_dtype, master_dtype=args.master_dtype, layers=args.layers, hidden=args.hidden,
        micro_batch=args.micro_batch, seq_len=args.seq_len, act_dtype=args.act_dtype, heads=args.heads,
        tensors_per_block=args.tensors_per_block, attention=args.attention,
        capacity=None if args.capacity is None else parse_size(args.capacity, name="--capacity"),
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
    )
    plan = plan_from_numbers(inputs)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
    else:
        print(_plan_table(plan))
    return 0


def _plan_table(plan) -> str:
    from lightning_ckpt.units import GiB, MiB

    cap = plan.capacity
    rows = [f"{'line':<22}{'GiB':>10}{'% of capacity':>16}" if cap else f"{'line':<22}{'GiB':>10}"]
    for name, size in plan.lines() + [("model state", plan.model_state)]:
        rows.append(f"{name:<22}{size / GiB:>10.2f}" + (f"{size / cap:>16.1%}" if cap else ""))
    rows.append(f"one hidden-width tensor: {plan.hidden_tensor / MiB:.0f} MiB; boundaries with every block "
                f"checkpointed: {plan.boundary_all / MiB:.0f} MiB; one block's interior: "
                f"{plan.block_interior / MiB:.0f} MiB")
    rows.append(f"{'policy':<14}{'activations GiB':>17}{'peak GiB':>10}  verdict")
    for policy, act in plan.activations.items():
        verdict = "capacity unknown (pass --capacity)"
        if cap:
            crossing = plan.crosses[policy]
            verdict = (f"fits, {(cap - plan.peak[policy]) / GiB:.2f} GiB to spare" if crossing is None
                       else f"does not fit: the {crossing} line crosses {cap / GiB:.0f} GiB")
        rows.append(f"{policy:<14}{act / GiB:>17.2f}{plan.peak[policy] / GiB:>10.2f}  {verdict}")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {"plan": _run_plan}[args.command](args)
    except (ValueError, TypeError) as err:
        print(f"lightning-ckpt {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
