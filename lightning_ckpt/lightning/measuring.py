"""The measurement of each optimizer step in a Trainer: :class:`StepMeasurement`.

It decides which steps are measured (a logging step, a step a feature needs: the auto-toggle's decision steps, a
budget's calibration steps, and the fit's first for the report), keys each by what determines its memory, drives the
step monitor (:mod:`lightning_ckpt.measure.monitor`) through the step's micro-batches and phases, reduces the step's
figures across ranks (all of them on a logging step, the activation line alone on a decision step), hands the
measured step to the features (:class:`~lightning_ckpt.lightning.feature.StepEnd`) and logs what they return. A
logged step that ran the per-op instrumentation (3-4x slow) owes its time and throughput: the next ordinary step
settles them. It reaches the run through its :class:`~lightning_ckpt.lightning.port.PlanPort`; the end-of-fit report
(:class:`~lightning_ckpt.lightning.reporting.RunReport`) is a feature, told of each measured step like the others.

Logged keys (each under the callback's ``prefix``): the step's ledger and time (see
:meth:`~lightning_ckpt.measure.monitor.StepResult.metrics`) and what the features add (see
:mod:`lightning_ckpt.lightning.metrics` for the whole list).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten

from lightning_ckpt.core.policy import compiler_modes
from lightning_ckpt.decide.shapes import bucket_of, shape_of
from lightning_ckpt.lightning.compiled import cuda_graphs_in_use, warn_cuda_graphs_once
from lightning_ckpt.lightning.feature import Feature, StepEnd
from lightning_ckpt.lightning.metrics import log_metrics, log_step, reduce_across_ranks, tensorboard_layout
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.measure.ledger import state_tensors
from lightning_ckpt.measure.monitor import StepMonitor, StepResult
from lightning_ckpt.measure.tokens import count_samples, sequence_length

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["StepMeasurement"]

_INSTRUMENTED = "_instrumented"  # reduced with the figures: whether some rank's step ran the per-op instrumentation


class StepMeasurement:
    """Which steps are measured, and what becomes of their figures (see the module docstring).

    Args:
        port: what it reaches of the run.
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self.monitor: Optional[StepMonitor] = None
        self.last_metrics: Dict[str, float] = {}
        self.batch_shape: Optional[tuple] = None  # (length, samples) of the open step's largest micro-batch
        self.logging = self.deciding = False  # the open step's kind (step_kind)
        self.settling = False  # the open step settles what logged reference steps are owed (_settle_owed)
        self._owed: list = []  # logged reference steps whose time and throughput wait for an ordinary step's
        self._step_shape: Any = None  # the open step's batch shape, where it is measured
        self._warned_no_logger = False

    def key(self, name: str) -> str:
        """A metric's full key: the callback's ``prefix`` in front of ``name``."""
        prefix = self.port.settings.prefix
        return f"{prefix}/{name}" if prefix else name

    @property
    def in_step(self) -> bool:
        """Whether an optimizer step is open (its first micro-batch began, its end has not come)."""
        return self.monitor is not None and self.monitor.in_step

    # ------------------------------------------------------------------------------------------ the fit
    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", capacity: Optional[int]) -> None:
        """A fit starts: a new step monitor on the module (``capacity``: the device's, for the ledger's headroom)."""
        s = self.port.settings
        self._owed = []
        device = trainer.strategy.root_device
        graphs = cuda_graphs_in_use(pl_module) if device.type == "cuda" else None  # the allocator's lines: see there
        if graphs is not None:
            warn_cuda_graphs_once(graphs)
        self.monitor = StepMonitor(device, tokens_fn=s.tokens_fn, capacity=capacity,
                                   exact_every_n_steps=s.exact_every_n_steps, allocator_note=graphs)
        self.monitor.watch(pl_module)

    def prepare_loggers(self, trainer: "pl.Trainer") -> None:
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
                    logger.experiment.add_custom_scalars(tensorboard_layout(self.port.settings.prefix))

    # ------------------------------------------------------------------------------------------ the step
    def begin(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
              features: Sequence[Feature]) -> None:
        """Before a micro-batch's forward: the features set its plan; the first of a step opens the step."""
        if self.monitor is None:
            return
        size = None  # a later micro-batch's size, for a measured step
        if not self.monitor.in_step:
            self._open_step(trainer, pl_module, batch, features)
        else:  # the next micro-batch of an accumulation window
            for feature in features:
                feature.before_micro_batch(trainer, batch, first=False)
            self.monitor.phase("forward")
            if self._step_shape is not None:  # measured: the step's size is its largest micro-batch's (meter.grow)
                size = self._grow_step(batch)
        self.monitor.add_batch(batch, size)

    def _open_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                   features: Sequence[Feature]) -> None:
        s, plan = self.port.settings, self.port.plan
        self.batch_shape = (sequence_length(batch), count_samples(batch))
        needs = [feature.step_needs(trainer) for feature in features]  # asked before the plan for the batch is set
        self.logging, self.deciding = self._logging_step(trainer), any(need.decide for need in needs)
        for feature in features:  # the plan for this batch, before its forward
            feature.before_micro_batch(trainer, batch, first=True)
        # owed the time of a logged reference step: timed, and its figures reduced (not logged) at its end
        self.settling = bool(self._owed)
        # block hooks measure the steps a feature needs eagerly (the calibration's): compiled code runs eagerly for
        # them; the fit's first step is measured for the report (a fit shorter than log_every_n_steps logs none)
        first = s.measure and s.report and self.port.last_ledger is None
        eager = any(need.eager for need in needs)
        measured = self.logging or self.deciding or any(need.measure for need in needs) or first
        self._step_shape = shape_of(batch, s.shape_fn) if measured else None
        exact = next((e for e in (feature.exact_reading() for feature in features) if e is not None), None)
        self.monitor.begin_step(measure=measured, key=self._step_key(trainer, batch) if measured else None,
                                size=self._step_shape.tokens if measured else None,
                                attribute=plan.names if plan is not None else (), eager=eager, tokens=self.logging,
                                state=state_tensors(pl_module, trainer.optimizers), batch=_tensors_in(batch),
                                exact=exact, hidden_recompute=bool(compiler_modes(plan.modes)))

    def step_kind(self, trainer: "pl.Trainer", features: Sequence[Feature]) -> tuple:
        """(logging step, decision step) for the optimizer step that starts now (a pure read)."""
        return self._logging_step(trainer), any(feature.step_needs(trainer).decide for feature in features)

    def _logging_step(self, trainer: "pl.Trainer") -> bool:
        return bool(self.port.settings.measure and trainer._logger_connector.should_update_logs)

    def _grow_step(self, batch: Any) -> float:
        """A later micro-batch of a measured step: its tokens, and its (length, samples) for the report's reading
        of lengths when it is the step's largest yet (the step's activation peak is that micro-batch's)."""
        size = shape_of(batch, self.port.settings.shape_fn).tokens
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
        dtypes = tuple(t.dtype for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
        bucket = bucket_of(self._step_shape)
        steady = all(bool(getattr(opt, "state", None)) for opt in trainer.optimizers)
        return _plan_key(self.port.plan), bucket, dtypes, str(trainer.precision), trainer.accumulate_grad_batches, \
            steady

    def phase(self, name: str) -> None:
        """A phase of the open step starts (``"backward"``, ``"optimizer"``)."""
        if self.monitor is not None:
            self.monitor.phase(name)

    def restart(self) -> None:
        """The guard retries the open step under a new plan (:mod:`lightning_ckpt.lightning.recovery`): its
        measurement starts over, keyed by the plan it now runs (the layout part of :meth:`_step_key`; the batch, the
        precision, the accumulation and the optimizer state are the step's own still)."""
        plan = self.port.plan
        if not self.in_step or plan is None:
            return
        key = self.monitor.meter.key
        if key is not None:
            key = (_plan_key(plan), *key[1:])
        module = self.port.module
        state = state_tensors(module, module.trainer.optimizers) if module is not None else ()
        self.monitor.restart_step(key=key, state=state, hidden_recompute=bool(compiler_modes(plan.modes)))

    def end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", features: Sequence[Feature]) -> None:
        """After the last micro-batch of an optimizer step: read, reduce, hand to the features, log."""
        plan = self.port.plan
        result = self.monitor.end_step(pl_module, trainer.optimizers, plan.num_checkpointed if plan else 0)
        self._settle_owed(trainer, result)
        if result.ledger is None:  # not measured: the report keeps the last measured step
            for feature in features:
                feature.after_unmeasured_step(self.key)
            return
        for feature in features:  # its own correction of the figures (a budget's compiled blocks)
            result = feature.read_step(result)
        metrics = self._reduced(trainer, result)
        step = StepEnd(trainer, result, metrics, self.key, self.deciding, self._step_shape, self.logging)
        for feature in features:  # their figures join the step's; they decide for the next step
            feature.after_step(step)
        self.last_metrics = metrics
        if self.logging:
            log_metrics(trainer, metrics, self.port.settings.prefix)

    def _reduced(self, trainer: "pl.Trainer", result: StepResult) -> Dict[str, float]:
        """The step's figures, reduced across ranks: every one on a logging step (one collective), the activation
        line alone on a decision step (one collective of one float)."""
        prefix, group = self.port.settings.prefix, self.port.ranks.group  # the host's group: see lightning/ranks.py
        metrics = result.metrics(prefix)
        if self.logging:
            metrics = reduce_across_ranks(trainer.strategy, {**metrics, _INSTRUMENTED: float(result.instrumented)},
                                          group=group)
            if metrics.pop(_INSTRUMENTED):  # a rank ran the per-op instrumentation: an ordinary step times this one
                metrics = {k: v for k, v in metrics.items() if k not in result.throughput(prefix)}
                self._owed.append(log_step(trainer))
                self.monitor.owed = True
        elif self.deciding:
            key = self.key("memory/activations_gib")
            metrics = dict(metrics, **reduce_across_ranks(trainer.strategy, {key: metrics[key]}, group=group))
        return metrics

    def _settle_owed(self, trainer: "pl.Trainer", result: StepResult) -> None:
        """The time and throughput of the logged reference steps waiting for them, from this step when it is an
        ordinary one on every rank: logged at each of those steps (their own figures held the per-op instrumentation,
        3-4x slow). Every rank gets here at the same steps (the owed steps were agreed by the reduction)."""
        if not self._owed:
            return
        prefix = self.port.settings.prefix
        figures = {self.key("throughput/samples_per_sec"): 0.0, self.key("time/step_s"): 0.0}
        figures.update(result.throughput(prefix))
        figures[_INSTRUMENTED] = float(result.instrumented or result.step_s is None)
        figures = reduce_across_ranks(trainer.strategy, figures, group=self.port.ranks.group)
        if figures.pop(_INSTRUMENTED):  # this step ran it too: the next ordinary one times them all
            return
        for step in self._owed:
            log_metrics(trainer, figures, prefix, step=step)
        self.last_metrics.update(figures)
        self._owed, self.monitor.owed = [], False

    def pause(self) -> None:
        """Validation starts: its time is no step's."""
        if self.monitor is not None:
            self.monitor.pause()

    def resume(self) -> None:
        """Validation ended: only its run is cut out; the next batch's loading still counts."""
        if self.monitor is not None:
            self.monitor.resume()

    def close(self) -> None:
        """The run ends: the monitor's hooks come off."""
        if self.monitor is not None:
            self.monitor.close()


def _plan_key(plan: Any) -> Optional[tuple]:
    """The part of a step's key the plan makes: its modes, groups and saved ops."""
    return (plan.modes, plan.layout.groups, plan.layout.save_ops) if plan is not None else None


def _tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors (read lazily, on exact steps only)."""
    yield from (t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))

