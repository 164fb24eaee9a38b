"""The auto-toggle's threshold applied per batch shape, before each step: :class:`ShapeGate`.

The auto-toggle (:class:`~lightning_ckpt.decide.controller.Controller`) moves along its ladder *after* a measured
step crossed the threshold: a batch longer than any before it is run on the rung sized for the shorter ones, and on a
full card that step is the out-of-memory error. The gate runs before each micro-batch's forward: for the batch's
bucket (:mod:`lightning_ckpt.decide.shapes`) it finds, once, the lowest rung whose activation peak at the bucket's
shape stays under the threshold — each rung traced on fake tensors of the model itself
(:func:`~lightning_ckpt.decide.pricing.trace_plans`), carried into the device's units by the first measured step
(its reading over its own trace: 1 on the CPU) — and the step runs on ``max(the controller's rung, the bucket's)``.
The first batch's bucket is the controller's own and is never gated: a run whose batches all have one shape behaves
exactly as without the gate (measured, then moved).

The controller keeps its own rung and learns only from the steps that ran on it: a step the gate raised read a
rung above the controller's, which says nothing of the controller's own. So short batches go back to the
controller's rung at once, and long ones are raised before they run, every time. Several processes: each rank gates
its own batch, with no collective (a step that neither logs nor decides stays free of them), so in one step the
ranks may run different rungs; the gradients are the same whatever the rung. (A sharded model, where the ranks'
replays gather parameters together, is not traced on fake tensors: there the gate is off.)

A step the gate raised that runs out of memory anyway (its trace read low) is retried one rung up by the escalation,
and the bucket keeps that rung from then on (:meth:`ShapeGate.out_of_memory`): the controller's own rung, which the
bucket's batches do not run on, is left alone.

A model that cannot be traced on fake tensors (:class:`~lightning_ckpt.decide.pricing.PricingError`) is not gated:
a warning says so once, and the controller alone decides, after the steps, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.decide.choose import choose_checked
from lightning_ckpt.decide.pricing import PricingError
from lightning_ckpt.decide.shapes import Shape, bucket_of
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.lightning.shaped import ShapeReader

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.decide.controller import Controller

__all__ = ["ShapeGate"]


class ShapeGate(ShapeReader):
    """The lowest rung each bucket needs, and the rung each step runs on (see the module docstring).

    Args:
        port: what it may reach of the run (:class:`~lightning_ckpt.lightning.port.PlanPort`).
        controller: the auto-toggle's :class:`~lightning_ckpt.decide.controller.Controller` (its rung is read, never
            moved here).
        threshold: the auto-toggle's threshold in bytes.
    """

    def __init__(self, port: PlanPort, controller: Controller, threshold: int) -> None:
        super().__init__(port)
        self.controller = controller
        self.threshold = threshold
        self.needed: Dict[Shape, int] = {}  # bucket -> lowest rung whose predicted peak is under the threshold
        self.predicted: Dict[Shape, int] = {}  # bucket -> that rung's predicted peak (bytes)
        self.raised = False  # the step in flight runs above the controller's rung
        self.home: Optional[Shape] = None  # the first batch's bucket: the controller's own, measured, never gated
        self._unit: Optional[float] = None  # device bytes per traced byte, from the first measured step
        self._measured: Optional[tuple] = None  # (shape, rung, activation peak) of a measured step, for the unit
        self._shape: Optional[Shape] = None
        self.bucket: Optional[Shape] = None  # the bucket of the micro-batch in flight
        self._off = False  # tracing failed: the controller alone decides

    def before_micro_batch(self, trainer: "pl.Trainer", batch: Any, first: bool) -> None:
        """Put the micro-batch on ``max(controller's rung, its bucket's)`` (``first``: of an optimizer step)."""
        controller = self.controller
        shape, _ = self.read(trainer, batch, agree=False)  # this rank's own shape: no collective (module docstring)
        if first:
            self._shape, self.raised = shape, False
        bucket = self.bucket = bucket_of(shape)
        if self.home is None:
            self.home = bucket
        level = controller.level if bucket == self.home else max(controller.level, self._needed(bucket))
        self.raised = self.raised or level > controller.level
        rung = self.port.settings.ladder[level]
        if self.port.plan.spec != rung:
            self.port.change_plan(rung)

    def out_of_memory(self, level: int) -> None:
        """The micro-batch in flight, raised above the controller's rung, ran out of memory there and is retried on
        rung ``level``: its bucket needs at least that from now on."""
        if self.bucket is not None and self.bucket != self.home:
            self.needed[self.bucket] = max(self.needed.get(self.bucket, 0), level)

    def _needed(self, bucket: Shape) -> int:
        if self._off:
            return 0
        if bucket not in self.needed:
            try:
                self._plan(bucket)
            except PricingError as err:
                self._off = True
                from lightning.pytorch.utilities.rank_zero import rank_zero_warn

                rank_zero_warn(f"lightning_ckpt: the auto-toggle decides after each step only: its threshold is not "
                               f"applied per batch shape before the step, because the model cannot run on fake "
                               f"tensors ({err}).")
                return 0
        return self.needed[bucket]

    def _plan(self, bucket: Shape) -> None:
        """The budget's choose-check routine (:func:`~lightning_ckpt.decide.choose.choose_checked`) over the rungs:
        choose the lowest rung from the controller's up not traced over the threshold, trace it at the bucket's
        shape, choose again; when every rung reads over, the one with the lowest traced peak."""
        ladder, unit = self.port.settings.ladder, self.unit()
        start = self.controller.level

        def choose(checked: Dict[int, int]) -> int:
            under = [level for level in range(start, len(ladder)) if checked.get(level, 0) <= self.threshold]
            return under[0] if under else min(checked, key=lambda level: (checked[level], level))

        def check(level: int) -> int:
            return round(self.trace(bucket, [ladder[level]])[0] * unit)

        level, peak = choose_checked(choose, check, self.threshold, seconds=float, tries=len(ladder) - start)
        self.needed[bucket], self.predicted[bucket] = level, peak
        if level > start or peak > self.threshold:
            fits = "" if peak <= self.threshold else " (over the threshold even there)"
            self.port.info(f"bucket {bucket}: at least policy {ladder[level]!r} before the step, "
                             f"predicted activation peak {format_bytes(peak)} against the threshold "
                             f"{format_bytes(self.threshold)}{fits}")

    def after_step(self, activations: Optional[int]) -> None:
        """A measured step of the controller's own rung: kept, to carry traced bytes into the device's units when a
        bucket is first gated (traced then, not now: a run of one shape never runs its step on fake tensors)."""
        if activations is not None and self._unit is None and self._shape is not None and not self.raised:
            self._measured = (self._shape, self.port.plan.spec, activations)

    def unit(self) -> float:
        """Device bytes per traced byte: the first measured step's reading over its own trace (1 before one)."""
        if self._unit is None and self._measured is not None:
            shape, spec, activations = self._measured
            traced = self.trace(shape, [spec])[0]
            self._unit = activations / traced if traced else 1.0
        return self._unit or 1.0

    def report(self) -> Dict[str, Any]:
        """Per bucket, the lowest policy the gate found and its predicted peak (the report's ``shape_gate``; files
        written before this version name the policy ``rung``, and nothing in the package reads them back)."""
        ladder = self.port.settings.ladder
        return {"threshold": self.threshold, "unit": self._unit,
                "buckets": {str(b): {"policy": ladder[level], "predicted_peak": self.predicted[b]}
                            for b, level in sorted(self.needed.items())}}
