"""``lightning-ckpt`` / ``python -m lightning_ckpt``: the command line.

Sub-commands:

- ``plan``: forecast the training-memory ledger for a card you do not have, from numbers (``--params ...``) or
  from the model itself (``--model pkg.module:factory``, built under fake tensors; see
  :mod:`lightning_ckpt.forecast.trace`).
- ``profile``: measure a LightningModule's step per policy, micro-batch and length, and recommend a
  configuration (see :mod:`lightning_ckpt.forecast.profile`).
- ``frontier``: the fastest per-block plan at every activation budget beside the fixed modes, with a picture
  (see :mod:`lightning_ckpt.forecast.profile.frontier`).
- ``timeline``: a picture of one training step per plan, memory over the step's operations stacked by ledger line
  (see :mod:`lightning_ckpt.measure.timeline`).

Bad input prints one line ``lightning-ckpt <command>: error: ...`` on stderr and exits with status 2, before
anything is written.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from lightning_ckpt.cli import frontier, plan, profile, timeline

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``lightning-ckpt <command>: error: ...``) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="lightning-ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_parser(sub)
    profile.add_parser(sub)
    frontier.add_parser(sub)
    timeline.add_parser(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        return {"plan": plan.run, "profile": profile.run, "frontier": frontier.run,
                "timeline": timeline.run}[args.command](args)
    except (ValueError, TypeError) as err:
        print(f"lightning-ckpt {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
