"""The engine behind both doors: one object owns the whole lifecycle of activation checkpointing in a Trainer.

configure (:class:`~lightning_ckpt.lightning.settings.Settings`) → find and apply the blocks' plan right before
the strategy wraps the model → check replay safety on every plan change → measure each optimizer step → decide
(auto-toggle, budget) → recover from out-of-memory → report at the end of ``fit`` → save and restore its state.

:class:`~lightning_ckpt.ActivationCheckpointing` (the callback) translates Lightning's hooks into calls of this
class and nothing else; the ``*_ac`` strategies put that same callback into ``trainer.callbacks``. So both doors
are one code path: the same metrics, the same checks, the same report.

Every change of plan (auto-toggle, budget, escalation, resume) goes through :meth:`CheckpointingEngine.change_plan`.

What decides on the plan is a list of features (:class:`~lightning_ckpt.lightning.feature.Feature`): a ``budget:``
policy's run (:mod:`~lightning_ckpt.lightning.budgeting`) and the auto-toggle
(:mod:`~lightning_ckpt.lightning.autotoggle`), each called at every hook in one order. The out-of-memory guard
(:mod:`~lightning_ckpt.lightning.recovery`) and the end-of-fit report (:mod:`~lightning_ckpt.lightning.reporting`)
are objects of their own. All of them reach the run through one
:class:`~lightning_ckpt.lightning.port.PlanPort`, never the engine.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten

from lightning_ckpt.core.offload import release_host_memory
from lightning_ckpt.core.policy import MODES, Policy, compiler_modes, parse_policy
from lightning_ckpt.core.replay import register_replay_hook
from lightning_ckpt.core.wrap import CheckpointPlan, apply_policy, get_plan
from lightning_ckpt.decide.diagnosis import PhaseTracker
from lightning_ckpt.decide.escalation import host_room, offload_refusal
from lightning_ckpt.decide.safety import preflight
from lightning_ckpt.decide.shapes import bucket_of, shape_of
from lightning_ckpt.decide.verify import verify_equivalence
from lightning_ckpt.lightning import conflicts, shims
from lightning_ckpt.lightning.autotoggle import AutoToggle
from lightning_ckpt.lightning.budgeting import WHOLE_MODEL_COMPILE_BUDGET, BudgetFeature
from lightning_ckpt.lightning.compiled import (
    blocks_in_one_compiled_graph,
    compile_blocks_one_by_one,
    compiled_block_caller,
    cuda_graphs_in_use,
    graph_breaks_so_far,
    model_compiles,
    warn_checkpoint_graph_breaks,
    warn_cuda_graphs_once,
)
from lightning_ckpt.lightning.feature import Feature, StepEnd
from lightning_ckpt.lightning.metrics import log_metrics, log_step, reduce_across_ranks, tensorboard_layout
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.lightning.ranks import HostGroup
from lightning_ckpt.lightning.recovery import StepGuard
from lightning_ckpt.lightning.reporting import REPORT_FILE, TIMELINE_FILE, RunReport
from lightning_ckpt.lightning.settings import Settings
from lightning_ckpt.measure.ledger import state_tensors
from lightning_ckpt.measure.meter import device_capacity
from lightning_ckpt.measure.monitor import StepMonitor, StepResult
from lightning_ckpt.measure.tokens import count_samples, sequence_length

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["REPORT_FILE", "STATE_VERSION", "TIMELINE_FILE", "WHOLE_MODEL_COMPILE_BUDGET", "CheckpointingEngine"]

STATE_VERSION = 1
_STATE_KEYS = frozenset({"version", "policy", "plan_policy", "names", "modes", "controller", "budget"})
_INSTRUMENTED = "_instrumented"  # reduced with the figures: whether some rank's step ran the per-op instrumentation


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
        self.toggle: Optional[AutoToggle] = None  # auto_threshold: the controller and its gate per batch shape
        self.monitor: Optional[StepMonitor] = None
        self.budget: Optional[BudgetFeature] = None  # budget: its calibration and plans per batch shape, this fit
        self.ranks = HostGroup()  # runs that agree between steps: a gloo group, so agreeing never waits for the device
        self._step_shape: Any = None
        self.phase = PhaseTracker()
        self.port = PlanPort(self)  # what the features (per-shape plans and gate, the guard) reach of the run
        self.guard = StepGuard(self.port, self.phase)  # out-of-memory errors, with snapshot_on_oom's record
        self.record = RunReport(self.port, owner)  # what the end-of-fit report reads of the measured steps
        self.capacity: Optional[int] = settings.capacity_bytes
        self.last_metrics: Dict[str, float] = {}
        self._settling = False  # the step in flight settles what logged reference steps are owed (_settle_owed)
        self._owed: list = []  # logged reference steps whose time and throughput wait for an ordinary step's
        self._pending: Optional[Dict[str, Any]] = None  # restored state waiting for the plan to exist
        self._budget_state: Optional[Dict[str, Any]] = None  # a budget's saved calibration, for fit start
        self._applied_in_run = False
        self._verified = False
        self._warned_no_logger = False
        self._handles: list = []  # forward pre-hook, replay hook
        self._logging = self._deciding = False
        self.batch_shape: Optional[tuple] = None

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

    def _key(self, name: str) -> str:
        return f"{self.settings.prefix}/{name}" if self.settings.prefix else name

    @property
    def calibration(self) -> Any:
        """A ``budget:`` policy's calibration (:class:`~lightning_ckpt.decide.calibration.BudgetCalibration`) this
        fit, or ``None``."""
        return self.budget.calibration if self.budget is not None else None

    @property
    def last_result(self) -> Optional[StepResult]:
        """The last measured step's result this fit (the report's), or ``None``."""
        return self.record.last_result

    @property
    def last_attribution(self) -> Optional[Dict[str, Any]]:
        """The last reference step's peaks with their tensors named, or ``None``."""
        return self.record.last_attribution

    @property
    def controller(self) -> Any:
        """The auto-toggle's :class:`~lightning_ckpt.decide.controller.Controller`, or ``None``."""
        return self.toggle.controller if self.toggle is not None else None

    @property
    def gate(self) -> Any:
        """The auto-toggle's gate per batch shape (:class:`~lightning_ckpt.lightning.gate.ShapeGate`), or ``None``."""
        return self.toggle.gate if self.toggle is not None else None

    @property
    def features(self) -> List[Feature]:
        """The capabilities deciding on the plan this fit, in the order they hear each hook."""
        return [feature for feature in (self.budget, self.toggle) if feature is not None]

    @property
    def shapes(self) -> Any:
        """A ``budget:`` policy's plans per batch shape (:class:`~lightning_ckpt.lightning.shaped.ShapeSteps`), or
        ``None``."""
        return self.budget.shapes if self.budget is not None else None

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self, trainer: "pl.Trainer", stage: str) -> None:
        """Every run: refuse conflicts; when fitting, arrange for the plan to be applied before strategy setup."""
        self._applied_in_run = False
        self._pending = None
        self.guard.attach(trainer)  # every stage: an evaluation loop's out-of-memory error is named by its stage
        found = conflicts.owners(trainer)
        if len(found) > 1:
            raise RuntimeError(conflicts.two_owners_message(found))
        conflicts.check_strategy(trainer.strategy)
        if stage == "fit":
            if self.settings.changes_plan:
                conflicts.refuse_static_graph(trainer.strategy, self.settings.changes_plan)
            shims.run_before_strategy_setup(trainer.strategy, self.apply)
            shims.install_optimizer_step_guard(trainer.strategy, self.guard.guarded_step)

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
        self._applied_in_run = True
        if self.settings.compile_blocks:
            for change in compile_blocks_one_by_one(model, self.plan.blocks):
                self.info(f"compile_blocks: {change}")
        self.capacity = self.settings.capacity_bytes or device_capacity(trainer.strategy.root_device)
        if self.settings.auto_threshold is not None:
            self.toggle = AutoToggle(self.port, self.capacity)
        self._check_replay_safety()
        conflicts.refuse_regions_across_shards(trainer.strategy, self.plan, self._reachable_policies())
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)
        self.info(self.plan.summary().splitlines()[0].removeprefix("lightning_ckpt "))
        return self.plan

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start measuring: the step monitor, the replay hooks, the budget calibration, the TensorBoard layout."""
        if self.plan is None:  # the strategy's setup was bypassed: apply now
            self.apply(trainer)
        s = self.settings
        self.record.start_fit()  # each fit reports its own steps
        self._owed = []
        device = trainer.strategy.root_device
        self._read_capacity_again(device)
        graphs = cuda_graphs_in_use(pl_module) if device.type == "cuda" else None  # the allocator's lines: see there
        if graphs is not None:
            warn_cuda_graphs_once(graphs)
        # compared after each step (see batch_end), only where something is compiled: no work on eager steps
        self._breaks_before = graph_breaks_so_far() if model_compiles(pl_module) else None
        self.monitor = StepMonitor(device, tokens_fn=s.tokens_fn, capacity=self.capacity,
                                   exact_every_n_steps=s.exact_every_n_steps, allocator_note=graphs)
        self.monitor.watch(pl_module)
        self._release_handles()
        self._handles.append(register_replay_hook(self.guard.note_replay))
        if self.plan.blocks:
            self._handles.append(self.plan.blocks[0].register_forward_pre_hook(lambda *_: self.phase.forward_start()))
        if s.budget is not None:  # each fit calibrates, or goes on from what a checkpoint saved of it
            saved, self._budget_state = self._budget_state, None
            self.budget = BudgetFeature(self.port, self.monitor.meter, trainer, pl_module, saved)
        if s.snapshot_on_oom:
            self.guard.record(trainer)
        if self.toggle is not None:
            self.toggle.setup(trainer)
        self.guard.configure(trainer, self.calibration, self.controller, self.gate)
        self._check_compiler_modes(pl_module)
        if s.measure:
            self._prepare_loggers(trainer)

    def _prepare_loggers(self, trainer: "pl.Trainer") -> None:
        """Warn once when nothing will keep the curves; give TensorBoard its layout (rank zero)."""
        if not trainer.loggers and not self._warned_no_logger:
            self._warned_no_logger = True
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn("lightning_ckpt: measure=True but the Trainer has no logger, so the memory curves are not "
                           "saved; pass a logger (e.g. TensorBoardLogger) or measure=False.")
        if trainer.is_global_zero:
            from lightning.pytorch.loggers import TensorBoardLogger

            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(tensorboard_layout(self.settings.prefix))

    def _read_capacity_again(self, device: torch.device) -> None:
        """The capacity once the strategy is set up: DDP's first broadcast made NCCL's communicator buffers, which
        lie outside the allocator and were still free when the plan was applied. What depends on it (a fractional
        ``auto_threshold``, a fractional budget, the ledger's headroom) is sized from this reading. (FSDP2 makes its
        communicators at the first forward: its figure is still read before them.)"""
        if self.settings.capacity_bytes is not None:
            return
        capacity = device_capacity(device)
        if capacity is None or capacity == self.capacity:
            return
        self.capacity = capacity
        if self.toggle is not None:
            self.toggle.resize(capacity)

    def _check_compiler_modes(self, pl_module: "pl.LightningModule") -> None:
        """``compiler:<f>`` blocks in a fixed plan: refused inside one whole-model graph (PyTorch takes one budget
        per graph, covering all of it, and fails at the first compile); a warning when the blocks run eagerly."""
        modes = compiler_modes(self.plan.modes)
        if not modes:
            return
        if blocks_in_one_compiled_graph(pl_module, self.plan.blocks):
            raise ValueError(
                f"policy {self.policy.spec!r} puts blocks in modes {modes}, but the whole model is one compiled graph, "
                "where PyTorch applies one activation memory budget covering the whole graph. Pass compile_blocks=True "
                "(each block its own graph, with your backend and options), compile block by block yourself (for "
                "block in blocks: block.compile()) instead of torch.compile(model), or use the modes "
                f"{[m for m in MODES if m != 'offload']} with a whole-model compile.")
        sharded = any(conflicts.is_fsdp_module(m) for m in pl_module.modules())  # no block caller: not "eager"
        if compiled_block_caller(pl_module, self.plan.blocks) is None and not sharded:
            warnings.warn(f"lightning_ckpt: policy {self.policy.spec!r} uses {modes}, which act only on blocks "
                          "compiled one by one (block.compile()); these blocks run eagerly, so they run as 'off'.",
                          RuntimeWarning, stacklevel=2)

    def _reachable_policies(self) -> list:
        """The policies this run may apply: the starting one, and the ladder when the plan can change."""
        s = self.settings
        ladder = s.ladder if s.auto_threshold is not None or s.on_oom == "escalate" else ()
        return [self.policy, *(parse_policy(rung) for rung in ladder)]

    # ------------------------------------------------------------------------------------------ plan changes
    def change_plan(self, policy: Union[str, Policy], level: Optional[int] = None) -> None:
        """Switch the plan between optimizer steps; the one way a running plan changes (see the module doc).

        A plan that would offload more than the node's host memory can hold (measured in an earlier offloaded step)
        is refused with a warning naming both figures, and the plan stays as it is (an escalation then moves on to
        the next rung, or stops with the diagnosis)."""
        refusal = offload_refusal(parse_policy(policy).layout(self.plan.num_blocks), host_room(self.plan))
        if refusal is not None:
            warnings.warn(f"lightning_ckpt: {refusal}", RuntimeWarning, stacklevel=2)
            return
        self.plan.retarget(policy)
        if level is not None and self.toggle is not None:
            self.toggle.moved_to(level)
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
        if self.settings.verify and not self._verified:
            self._verify(pl_module, batch, batch_idx)
        self.phase.batch_start()
        if self.monitor is None:
            return
        size = None  # a later micro-batch's size, for a measured step
        if not self.monitor.in_step:
            self.batch_shape = (sequence_length(batch), count_samples(batch))
            calibrating = self.budget is not None and self.budget.calibrating
            for feature in self.features:  # the plan for this batch, before its forward
                feature.before_micro_batch(trainer, batch, first=True)
            self._logging, self._deciding = self._step_kind(trainer)
            # owed the time of a logged reference step: timed, and its figures reduced (not logged) at its end
            self._settling = bool(self._owed)
            # block hooks measure the calibration steps: compiled code runs eagerly for them; the fit's first step is
            # measured for the report (a fit shorter than log_every_n_steps logs none)
            first = self.settings.measure and self.settings.report and self.last_result is None
            measured = self._logging or self._deciding or calibrating or first
            self._step_shape = shape_of(batch, self.settings.shape_fn) if measured else None
            self.monitor.begin_step(measure=measured, key=self._step_key(trainer, batch) if measured else None,
                                    size=self._step_shape.tokens if measured else None,
                                    attribute=self.plan.names if self.plan is not None else (),
                                    eager=calibrating, tokens=self._logging,
                                    state=state_tensors(pl_module, trainer.optimizers), batch=_tensors_in(batch),
                                    exact=self.budget.exact_step if calibrating else None,
                                    hidden_recompute=bool(compiler_modes(self.plan.modes)))
        else:  # the next micro-batch of an accumulation window
            for feature in self.features:
                feature.before_micro_batch(trainer, batch, first=False)
            self.monitor.phase("forward")
            if self._step_shape is not None:  # measured: the step's size is its largest micro-batch's (meter.grow)
                size = self._grow_step(batch)
        self.monitor.add_batch(batch, size)

    def _grow_step(self, batch: Any) -> float:
        """A later micro-batch of a measured step: its tokens, and its (length, samples) for the report's reading
        of lengths when it is the step's largest yet (the step's activation peak is that micro-batch's)."""
        size = shape_of(batch, self.settings.shape_fn).tokens
        length, samples = sequence_length(batch), count_samples(batch)
        if length and samples and length * samples > math.prod(v or 0 for v in self.batch_shape or (0,)):
            self.batch_shape = (length, samples)
        return size

    def _step_key(self, trainer: "pl.Trainer", batch: Any) -> tuple:
        """What determines a step's memory: the plan, the batch's shape bucket (of ``_step_shape``, read once) and
        dtypes (not its exact shape: with dynamic padding every length would be a new key, each first step of a key
        an exact, slow one), the precision, the accumulation, and whether the optimizer state exists yet (the first
        step creates it: its phase peaks are not the steady state's, so the second step is the steady state's
        reference)."""
        plan = self.plan
        layout = (plan.modes, plan.layout.groups, plan.layout.save_ops) if plan is not None else None
        dtypes = tuple(t.dtype for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
        bucket = bucket_of(self._step_shape)
        steady = all(bool(getattr(opt, "state", None)) for opt in trainer.optimizers)
        return layout, bucket, dtypes, str(trainer.precision), trainer.accumulate_grad_batches, steady

    def _step_kind(self, trainer: "pl.Trainer") -> tuple:
        """(logging step, decision step) for the optimizer step that starts now."""
        logging = bool(self.settings.measure and trainer._logger_connector.should_update_logs)
        deciding = self.toggle is not None and self.toggle.deciding(trainer.global_step)
        return logging, deciding

    def before_backward(self) -> None:
        self.phase.backward_start()
        if self.monitor is not None:
            self.monitor.phase("backward")

    def before_optimizer_step(self) -> None:
        self.phase.optimizer_step_start()
        if self.monitor is not None:
            self.monitor.phase("optimizer")

    def restart_step(self) -> None:
        """The guard retries the open step under a new plan (:mod:`lightning_ckpt.lightning.recovery`): its
        measurement starts over, keyed by the plan it now runs (the layout part of :meth:`_step_key`; the batch, the
        precision, the accumulation and the optimizer state are the step's own still)."""
        if self.monitor is None or not self.monitor.in_step or self.plan is None:
            return
        plan, key = self.plan, self.monitor.meter.key
        if key is not None:
            key = ((plan.modes, plan.layout.groups, plan.layout.save_ops), *key[1:])
        module = self.module
        state = state_tensors(module, module.trainer.optimizers) if module is not None else ()
        self.monitor.restart_step(key=key, state=state, hidden_recompute=bool(compiler_modes(plan.modes)))

    def batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """After the last micro-batch of an optimizer step: read, reduce, log and decide."""
        if getattr(self, "_breaks_before", None) is not None:  # a step compiled (not always the first): name breaks
            self._breaks_before = warn_checkpoint_graph_breaks(
                pl_module, self.plan.num_checkpointed if self.plan else 0, self._breaks_before)
        if trainer.fit_loop._should_accumulate() or self.monitor is None or not self.monitor.in_step:
            return
        self.phase.optimizer_step_end()
        plan = self.plan
        result = self.monitor.end_step(pl_module, trainer.optimizers, plan.num_checkpointed if plan else 0)
        self._settle_owed(trainer, result)
        if result.ledger is None:  # not measured: the report keeps the last measured step
            for feature in self.features:
                feature.after_unmeasured_step(self._key)
            return
        result = self._as_compiled(result)
        self.record.note(trainer, result, self._step_shape, self._logging)
        metrics = result.metrics(self.settings.prefix)
        group = self.ranks.group  # on the host where the run decides: see lightning/ranks.py
        if self._logging:  # every figure reduced across ranks: one collective
            metrics = reduce_across_ranks(trainer.strategy, {**metrics, _INSTRUMENTED: float(result.instrumented)},
                                          group=group)
            if metrics.pop(_INSTRUMENTED):  # a rank ran the per-op instrumentation: an ordinary step times this one
                metrics = {k: v for k, v in metrics.items() if k not in result.throughput(self.settings.prefix)}
                self._owed.append(log_step(trainer))
                self.monitor.owed = True
        elif self._deciding:  # only the activation line: one collective of one float
            key = self._key("memory/activations_gib")
            metrics = dict(metrics, **reduce_across_ranks(trainer.strategy, {key: metrics[key]}, group=group))
        step = StepEnd(trainer, result, metrics, self._key, self._deciding)
        for feature in self.features:  # their figures join the step's; they decide for the next step
            feature.after_step(step)
        self.last_metrics = metrics
        if self._logging:
            log_metrics(trainer, metrics, self.settings.prefix)

    def _settle_owed(self, trainer: "pl.Trainer", result: StepResult) -> None:
        """The time and throughput of the logged reference steps waiting for them, from this step when it is an
        ordinary one on every rank: logged at each of those steps (their own figures held the per-op instrumentation,
        3-4x slow). Every rank gets here at the same steps (the owed steps were agreed by the reduction)."""
        if not self._owed:
            return
        figures = {self._key("throughput/samples_per_sec"): 0.0, self._key("time/step_s"): 0.0}
        figures.update(result.throughput(self.settings.prefix))
        figures[_INSTRUMENTED] = float(result.instrumented or result.step_s is None)
        figures = reduce_across_ranks(trainer.strategy, figures, group=self.ranks.group)
        if figures.pop(_INSTRUMENTED):  # this step ran it too: the next ordinary one times them all
            return
        for step in self._owed:
            log_metrics(trainer, figures, self.settings.prefix, step=step)
        self.last_metrics.update(figures)
        self._owed, self.monitor.owed = [], False

    def _as_compiled(self, result: StepResult) -> StepResult:
        """The step's figures with the ``compiler:<f>`` blocks' measured savings (at the step's shape, under per-shape
        plans) taken off the activation line. Its figure is counted eagerly (the plan's reference step, or that figure
        reused: the compiled step's saved tensors would miss the recompute inside those blocks' backward), where those
        blocks run ``off``."""
        savings = self.budget.compiled_savings(self.plan.modes) if self.budget is not None else 0
        if not savings or result.ledger.activations is None or not getattr(result.reading, "eager_figure", False):
            return result
        return dataclasses.replace(result, ledger=result.ledger.with_activations(result.ledger.activations - savings))

    def pause(self) -> None:
        """Validation starts: its time is no step's."""
        if self.monitor is not None:
            self.monitor.pause()

    def resume(self) -> None:
        if self.monitor is not None:  # only the validation run is cut out; the next batch's loading still counts
            self.monitor.resume()

    def _verify(self, pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        """``verify=True``: every checkpointed block of the plan against itself plain, on the first batch, inside the
        precision plugin's training-step context (its autocast), block by block within the checkpointed step's
        memory (:mod:`lightning_ckpt.decide.verify`)."""
        self._verified = True
        if self.plan is None or not self.plan.num_checkpointed:
            return
        sharded = next((name for name, m in pl_module.named_modules() if conflicts.is_fsdp_module(m)), None)
        if sharded is not None:
            raise ValueError(
                f"{self.owner}(verify=True): verify the plan without FSDP (the same policy on one device), then drop "
                f"verify=True here; {sharded or type(pl_module).__name__!r} is sharded by FSDP, and verify runs each "
                "checkpointed block alone, outside the root's forward, where FSDP cannot gather its parameters.")
        trainer = pl_module.trainer
        report = verify_equivalence(
            pl_module, self.plan, lambda: pl_module.training_step(batch, batch_idx),
            context=trainer.strategy.precision_plugin.train_step_context, precision=str(trainer.precision))
        self.info("verify: every checkpointed block agrees with its plain run\n" + report.table())

    # ------------------------------------------------------------------------------------------ the end
    def fit_end(self, trainer: "pl.Trainer") -> None:
        for feature in self.features:
            feature.fit_end(trainer)
        if self.settings.report and self.record.measured:
            text = self.report(trainer)  # every rank: trainer.log_dir is a collective under DDP
            if trainer.is_global_zero:
                print(text)

    def report(self, trainer: Optional["pl.Trainer"] = None) -> str:
        """The ledger report of the last measured step; with ``trainer`` rank zero also writes it as JSON."""
        return self.record.text(trainer, self.features)

    def release(self, trainer: "pl.Trainer") -> None:
        """Remove every hook and shim this engine installed (teardown, or a run that raised)."""
        shims.remove_before_strategy_setup(trainer.strategy)
        shims.remove_optimizer_step_guard(trainer.strategy)
        self._release_handles()
        if self.plan is not None:  # pinned host memory of offloaded blocks goes back when the run ends
            release_host_memory(self.plan)
        for feature in self.features:  # a run that ends while calibrating leaves no hook behind
            feature.close()
        self.ranks.close()
        self.guard.close()
        if self.monitor is not None:
            self.monitor.close()

    def _release_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        """Primitives only: ``version``, configured ``policy``, plan ``plan_policy``/``names``/``modes``, and the
        auto-toggle's ``controller`` state."""
        if self.plan is None:
            if self._pending is not None:  # restored but not applied yet: keep what the user had
                return dict(self._pending)
            return {"version": STATE_VERSION, "policy": self._configured_spec()}
        plan = self.plan.state_dict()
        state = {"version": STATE_VERSION, "policy": self._configured_spec(), "plan_policy": plan["policy"],
                 "names": list(plan["names"]), "modes": list(plan["modes"])}
        if self.toggle is not None:
            state["controller"] = self.toggle.state_dict()
        if self.budget is not None:  # a resumed run goes on without calibrating again
            state["budget"] = self.budget.state_dict()
        elif self._budget_state is not None:
            state["budget"] = self._budget_state
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a saved plan: at once if this run already applied it (the strategy restores after setup),
        else when this run applies the plan (a plan left by an earlier run would be re-targeted there)."""
        state = _check_state(state)
        if state is None:
            return
        if self._applied_in_run:
            self._restore(state)
        else:
            self._pending = state

    def _configured_spec(self) -> str:
        """The policy as the user configured it: a budget's own string, not the plan it starts from."""
        return self.settings.budget.spec if self.settings.budget is not None else self.policy.spec

    def _restore(self, state: Dict[str, Any]) -> None:
        saved = state.get("policy")
        if saved not in (self._configured_spec(), self.policy.spec):  # older checkpoints of a budget: its start
            warnings.warn(
                f"lightning_ckpt: the checkpoint was trained with policy {saved!r} but {self.describe()} is "
                f"configured with {self._configured_spec()!r}; the configured policy wins. To resume with the saved "
                f"plan, pass policy={saved!r}.", UserWarning, stacklevel=3)
            self.change_plan(self.policy)
            return
        if state.get("controller") is not None and self.toggle is not None:
            self.toggle.load_state_dict(state["controller"])
        if "plan_policy" not in state:
            return
        if list(state.get("names", [])) != list(self.plan.names):
            warnings.warn(
                f"lightning_ckpt: the checkpoint's plan covers blocks {state.get('names')}, this model has "
                f"{list(self.plan.names)}; keeping the configured policy {self.policy.spec!r}.", UserWarning,
                stacklevel=3)
            return
        self.plan.load_state_dict({"version": 1, "policy": state["plan_policy"], "names": state.get("names", []),
                                   "modes": state.get("modes", [])})
        self._check_replay_safety()
        self._budget_state = state.get("budget")  # restored at fit start, once the calibration exists


def _check_state(state: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(state, dict) or not isinstance(state.get("policy"), str):
        warnings.warn(f"lightning_ckpt: ignoring unreadable saved state {state!r}; using the configured policy.",
                      UserWarning, stacklevel=3)
        return None
    if state.get("version") != STATE_VERSION:
        warnings.warn(f"lightning_ckpt: saved state version {state.get('version')!r} is not {STATE_VERSION}; "
                      "loading what is compatible.", UserWarning, stacklevel=3)
    unknown = sorted(set(state) - _STATE_KEYS)
    if unknown:
        warnings.warn(f"lightning_ckpt: ignoring unknown keys {unknown} in saved state.", UserWarning, stacklevel=3)
    return state


def _tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors (read lazily, on exact steps only)."""
    yield from (t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
