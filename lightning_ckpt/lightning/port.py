"""The narrow port a feature reaches the run through: :class:`PlanPort`.

A feature (the per-shape plans, the auto-toggle's gate per batch shape) needs a few things of the run: the plan and
the one way to change it, with its safety check; the model; the settings; the ranks' group; the device's capacity;
the model state of the last measured step; and a way to tell the user something. It gets exactly those, through
this port, and never the engine that owns them: a feature cannot widen the engine's hooks or read its bookkeeping,
and a test can hand it a port of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

if TYPE_CHECKING:  # pragma: no cover
    from lightning_ckpt.core.policy import Policy
    from lightning_ckpt.core.wrap import CheckpointPlan
    from lightning_ckpt.lightning.settings import Settings
    from lightning_ckpt.measure.ledger import Ledger

__all__ = ["PlanPort"]


class PlanPort:
    """What a feature may reach of the run (see the module docstring).

    Args:
        engine: the :class:`~lightning_ckpt.lightning.engine.CheckpointingEngine` behind the port (kept private).
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def plan(self) -> "CheckpointPlan":
        """The checkpointing plan in force (read it; change it through :meth:`set_modes` or :meth:`change_plan`)."""
        return self._engine.plan

    @property
    def module(self) -> Any:
        """The LightningModule being trained."""
        return self._engine.module

    @property
    def settings(self) -> "Settings":
        """The callback's arguments, read only."""
        return self._engine.settings

    @property
    def ranks(self) -> Any:
        """The host process group the ranks agree through (:class:`~lightning_ckpt.lightning.ranks.HostGroup`)."""
        return self._engine.ranks

    @property
    def capacity(self) -> Optional[int]:
        """The device's memory in bytes, where it is known."""
        return self._engine.capacity

    @property
    def last_ledger(self) -> "Optional[Ledger]":
        """The memory ledger of the last measured step (``None`` before one)."""
        result = self._engine.last_result
        return getattr(result, "ledger", None) if result is not None else None

    def set_modes(self, modes: Sequence[str]) -> None:
        """Put the blocks in ``modes``, with the plan's safety check (the one way a feature changes modes)."""
        self._engine.set_modes(modes)

    def change_plan(self, policy: "Union[str, Policy]", level: Optional[int] = None) -> None:
        """Run ``policy`` from the next forward on (``level``: the auto-toggle's position it stands for)."""
        self._engine.change_plan(policy, level)

    def info(self, message: str) -> None:
        """Tell the user (rank zero, the package's logger)."""
        self._engine.info(message)
