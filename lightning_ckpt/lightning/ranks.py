"""Agreement across ranks on host values, without waiting for the device: :class:`HostGroup`.

What the ranks agree on between steps — a batch's shape, the plan rank zero chose, the measured activation line a
decision reads — are host values. Gathered through the strategy's own (NCCL) group they would go to the device and
back, and the copy back waits for the whole step queued before it: on a run that decides every step, a device sync
every step, and the GPU idle while the host prepares the next one. One gloo group over the same ranks, made once on
every rank before the first step (making it is itself a collective), carries them on the host instead.

It is made only by runs that agree between steps (a budget per shape, the auto-toggle), and only where
``torch.distributed`` is initialized; elsewhere :attr:`HostGroup.group` is ``None`` and callers fall back to the
strategy's own collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["HostGroup"]


class HostGroup:
    """A gloo process group over the job's ranks, for host values (see the module docstring)."""

    def __init__(self) -> None:
        self.group: Optional[Any] = None

    def setup(self, trainer: "pl.Trainer") -> Optional[Any]:
        """Make the group (once; call it on every rank at the same point: it is a collective). ``None`` with one
        process or without ``torch.distributed``."""
        import torch.distributed as dist

        if self.group is None and trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
        return self.group

    def close(self) -> None:
        """Forget the group (the next ``fit`` makes its own: its ranks may be other processes)."""
        self.group = None
