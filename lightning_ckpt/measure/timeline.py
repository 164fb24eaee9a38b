"""A picture of one step: live bytes over the step's operations, stacked by ledger line.

From an attributed exact step's log (:mod:`lightning_ckpt.measure.attribution`; on the CPU the whole memory's, on
CUDA the activation line's) :func:`build_timeline` sweeps every storage's life and stacks, at each event, the bytes
of each line of the ledger:

- ``parameters``, ``gradients`` and ``optimizer state`` that existed when the step started (on the CPU followed
  until freed: Lightning's ``zero_grad`` frees the gradients before the backward; on CUDA constant bands);
- ``gradients``: storages made in backward that are a parameter's ``.grad`` at the end of the step;
- ``optimizer state`` made in the optimizer phase and alive at its end (Adam's moments on the first step);
- ``activations``: what is kept for backward, and a checkpointed block's replay transient;
- ``autocast copies``: autocast's low-precision weights;
- ``temporaries``: everything else (the batch, activation gradients, the loss's upcast, an update's scratch).

The forward / backward / optimizer boundaries are kept, and the peak with its three largest tensors.
:func:`draw_timelines` draws one or several (plans side by side) with matplotlib, which is optional: an extra
(``pip install lightning_ckpt[examples]``), not a dependency; without it nothing is drawn and nothing fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from lightning_ckpt.core.units import format_bytes, unit_for
from lightning_ckpt.measure.attribution import AllocationLog, role_of

__all__ = ["CATEGORIES", "Timeline", "build_timeline", "draw_timelines", "matplotlib_available"]

CATEGORIES = ("parameters", "optimizer state", "gradients", "activations", "autocast copies", "temporaries")


@dataclass
class Timeline:
    """Live bytes per ledger line over one step's events (see the module docstring)."""

    x: List[int]
    layers: Dict[str, List[int]]
    boundaries: List[Tuple[int, str]] = field(default_factory=list)
    peak_x: int = 0
    peak_bytes: int = 0
    peak_tensors: List[str] = field(default_factory=list)
    label: str = ""

    def as_dict(self) -> Dict[str, Any]:
        return {"label": self.label, "x": self.x, "layers": self.layers, "boundaries": self.boundaries,
                "peak_x": self.peak_x, "peak_bytes": self.peak_bytes, "peak_tensors": self.peak_tensors}


def _category(r: Any, grad_keys: Set[int]) -> str:
    if r.state is not None:
        return r.state
    if r.copy:
        return "autocast copies"
    role = role_of(r, r.end if r.end is not None else 10**18)
    if role in ("kept", "replay") and (r.twin is not None or r.grad_mode):
        return "activations"
    if r.key in grad_keys and r.phase == "backward":
        return "gradients"
    if r.phase == "optimizer" and r.end is None:
        return "optimizer state"
    return "temporaries"


def build_timeline(log: AllocationLog, base: Dict[str, int], grad_keys: Set[int] = frozenset(), points: int = 600,
                   label: str = "", boundaries: Optional[Sequence[Tuple[int, str]]] = None) -> Timeline:
    """Stack ``log``'s storages by ledger line over its events, on top of ``base`` (``parameters`` and
    ``optimizer state`` bytes alive before the step); ``grad_keys`` are the storage keys of the parameters'
    ``.grad`` at the end of the step; ``boundaries``, the phases' (default: the log's). Sampled to at most
    ``points`` events, the peak's among them."""
    end = max(log.events, 1)
    deltas: Dict[str, List[int]] = {c: [0] * (end + 1) for c in CATEGORIES}
    category = {id(r): _category(r, grad_keys) for r in log.records}
    for r in log.records:
        column = deltas[category[id(r)]]
        column[r.start] += r.nbytes
        if r.end is not None:
            column[r.end] -= r.nbytes
    series: Dict[str, List[int]] = {}
    for name in CATEGORIES:
        running, out = base.get(name, 0), []
        for d in deltas[name][:end]:
            running += d
            out.append(running)
        series[name] = out
    total = [sum(series[c][i] for c in CATEGORIES) for i in range(end)]
    peak = max(range(end), key=total.__getitem__)
    step = max(1, end // points)
    xs = sorted(set(range(0, end, step)) | {peak, end - 1})
    alive = sorted((r for r in log.alive(peak) if r.state is None), key=lambda r: -r.nbytes)[:3]
    tensors = [f"{format_bytes(r.nbytes)} {category[id(r)]}: {r.module or '(no module)'} ({r.op}) {tuple(r.shape)}"
               for r in alive]
    boundaries = [(b, phase) for b, phase in (log.boundaries if boundaries is None else boundaries) if 0 <= b < end]
    return Timeline(xs, {c: [series[c][i] for i in xs] for c in CATEGORIES}, boundaries, peak, total[peak],
                    tensors, label)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


_COLORS = {"parameters": "#4c72b0", "optimizer state": "#55a868", "gradients": "#dd8452", "activations": "#c44e52",
           "autocast copies": "#8172b3", "temporaries": "#bbbbbb"}


def draw_timelines(timelines: Sequence[Timeline], path: Optional[str] = None, title: str = "") -> Any:
    """Draw the timelines side by side (one panel each, one y scale) and save a PNG at ``path``; returns the
    matplotlib figure (``None`` without matplotlib)."""
    if not matplotlib_available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max((t.peak_bytes for t in timelines), default=1)
    unit, scale = unit_for(top)
    fig, axes = plt.subplots(1, len(timelines), figsize=(6.5 * len(timelines), 4.4), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], timelines):
        ys = [[v / scale for v in t.layers[c]] for c in CATEGORIES]
        ax.stackplot(t.x, ys, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], alpha=0.9)
        for x, phase in t.boundaries:
            ax.axvline(x, color="black", lw=0.8, ls="--")
            ax.text(x, top / scale * 1.02, f" {phase}", fontsize=8, va="bottom")
        ax.annotate(f"peak {format_bytes(t.peak_bytes)}\n" + "\n".join(t.peak_tensors),
                    xy=(t.peak_x, t.peak_bytes / scale),
                    xytext=(0.02, 0.97), textcoords="axes fraction", fontsize=7, va="top",
                    bbox=dict(boxstyle="round", fc="white", alpha=0.85), arrowprops=dict(arrowstyle="->", lw=0.6))
        ax.set_title(t.label, fontsize=10)
        ax.set_xlabel("operations of the step (events)")
        ax.set_ylim(0, top / scale * 1.45)  # room above the curve for the peak's box
    axes[0][0].set_ylabel(f"live memory ({unit})")
    axes[0][-1].legend(loc="upper right", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
