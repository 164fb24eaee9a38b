"""What every capability of the run implements: :class:`Feature`, and what it hears at a step's end, :class:`StepEnd`.

The engine (:mod:`lightning_ckpt.lightning.engine`) owns the plan and the lifecycle; the reading of each step
(:mod:`lightning_ckpt.lightning.measuring`) asks the features what they need of it and hands them every measured step.
Each capability (the logged curves, the end-of-fit report, ``verify``, the blocks compiled one by one, a ``budget:``
policy's run, the auto-toggle, the out-of-memory guard) is one feature. The engine makes each feature (with the engine,
when the plan is applied, or at fit start) and from then on calls every feature it has at the same hooks, in one order,
never asking which one it is; a feature reaches the run only through its
:class:`~lightning_ckpt.lightning.port.PlanPort`; so a new capability is one new feature, and no hook of the engine
grows a branch for it. Each hook here does nothing: a feature overrides the ones it needs.

A feature says itself when it is made (:attr:`Feature.made_at`) and whether a run wants it (:meth:`Feature.wanted`);
the engine's list of feature classes (``FEATURES`` in :mod:`~lightning_ckpt.lightning.engine`) gives the order they
hear each hook in. The out-of-memory guard (:mod:`~lightning_ckpt.lightning.recovery`), a feature itself, asks every
feature whether its steps are retried (:meth:`Feature.retries_out_of_memory`) and tells each of a retry
(:meth:`Feature.escalated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.lightning.port import PlanPort
    from lightning_ckpt.lightning.settings import Settings
    from lightning_ckpt.measure.monitor import StepResult

__all__ = ["NOTHING", "Feature", "StepEnd", "StepNeeds"]


@dataclass(frozen=True)
class StepNeeds:
    """What a feature needs of the optimizer step about to start.

    Attributes:
        measure: its memory is read (the step's ledger is built).
        decide: it is a decision step: its activation line is agreed across ranks before the feature decides.
        eager: compiled code runs eagerly, so the blocks' hooks see each block (a calibration's readings).
        log: its figures are logged: all of them agreed across ranks (one collective), its time and tokens read.
        timed: its time and tokens are read (a step that gives a logged step the time that step could not measure).
    """

    measure: bool = False
    decide: bool = False
    eager: bool = False
    log: bool = False
    timed: bool = False

    @classmethod
    def of(cls, needs: "Iterable[StepNeeds]") -> "StepNeeds":
        """What the features need of the step together: each need any of them has."""
        needs = list(needs)
        return cls(**{name: any(getattr(need, name) for need in needs) for name in cls.__dataclass_fields__})


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
        shape: the step's batch shape (:class:`~lightning_ckpt.decide.shapes.Shape`), read once when it began.
        logging: whether Lightning logs at this step.
        time_owed: a logged step whose time and throughput were left out (some rank ran the per-op instrumentation,
            3-4x slow): the next ordinary step's stand for them.
    """

    trainer: "pl.Trainer"
    result: "StepResult"
    metrics: Dict[str, float]
    key: Callable[[str], str]
    deciding: bool
    shape: Any = None
    logging: bool = False
    time_owed: bool = False


class Feature:
    """One capability of the run, called by the engine at each of these hooks (see the module docstring).

    Attributes:
        state_key: the key a checkpoint keeps its :meth:`state_dict` under (``None``: it keeps nothing), see
            :mod:`lightning_ckpt.lightning.persistence`.
    """

    state_key: Optional[str] = None
    made_at = "engine"
    """When the engine makes it: ``"engine"`` (once, with the engine), ``"plan"`` (each time the plan is applied; a
    checkpoint's state goes in once the plan is) or ``"fit"`` (at each fit start, once the step measurement has
    started; a checkpoint's state goes in then)."""

    @classmethod
    def wanted(cls, settings: "Settings") -> bool:
        """Whether a run with these settings has this feature."""
        return True

    @classmethod
    def make(cls, port: "PlanPort", trainer: "Optional[pl.Trainer]" = None,
             pl_module: "Optional[pl.LightningModule]" = None) -> "Feature":
        """The feature for this run (``trainer`` and ``pl_module``: where it is made when the plan is applied or at
        fit start)."""
        return cls(port)  # type: ignore[call-arg]

    def setup(self, trainer: "pl.Trainer", stage: str) -> None:
        """A Trainer stage starts (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``), its conflicts checked, before
        the strategy is set up."""

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

    def phase_starts(self, name: str) -> None:
        """A phase of the micro-batch in flight starts: ``"backward"``, or ``"optimizer"`` (its optimizer step)."""

    def after_micro_batch(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A training batch ended (every micro-batch, whether or not it ends an optimizer step)."""

    def step_ended(self, trainer: "pl.Trainer", result: "StepResult") -> None:
        """An optimizer step ended, measured or not: ``result`` as it was read, before any feature corrects it."""

    def read_step(self, result: "StepResult") -> "StepResult":
        """A measured step's figures as this feature corrects them, before anyone reads them."""
        return result

    def after_unmeasured_step(self, key: Callable[[str], str]) -> None:
        """An optimizer step ended that was not measured."""

    def after_step(self, step: StepEnd) -> None:
        """A measured optimizer step ended: add its figures to ``step.metrics``, decide for the next one."""

    def figures_ready(self, step: StepEnd) -> None:
        """Every feature added its figures to ``step.metrics``: they are final (the logged curves write them)."""

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

    def retries_out_of_memory(self) -> bool:
        """Whether a step that runs out of memory now is retried under a stronger plan (in one process) whatever
        ``on_oom`` says: a step of its own that may not fit by design."""
        return False

    def escalated(self, failed: str, now: str) -> str:
        """A step ran out of memory under the policy ``failed`` and is retried under ``now`` (its attempt's tensors
        not yet released); what the retry's message adds, in parentheses (``""``: nothing)."""
        return ""

    def annotate(self, exception: BaseException) -> None:
        """The run raised ``exception``: add what this feature knows of it (``exception.add_note``)."""

    def close(self) -> None:
        """The run ends (normally or not): remove every hook it installed."""
