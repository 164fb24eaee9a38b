"""Where an out-of-memory step goes next: the first rung of the ladder that checkpoints at least as much as the
current plan on every block, and more on one. Never down; ``None`` when nothing on the ladder is stronger.

A block's strength, from keeping the most to the least activation memory on the device:

=============  ====  =============================================================================================
``off``        0     everything saved
``selective``  1     matmul/attention outputs saved, the rest recomputed (``compiler:<f>`` with f > 0 too: the
                     compiler keeps a share of the block's activations)
group region   2     only the region's input saved, but K blocks replayed at once (a K-fold replay transient)
``recompute``  3     only the block's input saved, one block replayed at a time (``compiler:0`` too)
``offload``    4     nothing on the device (its saves live in host memory) — on an accelerator; on the CPU it
                     is the same as ``off``
=============  ====  =============================================================================================

So ``selective``, ``group:K``, ``offload`` and per-block ``modes`` plans (a budget's choice, or blocks that
``stateful="skip"`` keeps off) escalate to the first ladder rung that dominates them, and the default ladder
``none → every:2 → all`` is walked upward in order. Pure Python on :class:`~lightning_ckpt.core.policy.Layout`.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

from lightning_ckpt.core.policy import Layout, compiler_fraction, parse_policy

__all__ = ["block_strength", "next_rung", "stronger", "stronger_rungs"]

_STRENGTH = {"off": 0, "selective": 1, "recompute": 3, "offload": 4}
_GROUPED = 2


def block_strength(layout: Layout, accelerator: bool) -> Tuple[int, ...]:
    """Each block's strength (see the module docstring)."""
    grouped = {i for start, stop in layout.groups for i in range(start, stop)}
    strengths = []
    for i, mode in enumerate(layout.modes):
        if mode == "offload" and not accelerator:
            strengths.append(0)
        elif i in grouped and mode == "recompute":
            strengths.append(_GROUPED)
        elif compiler_fraction(mode) is not None:
            strengths.append(_STRENGTH["recompute" if compiler_fraction(mode) == 0 else "selective"])
        else:
            strengths.append(_STRENGTH[mode])
    return tuple(strengths)


def stronger(new: Layout, old: Layout, accelerator: bool) -> bool:
    """``new`` checkpoints at least as much as ``old`` on every block and more on one."""
    then, now = block_strength(new, accelerator), block_strength(old, accelerator)
    return then != now and all(a >= b for a, b in zip(then, now))


def stronger_rungs(current: Layout, ladder: Sequence[str], accelerator: bool) -> Iterator[str]:
    """The rungs of ``ladder`` that are :func:`stronger` than ``current``, in ladder order."""
    for rung in ladder:
        try:
            layout = parse_policy(rung).layout(len(current.modes))
        except ValueError:  # e.g. blocks: indices beyond this model
            continue
        if stronger(layout, current, accelerator):
            yield rung


def next_rung(current: Layout, ladder: Sequence[str], accelerator: bool) -> Optional[str]:
    """The first rung of ``ladder`` stronger than ``current``; ``None`` when there is none (the caller stops with
    the diagnosis)."""
    return next(stronger_rungs(current, ladder, accelerator), None)
