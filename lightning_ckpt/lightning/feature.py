"""What every capability of the run implements: :class:`Feature`, and what it hears at a step's end, :class:`StepEnd`.

The engine (:mod:`lightning_ckpt.lightning.engine`) owns the plan and the lifecycle; the measurement of each step
(:mod:`lightning_ckpt.lightning.measuring`) hands every measured step to the features. Each capability (``verify``,
the blocks compiled one by one, a ``budget:`` policy's run, the auto-toggle) is one feature. The engine makes each
feature (with the engine, when the plan is applied, or at fit start) and from then on calls every feature it has at
the same hooks, in one order, never asking which one it is; a feature reaches the run only through its
:class:`~lightning_ckpt.lightning.port.PlanPort`; so a new capability is one new feature, and no hook of the engine
grows a branch for it. Each hook here does nothing: a feature overrides the ones it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.measure.monitor import StepResult

__all__ = ["NOTHING", "Feature", "StepEnd", "StepNeeds"]


@dataclass(frozen=True)
class StepNeeds:
    """What a feature needs of the optimizer step about to start.

    Attributes:
        measure: its memory is read (the step's ledger is built).
        decide: it is a decision step: its activation line is agreed across ranks before the feature decides.
        eager: compiled code runs eagerly, so the blocks' hooks see each block (a calibration's readings).
    """

    measure: bool = False
    decide: bool = False
    eager: bool = False


NOTHING = StepNeeds()  # what a feature needs of a step it has no part in


@dataclass
class StepEnd:
    """A measured optimizer step, at its end, as the features hear of it.

    Attributes:
        trainer: the Trainer.
        result: the step's measurement (its ledger, its time).
        metrics: the step's figures as they will be logged (reduced across ranks where they are); a feature adds its
            own keys here.
        key: a metric's full key from its name (the callback's ``prefix`` put in front).
        deciding: whether this is a decision step of the auto-toggle (``decide_every_n_steps``).
    """

    trainer: "pl.Trainer"
    result: "StepResult"
    metrics: Dict[str, float]
    key: Callable[[str], str]
    deciding: bool


class Feature:
    """One capability of the run, called by the engine at each of these hooks (see the module docstring).

    Attributes:
        state_key: the key a checkpoint keeps its :meth:`state_dict` under (``None``: it keeps nothing), see
            :mod:`lightning_ckpt.lightning.persistence`.
    """

    state_key: Optional[str] = None

    def plan_applied(self, trainer: "pl.Trainer") -> None:
        """The plan was just applied to the model: by the strategy's set-up, before it wraps the model (at fit start
        where that set-up was bypassed)."""

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A fit starts (the strategy is set up, the step measurement exists)."""

    def before_batch(self, pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        """A training batch is about to run, before anything of its step is measured."""

    def step_needs(self, trainer: "pl.Trainer") -> StepNeeds:
        """What it needs of the optimizer step about to start (a pure read, asked once, before the step's plan is
        set)."""
        return NOTHING

    def exact_reading(self) -> Any:
        """What a measured step must read exactly, asked once its plan is set (``None``: the usual rhythm,
        ``exact_every_n_steps``)."""
        return None

    def before_micro_batch(self, trainer: "pl.Trainer", batch: Any, first: bool) -> None:
        """Before a micro-batch's forward (``first``: the first of an optimizer step): the plan it runs."""

    def after_micro_batch(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A training batch ended (every micro-batch, whether or not it ends an optimizer step)."""

    def read_step(self, result: "StepResult") -> "StepResult":
        """A measured step's figures as this feature corrects them, before anyone reads them."""
        return result

    def after_unmeasured_step(self, key: Callable[[str], str]) -> None:
        """An optimizer step ended that was not measured."""

    def after_step(self, step: StepEnd) -> None:
        """A measured optimizer step ended: add its figures to ``step.metrics``, decide for the next one."""

    def fit_end(self, trainer: "pl.Trainer") -> None:
        """The fit ended normally."""

    def report_section(self) -> Dict[str, Any]:
        """Its sections of the end-of-fit report (JSON-ready), by name; none by default."""
        return {}

    def report_text(self, data: Dict[str, Any]) -> str:
        """Its lines of the printed report (``data``: the whole report, its sections included), each starting with
        a newline; none by default."""
        return ""

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of it (primitives), under :attr:`state_key`."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A checkpoint's :meth:`state_dict` of it: go on from there."""

    def close(self) -> None:
        """The run ends (normally or not): remove every hook it installed."""
