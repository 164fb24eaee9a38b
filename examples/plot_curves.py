"""Render the memory ledger, tokens/s and checkpointing curves of a run from its TensorBoard event files.

Reads what :class:`lightning_ckpt.ActivationCheckpointing` logged (``memory/*_gib``,
``throughput/tokens_per_sec``, ``checkpointing/blocks``, ``checkpointing/level``) with TensorBoard's
``EventAccumulator`` and draws three panels with matplotlib (Agg backend, no display needed)::

    python examples/train_gpt.py --max-steps 60        # writes runs/gpt/version_N
    python examples/plot_curves.py                     # newest runs/gpt/version_* -> docs/memory_curves.png
    python examples/plot_curves.py --logdir runs/gpt --out docs/memory_curves.png   # the same, spelled out
    python examples/plot_curves.py runs/gpt/version_3 --out curves.png --prefix ""

Lines that were not logged are left out (on a CPU there are no allocator lines: ``peak_allocated``,
``peak_reserved``, ``other``, ``cache`` exist only on CUDA). Memory is in MiB when every line is under 1 GiB.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ledger lines in drawing order, with a fixed colour each so every picture reads the same way
MEMORY_LINES = (
    ("peak_reserved", "peak reserved", "#7f7f7f", "--"),
    ("peak_allocated", "peak allocated", "#000000", "--"),
    ("params", "params", "#1f77b4", "-"),
    ("grads", "grads", "#ff7f0e", "--"),  # dashed: without freezing, grads lie exactly on params
    ("optimizer", "optimizer", "#2ca02c", "-"),
    ("activations", "activations", "#d62728", "-"),
    ("autocast_copies", "autocast copies", "#e377c2", "-."),
    ("other", "other", "#9467bd", ":"),
    ("cache", "allocator cache", "#8c564b", ":"),
)

Series = Tuple[List[int], List[float]]


def newest_run(root: str) -> str:
    """The ``version_N`` folder with the largest ``N`` that holds an event file."""
    runs = []
    for folder in glob.glob(os.path.join(root, "version_*")):
        m = re.fullmatch(r"version_(\d+)", os.path.basename(folder))
        if m and glob.glob(os.path.join(folder, "events.out.tfevents.*")):
            runs.append((int(m.group(1)), folder))
    if not runs:
        raise SystemExit(
            f"plot_curves: no runs/…/version_N with event files under {root!r}; run "
            "`python examples/train_gpt.py` first or pass the run folder."
        )
    return max(runs)[1]


def read_scalars(run_dir: str) -> Dict[str, Series]:
    """Every scalar tag of a run folder (all its event files) as ``{tag: (steps, values)}``."""
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        out[tag] = ([e.step for e in events], [e.value for e in events])
    return out


def render(scalars: Dict[str, Series], out: str, prefix: str = "", title: Optional[str] = None) -> List[str]:
    """Draw the three panels; returns the tags drawn (raises if the run holds no ``memory/`` lines)."""
    root = f"{prefix}/" if prefix else ""
    memory = [
        (f"{root}memory/{key}_gib", label, color, style)
        for key, label, color, style in MEMORY_LINES
        if f"{root}memory/{key}_gib" in scalars
    ]
    if not memory:
        raise SystemExit(
            f"plot_curves: no {root}memory/*_gib scalars in this run; was it trained with "
            "ActivationCheckpointing(measure=True) and a logger?"
        )
    peak = max(max(scalars[tag][1]) for tag, *_ in memory)
    unit, scale = ("GiB", 1.0) if peak >= 1.0 else ("MiB", 1024.0)

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=100, gridspec_kw={"width_ratios": [1.5, 1, 1]})
    drawn = []
    ax = axes[0]
    for tag, label, color, style in memory:
        steps, values = scalars[tag]
        ax.plot(steps, [v * scale for v in values], style, color=color, label=label, marker=".", markersize=4)
        drawn.append(tag)
    if not any("peak_allocated" in tag for tag, *_ in memory):
        ax.text(
            0.02,
            0.5,
            "no allocator lines: CPU run (peak allocated/reserved,\nother and cache exist on CUDA only)",
            transform=ax.transAxes,
            fontsize=7,
            color="#555555",
            va="center",
        )
    ax.set_title("Memory ledger (per optimizer step)")
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best")

    ax = axes[1]
    tag = f"{root}throughput/tokens_per_sec"
    if tag in scalars:
        steps, values = scalars[tag]
        ax.plot(steps, values, color="#17becf", marker=".", markersize=4)
        drawn.append(tag)
    ax.set_title("Throughput")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)

    ax = axes[2]
    for tag, label, color in (
        (f"{root}checkpointing/blocks", "blocks checkpointed", "#e377c2"),
        (f"{root}checkpointing/level", "ladder level", "#bcbd22"),
    ):
        if tag in scalars:
            steps, values = scalars[tag]
            ax.step(steps, values, where="post", color=color, label=label, marker=".", markersize=4)
            drawn.append(tag)
    ax.set_title("Checkpointing")
    ax.set_xlabel("step")
    ax.set_ylabel("count")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8, loc="lower right")

    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return drawn


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "run",
        nargs="?",
        default=None,
        help="a run folder with event files (default: the newest runs/gpt/version_*)",
    )
    p.add_argument("--logdir", "--runs", dest="runs", default="runs/gpt",
                   help="where to look for the newest version_* when no run is given (default runs/gpt)")
    p.add_argument("--out", default=str(ROOT / "docs" / "memory_curves.png"))
    p.add_argument("--prefix", default="", help="the callback's prefix argument, if one was used")
    args = p.parse_args(argv)
    run = args.run or newest_run(args.runs)
    scalars = read_scalars(run)
    title = f"lightning_ckpt curves of {os.path.relpath(run)}"
    drawn = render(scalars, args.out, prefix=args.prefix, title=title)
    print(f"read {run}: drew {len(drawn)} series -> {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")


if __name__ == "__main__":
    sys.exit(main())
