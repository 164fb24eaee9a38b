"""Errors of a training step, caught where they happen: out-of-memory (diagnosed, or retried one rung up) and a
checkpointed block whose replay computed something different (named).

Lightning runs the last micro-batch's forward and backward inside the closure it hands to
``strategy.optimizer_step``; the engine routes that call through :meth:`StepGuard.guarded_step`
(:mod:`lightning_ckpt.lightning.shims`), so an error of the step is seen with the optimizer, the phase and the plan
at hand.

What an escalated retry guarantees (``on_oom="escalate"``, one process):

- the same micro-batch is run again under the next rung that checkpoints more
  (:func:`lightning_ckpt.decide.escalation.next_rung`), never a weaker plan; no optimizer step is applied twice
  and no batch is skipped;
- the gradients of the retried step equal those of a run without the error, to float32 rounding: an error in the
  forward has touched no gradient; an error in the backward is taken back — with gradient accumulation, the
  gradients the failed backward had already added to the earlier micro-batches' are subtracted again (the
  backward's incoming gradients are kept aside while it runs, at most one more gradient line);
- the retry draws the same random numbers as the failed attempt (dropout masks): the CPU generator's state and
  every CUDA device's (:data:`DEVICE_RNG`, where CUDA is initialized) are kept before the attempt and put back
  before the retry;
- the journal is kept whenever the step accumulates (``trainer.accumulate_grad_batches > 1``, read at every step:
  Lightning's ``GradientAccumulationScheduler`` sets it after the fit has started, and may change it per epoch);
- an error in an *earlier* micro-batch of an accumulation window happens outside the optimizer step (Lightning
  runs it directly); it is diagnosed (a note on the error), not retried, and the note says so and names the policy
  to resume with — "exhausted" is said only where the ladder has nothing stronger;
- with ``auto_threshold`` the controller hears of the failure
  (:meth:`~lightning_ckpt.decide.controller.Controller.out_of_memory`): it does not move back down into the policy
  that ran out of memory until a reading says it now fits with a margin;
- the failed attempt is gone before the retry starts: every traceback of the error's chain (``__cause__``,
  ``__context__``, exception groups) is cleared with its frames (:func:`release_failed_attempt`), so the tensors
  those frames held are freed before ``gc.collect()`` and ``torch.cuda.empty_cache()`` run; then the step's
  measurement starts over under the new plan (:meth:`~lightning_ckpt.lightning.port.PlanPort.restart_step`:
  the retry's peaks, phases and reference key, nothing of the failed attempt); a retry that succeeds forgets the
  failed attempt's allocator snapshot (:mod:`lightning_ckpt.lightning.snapshot`, which the guard records with
  ``snapshot_on_oom``), so that a later error is not described by it;
- the retry is inside the closure the precision plugin calls once: with ``16-mixed`` (a ``GradScaler``) the
  gradients are unscaled, and the optimizer stepped, once per optimizer step. An error after the closure (the
  optimizer step, gradient clipping) is diagnosed, never retried: the closure would run, and unscale, twice.

The phase named (:meth:`~lightning_ckpt.decide.diagnosis.PhaseTracker.where`) is the Trainer's when an evaluation
loop runs (validation, the sanity check: no gradients, so no checkpointing advice), the forward when the error came
up through compiled code while the tracker still says "before forward" (a compiled graph applies the block hook's
effect only after it returns), and a step is the optimizer's first when the optimizer holds no state yet (and has
not stepped in this process): a second ``fit`` with a fresh optimizer and a resumed one are told apart by the
optimizer itself.

A ``budget:`` policy's calibration retries its own out-of-memory steps whatever ``on_oom`` says (one process): the
calibration chose that plan, not the user. The stage is recorded as not fitting and the step is retried one rung up
without being recorded as any stage (:meth:`lightning_ckpt.decide.calibration.BudgetCalibration.out_of_memory`).

The guard is a feature (:class:`~lightning_ckpt.lightning.feature.Feature`), the last the engine calls. It reaches
the run through its :class:`~lightning_ckpt.lightning.port.PlanPort` (the plan and the one way to change it, the last
step's figures, a restart of the step's measurement, the other features, which it asks whether they retry their own
steps and tells of a retry): it never holds the engine.

Several processes (DDP, FSDP): a retry on one rank would meet its peers inside a collective of another step, so
the rank stops with the diagnosis and publishes it in the process group's store; its peers stop when their
collectives fail and carry that diagnosis on their own error: never a hang.
"""

from __future__ import annotations

import gc
import sys
import traceback
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt.core.replay import register_replay_hook
from lightning_ckpt.decide.diagnosis import (
    EVALUATION_PHASES,
    OutOfMemoryDiagnosis,
    PhaseTracker,
    diagnose,
    is_out_of_memory,
    raised_in_compiled_code,
)
from lightning_ckpt.decide.escalation import stronger, stronger_rungs
from lightning_ckpt.forecast.measured import measured_remedies, oom_sentence, run_facts, state_to_come
from lightning_ckpt.forecast.remedies import RunFacts
from lightning_ckpt.lightning import shims
from lightning_ckpt.lightning.feature import Feature
from lightning_ckpt.lightning.snapshot import DEFAULT_MAX_ENTRIES, OOMSnapshot
from lightning_ckpt.measure.ledger import Ledger, model_state_bytes

if TYPE_CHECKING:  # pragma: no cover
    from lightning_ckpt.lightning.port import PlanPort

__all__ = ["DEVICE_RNG", "CudaGenerators", "GradientJournal", "RandomState", "StepGuard", "measured_remedies_of",
           "release_failed_attempt", "run_facts_of"]

_STORE_KEY = "lightning_ckpt/out_of_memory"


class CudaGenerators:
    """Every CUDA device's random generator (each call is here, so a CPU test can fake them)."""

    @staticmethod
    def get_state() -> Optional[List[torch.Tensor]]:
        """Each device's generator state; ``None`` while CUDA is not initialized (reading would initialize it)."""
        return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @staticmethod
    def set_state(states: List[torch.Tensor]) -> None:
        torch.cuda.set_rng_state_all(states)


DEVICE_RNG: Any = CudaGenerators
"""The device generators :class:`RandomState` keeps; replace it in a test."""


class RandomState:
    """The random generators' states before a step's attempt: a retry put back draws what the attempt drew."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.device = DEVICE_RNG.get_state()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            DEVICE_RNG.set_state(self.device)


def release_failed_attempt(err: BaseException, keep: Optional[BaseException] = None) -> None:
    """Let go of what an error's chain holds of the attempt that raised it, so that its tensors are freed now.

    Every exception of the chain — ``__cause__``, ``__context__`` and the members of exception groups, recursively —
    has its traceback's frames cleared (:func:`traceback.clear_frames`: their locals, the failed forward's tensors
    among them; frames still running are left alone) and its traceback dropped, and the links of the chain are
    cut. A frame that holds the exception it caught (``except E as e: kept = e``) is a reference cycle only
    ``gc`` would break; cleared, it is freed by reference counting. ``err`` keeps its type and message.

    Args:
        err: the error of the failed attempt.
        keep: an exception that was being handled before the attempt started (``sys.exc_info()`` then): it is
            not the attempt's, so it and its own chain are left as they are.
    """
    seen = set()
    pending: List[Optional[BaseException]] = [err]
    while pending:
        exc = pending.pop()
        if exc is None or exc is keep or id(exc) in seen:
            continue
        seen.add(id(exc))
        pending.extend((exc.__cause__, exc.__context__, *getattr(exc, "exceptions", ())))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc.__cause__ = exc.__context__ = None


class GradientJournal:
    """Keeps each parameter's incoming gradient of one backward, so that a failed backward can be taken back.

    While active, a hook per parameter notes the gradient about to be accumulated (and whether ``.grad`` existed),
    and a post-accumulate hook notes that it was added. :meth:`undo` subtracts what was added (or drops a
    ``.grad`` the backward created). The incoming gradients stay alive until :meth:`close`.
    """

    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        self.incoming: Dict[int, Tuple[torch.nn.Parameter, torch.Tensor, bool]] = {}
        self.added: List[int] = []
        self.handles = []
        for p in params:
            if p.requires_grad:
                self.handles.append(p.register_hook(self._note_incoming(p)))
                self.handles.append(p.register_post_accumulate_grad_hook(self._note_added))

    def _note_incoming(self, p: torch.nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.incoming[id(p)] = (p, grad, p.grad is None)
            return grad

        return hook

    def _note_added(self, p: torch.nn.Parameter) -> None:
        self.added.append(id(p))

    @torch.no_grad()
    def undo(self) -> None:
        for key in self.added:
            p, grad, was_none = self.incoming[key]
            if was_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.sub_(grad)
        self.added.clear()
        self.incoming.clear()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.incoming.clear()
        self.added.clear()


class StepGuard(Feature):
    """Out-of-memory handling, the allocator's record of it and replay-error naming for one run (see the module
    docstring): a :class:`~lightning_ckpt.lightning.feature.Feature` every run has, the last of the engine's list. It
    asks the other features of a retry when one comes (``port.features``), not before.

    It keeps the phase of the step in flight (:class:`~lightning_ckpt.decide.diagnosis.PhaseTracker`) from the
    feature hooks, a forward pre-hook on the first block and the optimizer step it routes through
    :meth:`guarded_step`.

    Args:
        port: what the guard reaches of the run (:class:`~lightning_ckpt.lightning.port.PlanPort`).
    """

    def __init__(self, port: "PlanPort") -> None:
        self.port = port
        self.tracker = PhaseTracker()
        self.snapshot: Optional[OOMSnapshot] = None  # snapshot_on_oom: the allocator's record
        self.replaying: Optional[str] = None  # the region replayed last: named when its replay misbehaves
        self.world_size = 1
        self.trainer: Any = None
        self.store: Any = None
        self._stepped: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers that stepped in this process
        self._handles: list = []  # the replay hook, the first block's forward pre-hook (each fit's own)

    def __getstate__(self) -> dict:
        # ddp_spawn pickles the callback: the weak set cannot be, and its optimizers are this process's anyway
        return {k: v for k, v in self.__dict__.items() if k != "_stepped"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _stepped=weakref.WeakSet())

    # ------------------------------------------------------------------------------------------ the feature's hooks
    def setup(self, trainer: Any, stage: str) -> None:
        """Every stage: the Trainer's stage names an evaluation loop's errors. Fitting: the optimizer step is
        routed through :meth:`guarded_step`."""
        self.trainer = trainer
        if stage == "fit":
            shims.install_optimizer_step_guard(trainer.strategy, self.guarded_step)

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Follow the step's phases and replays; with ``snapshot_on_oom``, record the allocator's history; read what
        the retry depends on from the Trainer. (The accumulation is read at every step instead:
        ``GradientAccumulationScheduler`` sets it later, per epoch.)"""
        self._release_handles()
        self._handles.append(register_replay_hook(self.note_replay))
        blocks = self.port.plan.blocks if self.port.plan is not None else ()
        if blocks:
            self._handles.append(blocks[0].register_forward_pre_hook(lambda *_: self.tracker.forward_start()))
        if self.port.settings.snapshot_on_oom:
            self.record(trainer)
        self.trainer = trainer
        self.world_size = trainer.world_size

    def before_batch(self, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.tracker.batch_start()

    def phase_starts(self, name: str) -> None:
        (self.tracker.backward_start if name == "backward" else self.tracker.optimizer_step_start)()

    def after_micro_batch(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.fit_loop._should_accumulate():
            self.tracker.optimizer_step_end()

    def record(self, trainer: Any) -> None:
        """``snapshot_on_oom``: record the allocator's history from now on (CUDA; a warning elsewhere), each fit."""
        if self.snapshot is not None and self.snapshot.recording:
            return
        setting = self.port.settings.snapshot_on_oom
        entries = DEFAULT_MAX_ENTRIES if setting is True else int(setting)
        folder = trainer.log_dir or trainer.default_root_dir  # every rank: log_dir is a collective under DDP
        self.snapshot = OOMSnapshot(folder, trainer.global_rank, entries)
        why_not = self.snapshot.start()  # no CUDA, or an allocator backend that cannot record
        if why_not is not None:
            self.snapshot = None
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(why_not)

    def close(self) -> None:
        """The run ends: the step is no longer routed here, the hooks come off, recording stops (its snapshot stays
        named; the next fit records again)."""
        if self.trainer is not None:
            shims.remove_optimizer_step_guard(self.trainer.strategy)
        self._release_handles()
        if self.snapshot is not None:
            self.snapshot.stop()

    def _release_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def accumulating(self) -> bool:
        """The step in flight accumulates over micro-batches (read now: a scheduler may have changed it)."""
        return self.trainer is not None and self.trainer.accumulate_grad_batches > 1

    def phase(self, err: Optional[BaseException] = None) -> str:
        """The phase of an error (see the module docstring); read before its traceback is released."""
        state = getattr(self.trainer, "state", None)
        stage = getattr(getattr(state, "stage", None), "value", None)
        compiled = err is not None and raised_in_compiled_code(err)
        return self.tracker.where(stage, compiled=compiled)

    def note_replay(self, owner: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A replay hook (:func:`~lightning_ckpt.core.replay.register_replay_hook`): remember who replays."""
        members = getattr(owner, "members", None)
        self.replaying = f"{members[0].name}…{members[-1].name}" if members else owner.name
        return fn(*args, **kwargs)

    def replay_error(self, err: CheckpointError) -> CheckpointError:
        return CheckpointError(
            f"lightning_ckpt: checkpointed block {self.replaying!r} computed something different when it was "
            "replayed in backward (determinism_check): a checkpointed region must be close to a pure function — "
            "no data-dependent shapes, no reads of mutable Python state, no randomness outside torch's RNG. "
            "Keep that block un-checkpointed (blocks= or policy='blocks:...'), make it pure, or see the docs' "
            f"Diagnosis page, 'Replay safety' (docs/diagnosis.md). Original error: {err}"
        )

    # ------------------------------------------------------------------------------------------ the step
    def guarded_step(self, original: Callable[..., Any], optimizer: Any, closure: Callable[[], Any],
                     *args: Any, **kwargs: Any) -> Any:
        """Run ``strategy.optimizer_step`` with a closure that retries on OOM (escalate) or diagnoses it."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        self.tracker.optimizer_ready(bool(getattr(inner, "state", None)) or inner in self._stepped)

        def retrying_closure() -> Any:
            outside = sys.exc_info()[1]  # being handled by a caller: not the failed attempt's
            random = RandomState() if self._retries() else None  # the failed attempt's draws are taken back too
            retried = False
            while True:
                journal = self._journal()
                try:
                    result = closure()
                except CheckpointError as err:
                    raise self.replay_error(err) from err
                except Exception as err:  # noqa: BLE001 - only out-of-memory errors are handled
                    if not is_out_of_memory(err):
                        raise
                    if journal is not None:
                        journal.undo()
                    if not self._escalate(err, outside):
                        raise self._stop(err, "closure") from err
                    if random is not None:
                        random.restore()
                    retried = True
                    continue
                finally:
                    if journal is not None:
                        journal.close()
                if retried and self.snapshot is not None:  # its snapshot is of an error that is gone
                    self.snapshot.recovered()
                return result

        try:
            result = original(optimizer, retrying_closure, *args, **kwargs)
        except OutOfMemoryDiagnosis:
            raise
        except Exception as err:  # noqa: BLE001
            if is_out_of_memory(err):
                raise self._stop(err, "after") from err
            raise
        try:  # an optimizer that keeps no state (SGD without momentum): its next step is not a first one
            self._stepped.add(inner)
        except TypeError:  # not weak-referenceable: its state alone decides
            pass
        return result

    def _feature_retries(self) -> bool:
        """A feature's own step may not fit by design (a budget's calibration): it is retried whatever on_oom says."""
        return any(feature.retries_out_of_memory() for feature in self.port.features)

    def _retries(self) -> bool:
        """Whether an out-of-memory step is retried: escalation on, or a feature's own step; one process."""
        return (self.port.settings.on_oom == "escalate" or self._feature_retries()) and self.world_size == 1

    def _journal(self) -> Optional[GradientJournal]:
        """A journal only where a retry would otherwise double-count: a retry possible, earlier micro-batches' grads."""
        module = self.port.module
        if not self._retries() or not self.accumulating or module is None:
            return None
        return GradientJournal(list(module.parameters()))

    def _escalate(self, err: BaseException, outside: Optional[BaseException] = None) -> bool:
        """Free what the failed attempt held and move to a stronger plan; ``False`` when that is not possible.

        The order matters: the failed attempt's chain is released first (its tensors freed by reference counting),
        then ``gc`` and the allocator's cache, then the measurement restarts (its peak counters reset on what is left).
        """
        port = self.port
        plan = port.plan
        if not self._retries() or plan is None:
            return False
        phase = self.phase(err)  # before the chain is released: the traceback says whether compiled code raised it
        ladder, before, spec, policy = list(port.settings.ladder), plan.layout, plan.spec, plan.policy
        for rung in stronger_rungs(before, ladder, accelerator=port.on_accelerator):
            port.change_plan(rung)
            # stronger as applied: the safety checks may keep some blocks off (stateful="skip")
            if stronger(plan.layout, before, accelerator=port.on_accelerator):
                break
        else:
            if plan.layout != before:
                port.change_plan(policy)
            return False
        # before the release: a budget's calibration drops what its stage captured of the failed attempt
        notes = [note for note in (feature.escalated(spec, rung) for feature in port.features) if note]
        release_failed_attempt(err, keep=outside)  # the chain's frames hold the failed attempt's tensors
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.tracker.batch_start()
        port.restart_step()
        note = "".join(f" ({note})" for note in notes)
        port.info(f"out of memory in the {phase.replace('_', ' ')} phase under policy {spec!r}{note}; retrying "
                    f"the same micro-batch with policy {plan.spec!r} ({plan.num_checkpointed}/{plan.num_blocks} "
                    "blocks checkpointed)")
        return True

    def diagnosis(self, err: BaseException, where: str = "outside") -> OutOfMemoryDiagnosis:
        """The diagnosis of ``err``: its phase, the last ledger, the peak's tensors, the allocator's record, and why it
        was not retried.

        Args:
            err: the out-of-memory error.
            where: ``"closure"`` (the forward and backward of the optimizer step, which a retry could not rescue),
                ``"after"`` (after them: the optimizer step, gradient clipping) or ``"outside"`` (anywhere else: an
                earlier micro-batch of an accumulation window, manual optimization, an evaluation loop).
        """
        port = self.port
        phase = self.phase(err)
        lines = {k.split("memory/")[-1].removesuffix("_gib"): v for k, v in port.last_metrics.items()
                 if "memory/" in k}
        last = port.last_ledger
        remedy = None
        if phase not in EVALUATION_PHASES:  # an evaluation loop has no training state to shrink
            try:
                if last is not None:
                    remedy = oom_sentence(last, run_facts_of(port), port.capacity)
                elif port.capacity is not None and port.module is not None:  # the first step: its model state
                    remedy = oom_sentence(_state_now(port), run_facts_of(port), port.capacity, measured=False)
            except Exception as failure:  # noqa: BLE001 - the out-of-memory diagnosis is raised whatever happens here
                warnings.warn(f"lightning_ckpt: the remedies could not be priced ({failure!r}); the out-of-memory "
                              "diagnosis goes on without them.", stacklevel=2)
        text = diagnose(phase, lines, port.capacity, last.phase_peaks if last is not None else None, remedy=remedy)
        peak = port.peak_anatomy()
        if peak is not None:  # which tensors: the last reference step's, labelled as such
            text += "\n" + _peak_lines(peak)
        record = self.snapshot.describe(err) if self.snapshot is not None else None
        if record:  # snapshot_on_oom: the allocator's own record, written at the failed allocation (or why none is)
            text += "\n" + record
        note = self._retry_note(phase, where)
        if note:
            text += "\n" + note
        return OutOfMemoryDiagnosis(f"{text}\nOriginal error: {err}", phase)

    def _retry_note(self, phase: str, where: str) -> str:
        """Why an escalating run did not retry this error, fix first (nothing when it was never to be retried)."""
        port = self.port
        if not (port.settings.on_oom == "escalate" or self._feature_retries()):
            return ""
        if phase in EVALUATION_PHASES:
            return ("Not retried: on_oom='escalate' retries training steps only, and an evaluation loop has no "
                    "gradients for checkpointing to save.")
        if self.world_size > 1:
            return (f"Not retried: with {self.world_size} processes a retry on one rank would meet its peers inside "
                    "another collective; every rank stops. Raise the policy (e.g. policy='all') and resume.")
        if where == "after":
            return ("Not retried: the error came after the forward and backward (the optimizer step or gradient "
                    "clipping), where running the step again would apply its update twice.")
        plan, ladder = port.plan, list(port.settings.ladder)
        current = plan.spec if plan is not None else "none"
        stronger_one = None
        if plan is not None and where == "outside":  # the closure's error: the escalation tried every stronger one
            rungs = stronger_rungs(plan.layout, ladder, accelerator=port.on_accelerator)
            stronger_one = next((rung for rung in rungs if rung != current), None)  # not the one kept off in part
        if stronger_one is None:
            return (f"Reduce the micro-batch (with gradient accumulation) or the sequence length, or add a policy that "
                    f"keeps less on the device to the ladder: no policy on the ladder {ladder} checkpoints more than "
                    f"the current plan {current!r}, so there is nothing left to retry with (the escalation is "
                    "exhausted).")
        return (f"To go on, resume from the last checkpoint with policy={stronger_one!r}: this micro-batch ran "
                "outside the optimizer step (an earlier micro-batch of a gradient accumulation window, or manual "
                "optimization), where its gradients cannot be taken back, so it was not retried.")

    def _stop(self, err: BaseException, where: str) -> OutOfMemoryDiagnosis:
        diagnosis = self.diagnosis(err, where)
        if self.world_size > 1:
            self._publish(str(diagnosis))
        return diagnosis

    def _publish(self, text: str) -> None:
        """Leave the diagnosis in the process group's store, for the peers that stop because this rank did."""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
                dist.distributed_c10d._get_default_store().set(_STORE_KEY, f"rank {rank}: {text}")
        except Exception:  # noqa: BLE001 - the diagnosis is raised on this rank whatever happens here
            pass

    def _published(self) -> Optional[str]:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            store = dist.distributed_c10d._get_default_store()
            return store.get(_STORE_KEY).decode() if store.check([_STORE_KEY]) else None
        except Exception:  # noqa: BLE001 - a store that is gone: nothing to add
            return None

    def annotate(self, exception: BaseException) -> None:
        """Add the diagnosis to an error that escaped the guarded closure: an OOM in an earlier micro-batch of an
        accumulation window, or a peer's collective failing because another rank ran out of memory."""
        if isinstance(exception, OutOfMemoryDiagnosis):
            return
        if is_out_of_memory(exception):
            exception.add_note(str(self.diagnosis(exception, "outside")))
        elif self.world_size > 1:
            published = self._published()
            if published:
                exception.add_note(f"lightning_ckpt: this rank stopped because another ran out of memory — "
                                   f"{published}")


def run_facts_of(port: "PlanPort") -> RunFacts:
    """What the run is beside its ledger (:func:`~lightning_ckpt.forecast.measured.run_facts`): the model's and its
    optimizers', the plan's blocks, name and checkpointed share, the largest micro-batch's samples."""
    module, plan = port.module, port.plan
    trainer = getattr(module, "_trainer", None)
    optimizers = trainer.optimizers if trainer is not None else ()
    blocks = plan.num_blocks if plan is not None else 1
    shape = port.batch_shape or (None, 0)
    return run_facts(module if module is not None else torch.nn.Module(), optimizers, blocks, int(shape[1] or 0),
                     plan.spec if plan is not None else "none",
                     plan.num_checkpointed / plan.num_blocks if plan is not None and plan.num_blocks else 0.0,
                     bool(getattr(port.settings, "zero_grad_before_forward", False)))


def _state_now(port: "PlanPort") -> Ledger:
    """The model state at an error before any step was measured: walked now on the model's device, the optimizer's
    first state counted as it will be allocated (:func:`~lightning_ckpt.forecast.measured.state_to_come`)."""
    module = port.module
    trainer = getattr(module, "_trainer", None)
    optimizers = list(trainer.optimizers) if trainer is not None else []
    device = next(module.parameters()).device
    state = model_state_bytes(module, optimizers, device=device)
    return Ledger(params=state.params, grads=state.grads, optimizer=state.optimizer + state_to_come(optimizers),
                  master=state.master, activations=0, capacity=port.capacity)


def measured_remedies_of(port: "PlanPort") -> Optional[Dict[str, Any]]:
    """The remedies priced from the last measured step's ledger (``None`` before one), for the end-of-fit report:
    ``ledger_report(..., remedies=measured_remedies_of(port))``
    (:func:`~lightning_ckpt.forecast.measured.measured_remedies`)."""
    last = port.last_ledger
    if last is None:
        return None
    return measured_remedies(last, run_facts_of(port), port.capacity)


def _peak_lines(data: Dict[str, Any], top: int = 5) -> str:
    """The largest tensors at the last reference step's activation peak (``data``: its anatomy), and its findings'
    codes."""
    from lightning_ckpt.core.units import format_bytes
    from lightning_ckpt.decide.anatomy import tensor_rows

    peak = data.get("activation_peak")
    if not peak:
        return ""
    rows = [f"At the activation peak of the last reference step (step {data['step']}, batch {data['shape']}, "
            f"{peak['phase']} phase), {format_bytes(peak['bytes'])}; the largest tensors:",
            *tensor_rows(peak["tensors"][:top], indent="  ")]
    codes = [f["code"] for f in data.get("findings", [])]
    if codes:
        rows.append(f"Findings: {', '.join(codes)} (the report and docs/diagnosis.md say what each means).")
    return "\n".join(rows)
