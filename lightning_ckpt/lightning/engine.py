"""The engine behind both doors: one object owns the whole lifecycle of activation checkpointing in a Trainer.

configure (:class:`~lightning_ckpt.lightning.settings.Settings`) → find and apply the blocks' plan right before
the strategy wraps the model → check replay safety on every plan change → measure each optimizer step → decide
(auto-toggle, budget) → recover from out-of-memory → report at the end of ``fit`` → save and restore its state.

:class:`~lightning_ckpt.ActivationCheckpointing` (the callback) translates Lightning's hooks into calls of this
class and nothing else; the ``*_ac`` strategies put that same callback into ``trainer.callbacks``. So both doors
are one code path: the same metrics, the same checks, the same report.

Every change of plan (auto-toggle, budget, escalation, resume) goes through :meth:`CheckpointingEngine.change_plan`.

Each capability is a feature (:class:`~lightning_ckpt.lightning.feature.Feature`), listed in :data:`FEATURES`. The
engine makes each one the run wants when the feature says (with the engine, when the plan is applied, or at fit start),
then calls all it has at every hook, in that list's order: the end-of-fit report
(:mod:`~lightning_ckpt.lightning.reporting`), the logged curves (:mod:`~lightning_ckpt.lightning.curves`), ``verify``
(:mod:`~lightning_ckpt.lightning.verifying`), the blocks compiled one by one
(:mod:`~lightning_ckpt.lightning.compiling`), a ``budget:`` policy's run (:mod:`~lightning_ckpt.lightning.budgeting`),
the auto-toggle (:mod:`~lightning_ckpt.lightning.autotoggle`) and, last, the out-of-memory guard
(:mod:`~lightning_ckpt.lightning.recovery`). The step is the engine's own: its reading
(:mod:`~lightning_ckpt.lightning.measuring`) asks the features what they need of each step, drives the step monitor and
hands them the measured steps; what becomes of the figures is theirs. All of them reach the run through one
:class:`~lightning_ckpt.lightning.port.PlanPort`, never the engine.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Type, TypeVar, Union

from lightning_ckpt.core.offload import release_host_memory
from lightning_ckpt.core.policy import Policy, parse_policy
from lightning_ckpt.core.wrap import CheckpointPlan, apply_policy, get_plan
from lightning_ckpt.decide.escalation import host_room, offload_refusal
from lightning_ckpt.decide.safety import preflight
from lightning_ckpt.lightning import conflicts, shims
from lightning_ckpt.lightning.autotoggle import AutoToggle
from lightning_ckpt.lightning.budgeting import WHOLE_MODEL_COMPILE_BUDGET, BudgetFeature
from lightning_ckpt.lightning.compiling import CompiledBlocks
from lightning_ckpt.lightning.curves import LoggedCurves
from lightning_ckpt.lightning.feature import Feature
from lightning_ckpt.lightning.measuring import StepMeasurement
from lightning_ckpt.lightning.persistence import SavedRun
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.lightning.ranks import HostGroup
from lightning_ckpt.lightning.recovery import StepGuard
from lightning_ckpt.lightning.reporting import REPORT_FILE, TIMELINE_FILE, RunReport
from lightning_ckpt.lightning.settings import Settings
from lightning_ckpt.lightning.verifying import Verification
from lightning_ckpt.measure.meter import device_capacity
from lightning_ckpt.measure.monitor import StepMonitor, StepResult

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    import torch

__all__ = ["FEATURES", "REPORT_FILE", "TIMELINE_FILE", "WHOLE_MODEL_COMPILE_BUDGET", "CheckpointingEngine"]

FEATURES = (RunReport, LoggedCurves, Verification, CompiledBlocks, BudgetFeature, AutoToggle, StepGuard)
"""The run's capabilities, in the order they hear each hook; each is made when it says (``Feature.made_at``), for a
run that wants it (``Feature.wanted``)."""

F = TypeVar("F", bound=Feature)


class CheckpointingEngine:
    """One door's activation checkpointing, from configuration to the end-of-fit report.

    Args:
        settings: the validated arguments of the door.
        owner: how the door describes itself in error messages (``"ActivationCheckpointing"``, or the strategy's
            class name when a ``*_ac`` strategy owns the engine).
    """

    def __init__(self, settings: Settings, owner: str = "ActivationCheckpointing") -> None:
        self.settings = settings
        self.owner = owner
        self.plan: Optional[CheckpointPlan] = None
        self.module: Optional["pl.LightningModule"] = None
        self.on_accelerator = False
        self._skipped: list = []
        self.ranks = HostGroup()  # runs that agree between steps: a gloo group, so agreeing never waits for the device
        self.port = PlanPort(self)  # what the features, the measurement and the report reach of the run
        self.measurement = StepMeasurement(self.port)  # which steps are measured, their figures
        self.capacity: Optional[int] = settings.capacity_bytes
        self.saved = SavedRun(self.port)  # what a checkpoint keeps of the run, and its restoring
        self.features: List[Feature] = []  # the capabilities of this run, in the order of FEATURES
        self._make("engine")

    # ------------------------------------------------------------------------------------------ describing
    @property
    def policy(self) -> Policy:
        """The configured starting policy."""
        return self.settings.start

    def describe(self) -> str:
        """``Owner(policy='every:2')``: used in conflict messages."""
        return f"{self.owner}(policy={self.policy.spec!r})"

    def info(self, message: str) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info(f"lightning_ckpt: {message}")

    @property
    def last_result(self) -> Optional[StepResult]:
        """The last measured step's result this fit (the report's), or ``None``."""
        return self.run_report.last_result

    @property
    def last_attribution(self) -> Optional[Dict[str, Any]]:
        """The last reference step's peaks with their tensors named, or ``None``."""
        return self.run_report.last_attribution

    @property
    def run_report(self) -> RunReport:
        """The end-of-fit report (a feature every run has)."""
        return self.feature(RunReport)

    def feature(self, kind: Type[F]) -> Optional[F]:
        """This run's feature of class ``kind`` (e.g. ``BudgetFeature``), or ``None`` (for the callback's read-only
        properties and for tests)."""
        return next((feature for feature in self.features if isinstance(feature, kind)), None)

    def _make(self, moment: str, trainer: Optional["pl.Trainer"] = None,
              pl_module: Optional["pl.LightningModule"] = None) -> List[Feature]:
        """Make the features made at ``moment`` (``Feature.made_at``) that this run wants, in place of those made
        then before (each fit calibrates again; each applied plan has its own auto-toggle); the new ones."""
        made = [kind.make(self.port, trainer, pl_module) for kind in FEATURES
                if kind.made_at == moment and kind.wanted(self.settings)]
        kept = [feature for feature in self.features if type(feature).made_at != moment]
        self.features = sorted(kept + made, key=lambda feature: FEATURES.index(type(feature)))
        return made

    @property
    def monitor(self) -> Optional[StepMonitor]:
        """This fit's step monitor (:mod:`lightning_ckpt.measure.monitor`), or ``None`` before the fit."""
        return self.measurement.monitor

    @property
    def last_metrics(self) -> Dict[str, float]:
        """The figures of the last measured step, as logged (reduced across ranks where they were)."""
        return self.measurement.last_metrics

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self, trainer: "pl.Trainer", stage: str) -> None:
        """Every run: refuse conflicts; when fitting, arrange for the plan to be applied before strategy setup."""
        self.saved.run_starts()
        found = conflicts.owners(trainer)
        if len(found) > 1:
            raise RuntimeError(conflicts.two_owners_message(found))
        conflicts.check_strategy(trainer.strategy)
        if stage == "fit":
            if self.settings.changes_plan:
                conflicts.refuse_static_graph(trainer.strategy, self.settings.changes_plan)
            shims.run_before_strategy_setup(trainer.strategy, self.apply)
        for feature in self.features:
            feature.setup(trainer, stage)

    def apply(self, trainer: "pl.Trainer") -> CheckpointPlan:
        """Checkpoint the LightningModule's blocks under the starting policy, then re-apply any restored state.

        Idempotent: on a model that already holds a plan, that plan is re-targeted in place (nothing is wrapped
        twice), so ``fit`` twice or ``fit`` then ``validate`` keep one wrapping.
        """
        model = self.module = trainer.lightning_module
        self.on_accelerator = trainer.strategy.root_device.type != "cpu"
        existing = get_plan(model)
        if existing is not None and existing is not self.plan and existing.spec != self.policy.spec:
            warnings.warn(f"lightning_ckpt: the model already holds a plan with policy {existing.spec!r} set outside "
                          f"{self.describe()}; re-targeting it to {self.policy.spec!r}.", RuntimeWarning,
                          stacklevel=2)
        o = self.settings.options
        self.plan = apply_policy(model, self.policy, self.settings.blocks, preserve_rng_state=o.preserve_rng_state,
                                 determinism_check=o.determinism_check, debug=o.debug)
        for feature in self.features:
            feature.plan_applied(trainer)
        self.capacity = self.settings.capacity_bytes or device_capacity(trainer.strategy.root_device)
        made = self._make("plan", trainer)
        self._check_replay_safety()
        conflicts.refuse_regions_across_shards(trainer.strategy, self.plan, self._reachable_policies())
        self.saved.plan_applied(made)  # a checkpoint restored before the plan was applied goes in now
        self.info(self.plan.summary().splitlines()[0].removeprefix("lightning_ckpt "))
        return self.plan

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start measuring: the step monitor, the replay hooks, the budget calibration, the TensorBoard layout."""
        if self.plan is None:  # the strategy's setup was bypassed: apply now
            self.apply(trainer)
        self._read_capacity_again(trainer.strategy.root_device)
        self.measurement.start(trainer, pl_module, self.capacity)
        for feature in self._make("fit", trainer, pl_module):  # each fit's own, or going on from a checkpoint's state
            self.saved.made(feature)
        for feature in self.features:
            feature.fit_start(trainer, pl_module)

    def _read_capacity_again(self, device: torch.device) -> None:
        """The capacity once the strategy is set up: DDP's first broadcast made NCCL's communicator buffers, which
        lie outside the allocator and were still free when the plan was applied. What depends on it (a fractional
        ``auto_threshold``, a fractional budget, the ledger's headroom) is sized from this reading. (FSDP2 makes its
        communicators at the first forward: its figure is still read before them.)"""
        if self.settings.capacity_bytes is not None:
            return
        capacity = device_capacity(device)
        if capacity is not None:
            self.capacity = capacity

    def _reachable_policies(self) -> list:
        """The policies this run may apply: the starting one, and the ladder when the plan can change."""
        s = self.settings
        ladder = s.ladder if s.acts("ladder") else ()
        return [self.policy, *(parse_policy(rung) for rung in ladder)]

    # ------------------------------------------------------------------------------------------ plan changes
    def change_plan(self, policy: Union[str, Policy]) -> None:
        """Switch the plan between optimizer steps; the one way a running plan changes (see the module doc).

        A plan that would offload more than the node's host memory can hold (measured in an earlier offloaded step)
        is refused with a warning naming both figures, and the plan stays as it is (an escalation then moves on to
        the next rung, or stops with the diagnosis)."""
        refusal = offload_refusal(parse_policy(policy).layout(self.plan.num_blocks), host_room(self.plan))
        if refusal is not None:
            warnings.warn(f"lightning_ckpt: {refusal}", RuntimeWarning, stacklevel=2)
            return
        self.plan.retarget(policy)
        self._check_replay_safety()

    def restore_plan(self, state: Dict[str, Any]) -> None:
        """Put back a checkpoint's plan (:mod:`~lightning_ckpt.lightning.persistence`) through the same checks."""
        self.plan.load_state_dict(state)
        self._check_replay_safety()

    def set_modes(self, modes: Sequence[str]) -> None:
        """Set per-block modes (the budget calibration's plans) through the same checks."""
        self.plan.set_modes(modes)
        self._check_replay_safety()

    def _check_replay_safety(self) -> None:
        skipped = preflight(self.plan, self.settings.stateful, may_change=self.settings.changes_plan)
        if skipped and skipped != self._skipped:
            self.info(f"kept {skipped} un-checkpointed (running statistics, stateful='skip').")
        self._skipped = skipped

    # ------------------------------------------------------------------------------------------ the step
    def batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                    batch_idx: int) -> None:
        for feature in self.features:
            feature.before_batch(pl_module, batch, batch_idx)
        self.measurement.begin(trainer, pl_module, batch, self.features)

    def before_backward(self) -> None:
        self._phase_starts("backward")

    def before_optimizer_step(self) -> None:
        self._phase_starts("optimizer")

    def _phase_starts(self, name: str) -> None:
        for feature in self.features:
            feature.phase_starts(name)
        self.measurement.phase(name)

    def batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """After each micro-batch; after the last of an optimizer step: measure, reduce, log and decide."""
        for feature in self.features:
            feature.after_micro_batch(trainer, pl_module)
        if trainer.fit_loop._should_accumulate() or not self.measurement.in_step:
            return
        self.measurement.end(trainer, pl_module, self.features)

    def pause(self) -> None:
        """Validation starts: its time is no step's."""
        self.measurement.pause()

    def resume(self) -> None:
        self.measurement.resume()

    # ------------------------------------------------------------------------------------------ the end
    def fit_end(self, trainer: "pl.Trainer") -> None:
        for feature in self.features:
            feature.fit_end(trainer)

    def report(self, trainer: Optional["pl.Trainer"] = None) -> str:
        """The ledger report of the last measured step; with ``trainer`` rank zero also writes it as JSON."""
        return self.run_report.text(trainer)

    def release(self, trainer: "pl.Trainer") -> None:
        """Remove every hook and shim this engine installed (teardown, or a run that raised)."""
        shims.remove_before_strategy_setup(trainer.strategy)
        if self.plan is not None:  # pinned host memory of offloaded blocks goes back when the run ends
            release_host_memory(self.plan)
        for feature in self.features:  # a run that ends while calibrating leaves no hook behind
            feature.close()
        self.ranks.close()
        self.measurement.close()

    def annotate(self, exception: BaseException) -> None:
        """The run raised ``exception`` (released already): each feature adds what it knows (the out-of-memory
        diagnosis)."""
        for feature in self.features:
            feature.annotate(exception)

    # ------------------------------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the run (:mod:`~lightning_ckpt.lightning.persistence`)."""
        return self.saved.state_dict(self.features)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a checkpoint's plan and features' state (now, or when this run applies its plan)."""
        self.saved.load_state_dict(state)
