"""Errors of a training step, caught where they happen: out-of-memory (diagnosed, or retried one rung up) and a
checkpointed block whose replay computed something different (named).

Lightning runs forward and backward inside the closure it hands to ``strategy.optimizer_step``; the engine routes
that call through :meth:`StepGuard.guarded_step` (:mod:`lightning_ckpt.lightning.shims`), so an error of the
step is seen with the optimizer, the phase and the plan at hand.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt.decide.diagnosis import OutOfMemoryDiagnosis, diagnose, is_out_of_memory

if TYPE_CHECKING:  # pragma: no cover
    from lightning_ckpt.lightning.engine import CheckpointingEngine

__all__ = ["StepGuard"]


class StepGuard:
    """Out-of-memory handling and replay-error naming for one engine."""

    def __init__(self, engine: "CheckpointingEngine") -> None:
        self.engine = engine
        self.replaying: Optional[str] = None  # the region replayed last: named when its replay misbehaves

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
            "Keep that block un-checkpointed (blocks= or policy='blocks:...'), make it pure, or see README "
            f"'Diagnosis' (replay safety). Original error: {err}"
        )

    def guarded_step(self, original: Callable[..., Any], optimizer: Any, closure: Callable[[], Any],
                     *args: Any, **kwargs: Any) -> Any:
        """Run ``strategy.optimizer_step`` with a closure that retries on OOM (escalate) or diagnoses it."""

        def retrying_closure() -> Any:
            while True:
                try:
                    return closure()
                except CheckpointError as err:
                    raise self.replay_error(err) from err
                except Exception as err:  # noqa: BLE001 - only out-of-memory errors are handled
                    if not is_out_of_memory(err):
                        raise
                    if not self._escalate(optimizer, err):
                        raise self.diagnosis(err) from err

        try:
            return original(optimizer, retrying_closure, *args, **kwargs)
        except OutOfMemoryDiagnosis:
            raise
        except Exception as err:  # noqa: BLE001
            if is_out_of_memory(err):
                raise self.diagnosis(err) from err
            raise

    def _escalate(self, optimizer: Any, err: BaseException) -> bool:
        """Free what the failed step held and move one rung up; ``False`` when that is not possible."""
        engine = self.engine
        plan = engine.plan
        if engine.settings.on_oom != "escalate" or plan is None:
            return False
        rungs = list(engine.settings.ladder)
        level = rungs.index(plan.spec) if plan.spec in rungs else -1
        if level + 1 >= len(rungs):
            return False
        optimizer.zero_grad(set_to_none=True)
        err.__traceback__ = None  # the traceback's frames hold the failed step's tensors
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        phase = engine.phase.phase
        engine.change_plan(rungs[level + 1], level=level + 1)
        engine.phase.batch_start()
        engine.info(f"out of memory in the {phase.replace('_', ' ')} phase; retrying the same batch with policy "
                    f"{rungs[level + 1]!r} ({plan.num_checkpointed}/{plan.num_blocks} blocks checkpointed)")
        return True

    def diagnosis(self, err: BaseException) -> OutOfMemoryDiagnosis:
        engine = self.engine
        lines = {k.split("memory/")[-1].removesuffix("_gib"): v for k, v in engine.last_metrics.items()
                 if "memory/" in k}
        text = diagnose(engine.phase.phase, lines, engine.capacity)
        if engine.settings.on_oom == "escalate":
            text += f"\nThe escalation ladder {list(engine.settings.ladder)} is exhausted."
        return OutOfMemoryDiagnosis(f"{text}\nOriginal error: {err}", engine.phase.phase)

    def annotate(self, exception: BaseException) -> None:
        """An OOM that escaped the guarded closure (a gradient-accumulation micro-batch): add the diagnosis."""
        if is_out_of_memory(exception) and not isinstance(exception, OutOfMemoryDiagnosis):
            exception.add_note(str(self.diagnosis(exception)))
