"""``lightning-ckpt frontier``: the fastest per-block plan at every activation budget, beside the fixed modes."""

from __future__ import annotations

import re

from lightning_ckpt.forecast.precision import PRECISIONS
from lightning_ckpt.forecast.profile.frontier import ANCHORS, frontier, frontier_table

__all__ = ["add_parser", "run"]

_BARE_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "frontier", help="the memory / time frontier: the fastest plan at every budget, beside fixed modes",
        description="Calibrate every block in every mode, measure the fixed modes, then at each budget choose the "
                    "fastest per-block mix of off / selective / recompute (/ offload on CUDA), measure it, time "
                    "everything in interleaved rounds, and write frontier.json and frontier.png. The module needs "
                    "an example_batch(micro_batch, seq_len) hook.")
    p.add_argument("model", metavar="PKG.MODULE:CLASS", help="the LightningModule (or module with example_batch)")
    p.add_argument("--init-args", default=None, metavar="JSON", help="keyword arguments as a JSON object")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--budgets", default="8",
                   help="a count of budgets evenly spaced from all's activation peak to none's (default 8), or "
                        "activation budgets such as 40MiB,60MiB")
    p.add_argument("--anchors", default=",".join(ANCHORS),
                   help=f"fixed modes drawn as points (default {','.join(ANCHORS)}; first:half = Megatron block "
                        "with N = half the layers)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one untimed round (default 5)")
    p.add_argument("--precision", default="32-true", choices=list(PRECISIONS))
    p.add_argument("--device", default=None, help="cuda, cpu (default: cuda when available)")
    p.add_argument("--out", default="frontier_out", help="output directory (default frontier_out)")
    p.add_argument("--no-plot", action="store_true", help="no frontier.png")
    p.add_argument("--compile-blocks", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="compile every block as its own graph (block.compile(), default backend inductor): modes are "
                        "priced compiled and the compiler's own budget per block (compiler:<f>) joins them")


def _check_budgets(value: str) -> None:
    """Sizes need a unit: a bare number in a list (``40,60``) would be read as bytes after a full calibration.

    One whole number alone is a count of budgets."""
    if value.strip().isdigit():
        return
    for item in (i.strip() for i in value.split(",")):
        if _BARE_NUMBER.match(item):
            raise ValueError(f"--budgets={value!r}: {item} has no unit; write sizes such as '40MiB,60MiB' (one whole "
                             "number alone is a count of budgets).")


def run(args) -> int:
    _check_budgets(args.budgets)
    report = frontier(args.model, args.init_args, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      budgets=args.budgets, anchors=[a.strip() for a in args.anchors.split(",") if a.strip()],
                      rounds=args.rounds, precision=args.precision, device=args.device, out=args.out,
                      plot=not args.no_plot, compile_blocks=args.compile_blocks)
    print(frontier_table(report))
    print("wrote " + ", ".join(report.outputs.values()))
    return 0
