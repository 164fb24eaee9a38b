"""The narrow port a feature reaches the run through: :class:`PlanPort`.

A feature (the per-shape plans, the auto-toggle's gate per batch shape, the out-of-memory guard) needs a few things
of the run: the plan and the one way to change it, with its safety check; the model; the settings; the ranks' group;
the device's capacity; what the last measured step read (its ledger, its figures, its batch's shape, its peak's
tensors); a way to start the open step's measurement over; and a way to tell the user something. It gets exactly
those, through this port, and never the engine that owns them: a feature cannot widen the engine's hooks or read its
bookkeeping, and a test can hand it a port of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:  # pragma: no cover
    from lightning_ckpt.core.policy import Policy
    from lightning_ckpt.core.wrap import CheckpointPlan
    from lightning_ckpt.lightning.feature import Feature
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
    def owner(self) -> str:
        """How the door names itself in messages (``ActivationCheckpointing``, or the ``*_ac`` strategy's class)."""
        return self._engine.owner

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
    def meter(self) -> Any:
        """The step monitor's memory meter (:class:`~lightning_ckpt.measure.meter.StepMeter`), from fit start."""
        return self._engine.measurement.monitor.meter

    @property
    def features(self) -> "Sequence[Feature]":
        """The run's features (:mod:`~lightning_ckpt.lightning.feature`), in the order they hear each hook: the
        out-of-memory guard asks them of a retry."""
        return self._engine.features

    @property
    def last_ledger(self) -> "Optional[Ledger]":
        """The memory ledger of the last measured step (``None`` before one)."""
        result = self._engine.last_result
        return getattr(result, "ledger", None) if result is not None else None

    @property
    def on_accelerator(self) -> bool:
        """Whether the model trains on an accelerator (offloading to the host counts as saving memory there only)."""
        return self._engine.on_accelerator

    @property
    def last_metrics(self) -> Dict[str, float]:
        """The figures of the last measured step, as logged (reduced across ranks where they were)."""
        return self._engine.measurement.last_metrics

    @property
    def batch_shape(self) -> "Optional[Tuple[Optional[int], int]]":
        """(sequence length, samples) of the open step's largest micro-batch, where the batch says."""
        return self._engine.measurement.batch_shape

    def peak_anatomy(self) -> Optional[Dict[str, Any]]:
        """What the last reference step's activation peak held (the report's ``peak`` section); ``None`` before one."""
        report, module = self._engine.run_report, self._engine.module
        if report.last_attribution is None:
            return None
        return report.peak_anatomy(module.trainer if module is not None else None)

    def restart_step(self) -> None:
        """Measure the open step again from now, under the plan it now runs (a retry after an out-of-memory error)."""
        self._engine.measurement.restart()

    def set_modes(self, modes: Sequence[str]) -> None:
        """Put the blocks in ``modes``, with the plan's safety check (the one way a feature changes modes)."""
        self._engine.set_modes(modes)

    def change_plan(self, policy: "Union[str, Policy]") -> None:
        """Run ``policy`` from the next forward on."""
        self._engine.change_plan(policy)

    def restore_plan(self, state: Dict[str, Any]) -> None:
        """Put back a checkpoint's plan (its policy, then its modes), with the plan's safety check."""
        self._engine.restore_plan(state)

    def info(self, message: str) -> None:
        """Tell the user (rank zero, the package's logger)."""
        self._engine.info(message)
