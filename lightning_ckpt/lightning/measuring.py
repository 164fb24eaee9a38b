"""The reading of each optimizer step in a Trainer: :class:`StepMeasurement`, the engine's step.

It asks the features what they need of each optimizer step (:class:`~lightning_ckpt.lightning.feature.StepNeeds`:
the logged curves a logging step, the auto-toggle its decision steps, a budget its calibration steps, the report the
fit's first), keys each measured step by what determines its memory, drives the step monitor
(:mod:`lightning_ckpt.measure.monitor`) through the step's micro-batches and phases, agrees the step's figures across
ranks (all of them on a logged step, the activation line alone on a decision step) and hands the measured step to the
features (:class:`~lightning_ckpt.lightning.feature.StepEnd`). It is the engine's part of the lifecycle, not a
capability: what becomes of the figures is the features' (the logged curves, :mod:`~lightning_ckpt.lightning.curves`;
the end-of-fit report, :mod:`~lightning_ckpt.lightning.reporting`; the decisions). It reaches the run through its
:class:`~lightning_ckpt.lightning.port.PlanPort`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

from lightning_ckpt.core.policy import compiler_modes
from lightning_ckpt.decide.shapes import bucket_of, shape_of
from lightning_ckpt.lightning.compiled import cuda_graphs_in_use, warn_cuda_graphs_once
from lightning_ckpt.lightning.feature import Feature, StepEnd, StepNeeds
from lightning_ckpt.lightning.metrics import INSTRUMENTED, prefixed, reduce_across_ranks
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.measure.ledger import state_tensors
from lightning_ckpt.measure.monitor import StepMonitor, StepResult
from lightning_ckpt.measure.tokens import count_samples, sequence_length

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["StepMeasurement"]


class StepMeasurement:
    """Which steps are measured, their reading and its hand-over to the features (see the module docstring).

    Args:
        port: what it reaches of the run.
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self.monitor: Optional[StepMonitor] = None
        self.last_metrics: Dict[str, float] = {}
        self.batch_shape: Optional[tuple] = None  # (length, samples) of the open step's largest micro-batch
        self.logging = self.deciding = False  # the open step's kind (step_kind)
        self.settling = False  # the open step is timed for a logged step's owed time (see lightning/curves.py)
        self._step_shape: Any = None  # the open step's batch shape, where it is measured

    def key(self, name: str) -> str:
        """A metric's full key: the callback's ``prefix`` in front of ``name``."""
        return prefixed(self.port.settings.prefix, name)

    @property
    def in_step(self) -> bool:
        """Whether an optimizer step is open (its first micro-batch began, its end has not come)."""
        return self.monitor is not None and self.monitor.in_step

    # ------------------------------------------------------------------------------------------ the fit
    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", capacity: Optional[int]) -> None:
        """A fit starts: a new step monitor on the module (``capacity``: the device's, for the ledger's headroom)."""
        s = self.port.settings
        device = trainer.strategy.root_device
        graphs = cuda_graphs_in_use(pl_module) if device.type == "cuda" else None  # the allocator's lines: see there
        if graphs is not None:
            warn_cuda_graphs_once(graphs)
        self.monitor = StepMonitor(device, tokens_fn=s.tokens_fn, capacity=capacity,
                                   exact_every_n_steps=s.exact_every_n_steps, allocator_note=graphs)
        self.monitor.watch(pl_module)

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
        needs = StepNeeds.of(feature.step_needs(trainer) for feature in features)  # before the batch's plan is set
        self.logging, self.deciding, self.settling = needs.log, needs.decide, needs.timed
        for feature in features:  # the plan for this batch, before its forward
            feature.before_micro_batch(trainer, batch, first=True)
        # block hooks measure the steps a feature needs eagerly (the calibration's): compiled code runs eagerly for them
        measured = needs.measure or needs.log or needs.decide
        self._step_shape = shape_of(batch, s.shape_fn) if measured else None
        exact = next((e for e in (feature.exact_reading() for feature in features) if e is not None), None)
        self.monitor.begin_step(measure=measured, key=self._step_key(trainer, batch) if measured else None,
                                size=self._step_shape.tokens if measured else None,
                                attribute=plan.names if plan is not None else (), eager=needs.eager,
                                tokens=needs.log or needs.timed, state=state_tensors(pl_module, trainer.optimizers),
                                batch=_tensors_in(batch), exact=exact,
                                hidden_recompute=bool(compiler_modes(plan.modes)))

    def step_kind(self, trainer: "pl.Trainer", features: Sequence[Feature]) -> tuple:
        """(logging step, decision step) for the optimizer step that starts now (a pure read)."""
        needs = StepNeeds.of(feature.step_needs(trainer) for feature in features)
        return needs.log, needs.decide

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
        """After the last micro-batch of an optimizer step: read, agree across ranks, hand to the features."""
        plan = self.port.plan
        result = self.monitor.end_step(pl_module, trainer.optimizers, plan.num_checkpointed if plan else 0)
        for feature in features:
            feature.step_ended(trainer, result)
        if result.ledger is None:  # not measured: the report keeps the last measured step
            for feature in features:
                feature.after_unmeasured_step(self.key)
            return
        for feature in features:  # its own correction of the figures (a budget's compiled blocks)
            result = feature.read_step(result)
        metrics, owed = self._reduced(trainer, result)
        step = StepEnd(trainer, result, metrics, self.key, self.deciding, self._step_shape, self.logging, owed)
        for feature in features:  # their figures join the step's; they decide for the next step
            feature.after_step(step)
        self.last_metrics = metrics
        for feature in features:  # the step's figures are final: the logged curves write them
            feature.figures_ready(step)

    def _reduced(self, trainer: "pl.Trainer", result: StepResult) -> Tuple[Dict[str, float], bool]:
        """The step's figures, agreed across ranks: every one on a logged step (one collective), the activation line
        alone on a decision step (one collective of one float); and whether a logged step's time is owed (some rank
        ran the per-op instrumentation: its time and throughput are left out)."""
        prefix, group = self.port.settings.prefix, self.port.ranks.group  # the host's group: see lightning/ranks.py
        metrics = result.metrics(prefix)
        if self.logging:
            metrics = reduce_across_ranks(trainer.strategy, {**metrics, INSTRUMENTED: float(result.instrumented)},
                                          group=group)
            if metrics.pop(INSTRUMENTED):
                return {k: v for k, v in metrics.items() if k not in result.throughput(prefix)}, True
        elif self.deciding:
            key = self.key("memory/activations_gib")
            metrics = dict(metrics, **reduce_across_ranks(trainer.strategy, {key: metrics[key]}, group=group))
        return metrics, False

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

