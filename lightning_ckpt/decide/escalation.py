"""Where an out-of-memory step goes next: the first policy of the ladder that checkpoints at least as much as the
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
``stateful="skip"`` keeps off) escalate to the first ladder policy that dominates them, and the default ladder
``none → every:2 → all`` is walked upward in order. Pure Python on :class:`~lightning_ckpt.core.policy.Layout`.

A policy that offloads is refused (:func:`offload_refusal`, skipped by :func:`stronger_rungs` given a
:class:`HostRoom`) when the host memory of the node cannot hold what it would move: the bytes each block moved in
an earlier offloaded step (:attr:`lightning_ckpt.core.offload.HostOffload.per_block`), summed over the policy's
offloaded blocks and over the node's ranks. Without such a measurement the policy is taken, and the offload hooks
themselves refuse during the step as soon as the host cannot hold what they move
(:class:`~lightning_ckpt.core.offload.HostMemoryError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence, Tuple

from lightning_ckpt.core.offload import offload_state
from lightning_ckpt.core.policy import Layout, compiler_fraction, parse_policy
from lightning_ckpt.core.units import format_bytes

__all__ = ["HostRoom", "block_strength", "host_room", "next_rung", "offload_refusal", "stronger", "stronger_rungs"]

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


def stronger_rungs(current: Layout, ladder: Sequence[str], accelerator: bool,
                   room: Optional["HostRoom"] = None) -> Iterator[str]:
    """The policies of ``ladder`` that are :func:`stronger` than ``current``, in ladder order; with ``room``, without
    the policies :func:`offload_refusal` refuses."""
    for rung in ladder:
        try:
            layout = parse_policy(rung).layout(len(current.modes))
        except ValueError:  # e.g. blocks: indices beyond this model
            continue
        if stronger(layout, current, accelerator) and (room is None or offload_refusal(layout, room) is None):
            yield rung


def next_rung(current: Layout, ladder: Sequence[str], accelerator: bool,
              room: Optional["HostRoom"] = None) -> Optional[str]:
    """The first policy of ``ladder`` stronger than ``current``; ``None`` when there is none (the caller stops with
    the diagnosis)."""
    return next(stronger_rungs(current, ladder, accelerator, room), None)


# ------------------------------------------------------------------------------------------------ host memory


@dataclass(frozen=True)
class HostRoom:
    """What offloading would move and what the host of this node has.

    Attributes:
        available: bytes of host memory the node can give to offload (what the system has available, plus what
            the ranks' offload arenas already hold, which they reuse).
        local_ranks: processes on this node; each moves as much as this one.
        per_block: host bytes each block moved in its last offloaded call on this rank, by block index (measured).
    """

    available: int
    local_ranks: int = 1
    per_block: Mapping[int, int] = field(default_factory=dict)

    def moved(self, layout: Layout) -> Optional[int]:
        """Bytes one rank would move under ``layout``: the measured blocks' figures, the mean of them for offloaded
        blocks not measured yet (repeated blocks move alike); ``None`` when no offloaded block was measured."""
        blocks = [i for i, mode in enumerate(layout.modes) if mode == "offload"]
        known = [self.per_block[i] for i in blocks if i in self.per_block]
        if not blocks or not known:
            return None
        return sum(known) + (len(blocks) - len(known)) * (sum(known) // len(known))


def offload_refusal(layout: Layout, room: Optional[HostRoom]) -> Optional[str]:
    """Why ``layout`` cannot be offloaded on this node (the message names both figures), or ``None``: it can, it
    offloads nothing, or what it would move is not known yet."""
    moved = room.moved(layout) if room is not None else None
    if moved is None:
        return None
    need = moved * room.local_ranks
    if need <= room.available:
        return None
    per_rank = f" ({format_bytes(moved)} per rank × {room.local_ranks} ranks)" if room.local_ranks > 1 else ""
    return (f"offload refused; keep a recompute plan ('all'), a smaller micro-batch, or free host memory: its blocks "
            f"would hold {format_bytes(need)} of host memory on this node{per_rank}, measured in an earlier "
            f"offloaded step, and the host has {format_bytes(room.available)} available.")


def host_room(plan: Any) -> Optional[HostRoom]:
    """The :class:`HostRoom` of a :class:`~lightning_ckpt.core.wrap.CheckpointPlan` from its offload state (host
    memory read now); ``None`` when the plan has never offloaded."""
    state = offload_state(plan, create=False)
    if state is None or not state.per_block:
        return None
    own = state.pinned_bytes * state.local_ranks
    return HostRoom(available=state.host_memory() + own, local_ranks=state.local_ranks,
                    per_block=dict(state.per_block))
