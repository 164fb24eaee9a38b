"""``auto_threshold`` in a Trainer: the auto-toggle, and its threshold applied per batch shape before each step.

The engine (:mod:`lightning_ckpt.lightning.engine`) makes one :class:`AutoToggle` each time it applies the plan of a
fit with ``auto_threshold``, and calls it at its hooks; the out-of-memory guard tells it of a retry on a stronger
rung (:meth:`AutoToggle.escalated`). It holds the
:class:`~lightning_ckpt.decide.controller.Controller` (a pure state machine along ``ladder``: up as soon as the
activation peak crosses the threshold, down after ``cooldown`` calm steps when the rung below is predicted under
``release × threshold``) and, with ``per_shape``, the :class:`~lightning_ckpt.lightning.gate.ShapeGate` that puts a
batch longer than any before it on the rung it needs before its forward. It reaches the run through its
:class:`~lightning_ckpt.lightning.port.PlanPort` only.

The controller decides on the measured activation line of every ``decide_every_n_steps``-th optimizer step, the
maximum over ranks (every rank decides alike); a step the gate raised above the controller's rung says nothing of
that rung, and is not decided on. A resumed fit goes on from the checkpoint's controller state (its rung, its
cooldown, what it learned).

Logged (with the engine's figures, on measured steps): ``checkpointing/level``, the controller's rung.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from lightning_ckpt.core.units import GiB
from lightning_ckpt.decide.controller import Controller, resolve_threshold
from lightning_ckpt.lightning.feature import Feature, StepEnd, StepNeeds
from lightning_ckpt.lightning.gate import ShapeGate
from lightning_ckpt.lightning.port import PlanPort

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["AutoToggle"]


class AutoToggle(Feature):
    """The auto-toggle of one fit (see the module docstring).

    Args:
        port: what the feature reaches of the run; its ``capacity`` (the device's memory in bytes) is what a
            fractional ``auto_threshold`` is a share of.
    """

    state_key = "controller"
    made_at = "plan"

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        s = port.settings
        self._capacity = port.capacity
        self.controller = Controller(threshold=resolve_threshold(s.auto_threshold, self._capacity), ladder=s.ladder,
                                     release=s.release, cooldown=s.cooldown, level=s.ladder.index(s.start.spec))
        self.gate: Optional[ShapeGate] = None

    @classmethod
    def wanted(cls, settings: Any) -> bool:
        return settings.auto_threshold is not None

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """At fit start: a fractional threshold follows the capacity read again after the strategy's set-up; the gate
        per batch shape (``per_shape``), and the ranks' host group the decisions agree through."""
        capacity = self.port.capacity
        if capacity is not None and capacity != self._capacity:
            self._capacity = capacity
            self.controller.threshold = resolve_threshold(self.port.settings.auto_threshold, capacity)
        if self.port.settings.per_shape:
            self.gate = ShapeGate(self.port, self.controller, self.controller.threshold)
            self.gate.setup(trainer)
        self.port.ranks.setup(trainer)  # it decides on the reduced activation line: gathered on the host

    def escalated(self, failed: str, now: str) -> str:
        """An out-of-memory retry moved the plan from ``failed`` to the rung ``now``. A micro-batch the gate had put
        above the controller's rung: its bucket learns it needs ``now``, the controller nothing. Otherwise the
        controller counts its steps from ``now`` on and must not walk back into ``failed``."""
        ladder, controller = list(self.port.settings.ladder), self.controller
        if failed in ladder and self.gate is not None and ladder.index(failed) > controller.level:
            self.gate.out_of_memory(ladder.index(now))
            return ""
        controller.level = ladder.index(now)
        controller.since_switch = controller.calm_steps = 0
        if failed in ladder:
            controller.out_of_memory(ladder.index(failed))
        return ""

    def step_needs(self, trainer: "pl.Trainer") -> StepNeeds:
        """A decision step (every ``decide_every_n_steps``-th optimizer step) is measured, its activation line agreed
        across ranks."""
        deciding = trainer.global_step % self.port.settings.decide_every_n_steps == 0
        return StepNeeds(measure=deciding, decide=deciding)

    # ------------------------------------------------------------------------------------------ the step
    def before_micro_batch(self, trainer: "pl.Trainer", batch: Any, first: bool) -> None:
        if self.gate is not None:  # the threshold for this batch's shape, before its forward
            self.gate.before_micro_batch(trainer, batch, first=first)

    def after_step(self, step: StepEnd) -> None:
        """The controller's rung joins the step's figures; on a decision step it reads the activation line."""
        step.metrics[step.key("checkpointing/level")] = float(self.controller.level)
        if step.deciding:
            self._decide(step)

    def _decide(self, step: StepEnd) -> None:
        reading = step.metrics.get(step.key("memory/activations_gib"))
        if reading is None:
            return
        if self.gate is not None:
            self.gate.after_step(round(reading * GiB))
            if self.gate.raised:  # the step ran above the controller's rung: it says nothing of that rung
                return
        decision = self.controller.observe(reading * GiB)
        if decision.changed:
            self.port.change_plan(decision.policy)
            plan = self.port.plan
            self.port.info(f"step {step.trainer.global_step}: {decision.reason} ({plan.num_checkpointed}/"
                           f"{plan.num_blocks} blocks checkpointed)")

    # ------------------------------------------------------------------------------------------ the end
    def report_section(self) -> Dict[str, Any]:
        """The report's ``shape_gate``: per batch-shape bucket, the lowest policy the gate found."""
        return {"shape_gate": self.gate.report()} if self.gate is not None and self.gate.needed else {}

    def state_dict(self) -> Dict[str, Any]:
        """The controller's state (primitives)."""
        return self.controller.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A checkpoint's controller: its rung is the plan from now on (a warning for each thing it could not
        restore)."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        for note in self.controller.load_state_dict(state):
            rank_zero_warn(f"lightning_ckpt: {note}")
        self.port.change_plan(self.controller.policy)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()
