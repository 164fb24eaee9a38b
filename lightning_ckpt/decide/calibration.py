"""The ``budget:`` policy at run time: measure every block in every mode, choose the plan, check it on a real step.

:class:`BudgetCalibration` drives the calibration's stages (one optimizer step each, driven by the callback; no
Lightning here), prices what it measured as :class:`~lightning_ckpt.decide.budget.BlockCost`\\ s, and hands them to
the pure solver (:func:`~lightning_ckpt.decide.budget.plan_budget`); its chosen plan is checked, corrected and
checked again through the one choose-check routine (:class:`~lightning_ckpt.decide.choose.CheckedChoice`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_ckpt.core.policy import COMPILER_MODE, compiler_fraction, compiler_modes
from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.decide.budget import (
    SOLVER_MODES,
    BlockCost,
    BudgetPlan,
    _peak,
    _prefix_and_transient,
    mode_mix,
    plan_budget,
    plan_seconds,
    predict_peak,
    run_eagerly,
)
from lightning_ckpt.decide.choose import BUDGET_MARGIN, TIME_TIE, CheckedChoice

__all__ = ["COMPILER_FRACTIONS", "TIME_KINDS", "BudgetCalibration"]

COMPILER_FRACTIONS = (0.0, 0.25, 0.5, 0.75)
"""The compiler budgets offered per block when the blocks are compiled one by one: with ``off``, ``recompute`` and
``selective`` that is 7 graphs per block class, under dynamo's default ``recompile_limit`` of 8."""

TIME_KINDS = ("time", "second time")
"""The time steps each calibration plan runs after its bytes step: two, because one timed step a plan priced a
mode with the noise of one step: on the 4-block Llama at 75 % of the way to ``none``, four runs priced a selective
block 4.5 to 18.5 ms and one of them chose four selective blocks, slower than the two recomputed blocks every run
of two timed steps chose (12 to 19 ms). Each has its own kind so that a stage replaced by stronger ones (out of
memory, or predicted above the budget) is replaced by stronger ones of the same kind, still timed twice."""


class BudgetCalibration:
    """Measure every block in every mode, choose the plan, verify it once: the ``budget:`` policy at run time.

    Steps (one optimizer step each, driven by the callback; no Lightning here):

    1. For each mode in ``modes`` (default ``recompute`` and ``selective``; ``offload`` too on CUDA), the mode on
       blocks 0, 2, 4, … and ``off`` on the others, then the complement; each of these two plans runs three steps:
       a **bytes** step (the first step of a plan is an exact reference step: ``off`` blocks give their saved
       bytes, blocks in the mode the bytes they keep and, in backward, what their replay creates) and two **time**
       steps (:data:`TIME_KINDS`; default mode, no per-operator tracking that would skew times): the forward of
       every block, and the replay of the blocks in the mode. A mode's time is its forward's extra time over
       ``off`` plus its replay (offload: the extra forward time twice, out and back). Memory stays between the
       ``every:2`` level and the un-checkpointed one, never above it.
       When the blocks run compiled (``block_caller`` given), hooks cannot time a compiled forward or replay and
       eager times are the wrong prices: there are no time steps; instead, after the bytes steps, one block of each
       class is timed on its own in every mode, as training runs it (:mod:`lightning_ckpt.decide.block_timing`).
    2. Time is noisy on a shared machine: blocks of one class share the median of their measured times per mode
       (a Transformer's blocks are alike); bytes stay per block.
    3. :func:`plan_budget` picks the plan within ``(1 - margin) × budget`` through the one choose-check routine
       (:class:`~lightning_ckpt.decide.choose.CheckedChoice`), whose checks are verifying steps: the step after a
       choice runs it and is measured (a stage's reading prices a plan but checks nothing). A reading off its
       prediction by more than ``margin × budget`` corrects the prediction (the bases move by the difference), and
       every plan checked competes with its measured peak from then on; the plan is chosen again, settled when the
       choice is a plan already checked, else verified on the next step, up to
       :data:`~lightning_ckpt.decide.choose.MAX_CHECKS` steps; then the routine's give-up rule keeps the fastest plan
       checked within the budget.

    **No stage above the budget.** With ``predict`` (the edge passes the plan's activation peak traced on fake
    tensors at the calibration's shape), every stage is predicted before it runs: the traced peak times the device's
    bytes per traced byte, read from the stages already run (the largest ratio seen; the first stage, every block
    recomputed, is the plan with the least kept and runs first). A stage predicted above ``(1 - margin) × budget``
    is replaced by stronger stages that measure what it was to measure (:meth:`_stronger_stages`), before it runs,
    exactly as a stage that ran out of memory is; a block that fits ``off`` in no stage is priced with the interior
    of a block of its class, else with what its replay creates (an upper bound). Only the stage with nothing left
    to strengthen (every block recomputed or stronger) runs whatever its prediction: it is the plan with the lowest
    peak, and a budget below it is reported (the run's plan then is the one with the lowest predicted peak).
    4. A step that runs out of memory (the caller calls :meth:`out_of_memory` and retries it under a stronger plan
       of its own) is no stage: what the stage had measured is taken back, its plan is recorded as not fitting
       (:attr:`unfit`), and the retried step is recorded as nothing. The stage is replaced by stronger stages that
       measure what it was to measure (:meth:`_stronger_stages`: its ``off`` blocks in halves, the others
       recomputed), and a later stage that is at most as strong as a plan that did not fit, block by block, is
       replaced the same way without being run. A block that never fitted ``off`` is priced with the interior
       measured on a block of its class, else with what its replay creates (an upper bound: a replay recreates what
       the block saves). The plan is then chosen below the lowest peak of the plans that did not fit (predicted, or
       measured where they ran), and when nothing predicted fits there, the fastest plan that ran is taken. When
       the verifying step runs out of memory, its plan joins :attr:`unfit`, the plan is chosen again the same way
       and verified on the next step. So the calibration runs no plan weaker than one that ran out of memory and
       never records a retried step.

    Args:
        plan: the :class:`~lightning_ckpt.core.wrap.CheckpointPlan` to drive.
        meter: the :class:`~lightning_ckpt.measure.meter.StepMeter` counting activations during the step.
        budget: activation budget in bytes.
        synchronize: called around block timings (``torch.cuda.synchronize`` on a GPU) during calibration only.
        apply: sets the per-block modes (default ``plan.set_modes``); the Lightning edge passes its own, so that
            every plan change goes through its safety checks.
        modes: the modes the plan may mix with ``off``.
        block_caller: for blocks that run compiled: maps a block to the callable that runs it as training does
            (the block itself when compiled with ``block.compile()``; ``torch.compile(block)`` when the whole model
            is one compiled graph). Given, the time costs come from timing blocks on their own (step 1).
        repeats: timed rounds per block class with ``block_caller``.
        compiler_fractions: offer ``compiler:<f>`` for each of these fractions (blocks compiled one by one only:
            ``block_caller`` must be given and the whole model must not be one graph). Their time and what they
            keep are measured on the compiled block alone; an eager step runs them as ``off``, so a caller checking
            the plan with an eager figure subtracts their measured savings (:meth:`compiled_savings`) first, as the
            callback does.
        times: run the time stages (``False``: bytes only, every time 0, e.g. when pricing a shape on fake
            tensors, :mod:`lightning_ckpt.decide.pricing`).
        choose: choose and apply a plan when the stages are over (``False``: measure only; :meth:`costs` and
            :attr:`base` hold what was measured).
        predict: ``predict(modes) -> bytes``: the plan's activation peak traced on fake tensors at the calibration's
            shape (``None`` when it cannot be traced); given, no stage runs that is predicted above the budget.
        margin: the share of the budget kept free by prediction (:data:`~lightning_ckpt.decide.choose.BUDGET_MARGIN`).
    """

    def __init__(self, plan, meter, budget: int, synchronize=None, apply=None,
                 modes: Sequence[str] = ("recompute", "selective"), block_caller=None, repeats: int = 5,
                 compiler_fractions: Sequence[float] = (), times: bool = True, choose: bool = True,
                 predict: Optional[Callable[[Tuple[str, ...]], Optional[int]]] = None,
                 margin: float = BUDGET_MARGIN) -> None:
        self.plan, self.meter, self.budget = plan, meter, budget
        self.predict, self.margin = predict, margin
        self._unit: Optional[float] = None  # device bytes per traced byte, the largest ratio the stages read
        self._raised = 0  # bytes the bases were raised by after a verifying step read above its prediction
        self._verifications = 0
        self._paused = False  # a prediction's fake step is running: the hooks measure nothing
        self._mixed = False  # a micro-batch of another shape ran in this step: its peak is not the stage's
        self.measuring = True  # the micro-batch in flight is of the calibration's shape: the hooks measure it
        self.worst_step: Optional[Tuple[int, Tuple[str, ...]]] = None  # the highest activation peak read, its plan
        self.predictions: Dict[Tuple[str, ...], int] = {}  # each plan run: its peak predicted before it ran
        self.synchronize = synchronize or (lambda: None)
        self.apply = apply or plan.set_modes
        self.modes = tuple(m for m in modes if m != "off")
        bad = [m for m in self.modes if m not in SOLVER_MODES or m == COMPILER_MODE]
        if bad:
            raise ValueError(f"budget modes {bad} are not calibrated modes; choose among "
                             f"{[m for m in SOLVER_MODES if m != COMPILER_MODE]} (the compiler's budgets come with "
                             "compiler_fractions).")
        self.compiler_modes = _compiler_modes(compiler_fractions, block_caller)
        # every block recomputed first: its peak is a replay in backward, which tells the backward base apart
        self.block_caller, self.repeats = block_caller, repeats
        kinds = ("bytes",) if block_caller is not None or not times else ("bytes",) + TIME_KINDS
        self._choosing, self._timing = choose, times
        n = plan.num_blocks

        def alternate(mode: str, parity: int) -> Tuple[str, ...]:  # the mode on blocks i % 2 == parity, else off
            return tuple(mode if i % 2 == parity else "off" for i in range(n))

        # (the mode the stage prices, the modes of its blocks, "bytes" or "time"); replaced in place on out of memory
        self.stages: List[Tuple[str, Tuple[str, ...], str]] = [("recompute", ("recompute",) * n, "bytes")] * (
            "recompute" in self.modes) + [(mode, alternate(mode, parity), kind)
                                          for mode in self.modes for parity in (0, 1) for kind in kinds]
        self.interior: List[int] = [0] * n
        self.boundary: List[int] = [0] * n
        self.seconds: List[List[float]] = [[] for _ in range(n)]  # forward time, off
        self.kept: Dict[str, List[Optional[int]]] = {m: [None] * n for m in self.modes}
        self.replay_bytes: Dict[str, List[Optional[int]]] = {m: [None] * n for m in self.modes}
        self.forward_seconds: Dict[str, List[List[float]]] = {m: [[] for _ in range(n)] for m in self.modes}
        self.mode_seconds: Dict[str, List[List[float]]] = {m: [[] for _ in range(n)] for m in self.modes}
        # each block's whole backward (its replay and what the replay changes), per stage mode: the blocks in the
        # mode, and the blocks off beside them in the same steps
        self.backward_seconds: Dict[str, List[List[float]]] = {m: [[] for _ in range(n)] for m in self.modes}
        self.backward_off: Dict[str, List[List[float]]] = {m: [[] for _ in range(n)] for m in self.modes}
        self._backward_open: Dict[int, float] = {}  # block -> when its backward began (its output's gradient came)
        self.stage = 0  # < len(stages): calibration steps; == len(stages): first planned step (verify); then done
        self.chosen: "BudgetPlan | None" = None
        self.measured: "int | None" = None
        self.messages: List[str] = []
        self._handles: list = []
        self._open: dict = {}
        self._base: Tuple[int, int] = (0, 0)
        self.measured_plans: Dict[Tuple[str, ...], int] = {}  # plans run during calibration: their measured peak
        self._inputs: Dict[int, object] = {}  # block_caller: the timed block of each class -> its captured input
        self.block_seconds: Dict[str, Dict[str, float]] = {}  # block_caller: class -> mode -> seconds added
        self.compiled_kept: Dict[str, Dict[str, int]] = {}  # compiler modes: class -> mode -> bytes kept compiled
        self._calibration_peaks: List[Tuple[Tuple[str, ...], int]] = []  # the bytes stages run: (modes, peak)
        self.unfit: List[Tuple[str, ...]] = []  # plans that ran out of memory (stages, or a chosen plan verified)
        self._verified: set = set()  # plans a verifying step measured
        self._choice: Optional[CheckedChoice] = None  # choose, check, choose again (after the stages)
        self._measured_off: set = set()  # blocks whose interior was measured (off in a bytes stage that fitted)
        self._failed = False  # the step in flight ran out of memory: its retry is no stage's
        self._snapshot: Optional[tuple] = None  # the measurements before the stage in flight
        self._reapply = False  # the chosen plan is to be applied again (its verifying step was retried)

    @property
    def calibrating(self) -> bool:
        return self.stage < len(self.stages)

    @property
    def exact_step(self) -> bool:
        """The step about to run is a bytes step, to be measured exactly. A time step must not be: per-operator
        tracking would inflate every block's time, replays (more operators) most. Every caller (the callback, the
        frontier command, the benchmarks) sets the step's exactness from this."""
        return self.calibrating and self.stages[self.stage][2] == "bytes"

    @property
    def base(self) -> Tuple[int, int]:
        """Activation bytes the blocks do not explain, ``(at the end of the forward, in backward)``: known after
        calibration."""
        return self._base

    @property
    def done(self) -> bool:
        return self.stage > len(self.stages)

    @property
    def pending(self) -> bool:
        """A plan chosen while a step was retried waits for :meth:`begin_step` to be applied."""
        return self._reapply

    @property
    def verifications(self) -> int:
        """Steps the chosen plan (and its corrections) took to be verified."""
        return self._verifications

    @property
    def target(self) -> int:
        """The activation peak a plan must be predicted within to run: the budget less the margin (bytes)."""
        return int(self.budget * (1 - self.margin))

    def predicted(self, modes: Sequence[str]) -> Optional[int]:
        """The activation peak ``modes`` is predicted to reach at the calibration's shape before it runs (bytes, the
        device's): its measured peak where it ran, else its traced peak times the device's bytes per traced byte
        (``offload`` counted as ``off``, which keeps at least as much on the device); ``None`` without ``predict``."""
        modes = tuple(modes)
        ran = dict(self._calibration_peaks)
        if modes in ran:
            return ran[modes]
        if self.predict is None:
            return None
        traced = self._traced(tuple("off" if m == "offload" else m for m in modes))
        return None if traced is None else round(traced * (self._unit or 1.0))

    def _traced(self, modes: Tuple[str, ...]) -> Optional[int]:
        """``predict(modes)``, with this calibration's hooks deaf to the fake step it runs."""
        self._paused = True
        try:
            return self.predict(modes)
        finally:
            self._paused = False

    def _learn_unit(self, modes: Sequence[str], activations: int) -> None:
        """A bytes stage ran: the device's bytes per traced byte, the largest ratio read so far (offload's stages
        leave bytes on the host, which a trace does not: they teach nothing)."""
        if self.predict is None or "offload" in modes:
            return
        traced = self._traced(tuple(modes))
        if traced:
            self._unit = max(self._unit or 0.0, activations / traced)

    def _note_step(self, modes: Sequence[str], activations: int) -> None:
        if self.worst_step is None or activations > self.worst_step[0]:
            self.worst_step = (activations, tuple(modes))

    def begin_step(self) -> None:
        """Before the first micro-batch of an optimizer step: set the modes for this stage (on the verifying step
        after a retried one, the chosen plan again)."""
        self._failed = False
        self._skip_unfit_stages()
        if self.calibrating:
            self._snapshot = self._measurements()
            modes = tuple(self.stages[self.stage][1])
            predicted = self.predicted(modes)
            if predicted is not None:
                self.predictions.setdefault(modes, predicted)
            self.apply(list(modes))
            if not self._handles:
                self._install()
        elif not self.done and self.chosen is None:  # the last stages were replaced by none: choose now
            self._finish()
        elif self._reapply:  # chosen while a step was retried (done or not: it has not run yet)
            self._reapply = False
            self.apply(self.chosen.modes)
            self.plan.annotate(self.chosen.notes())

    def end_step(self, activations: int) -> None:
        """After the optimizer step, with the step's measured activation peak (bytes). With ``compiler:<f>`` blocks
        in the plan, the figure of the plan as it runs compiled: an eager figure less :meth:`compiled_savings`.
        A step that ran out of memory and was retried (:meth:`out_of_memory`) is ignored."""
        mixed, self._mixed, self.measuring = self._mixed, False, True
        if self._failed:  # retried under a stronger plan: its figure is that plan's, no stage's and no verification
            self._failed = False
            return
        if self.calibrating:
            _, modes, kind = self.stages[self.stage]
            peak = self.predicted(modes) if mixed else activations
            if not mixed:
                self._note_step(modes, activations)
            if kind == "bytes" and peak is not None:
                if not mixed:
                    self._learn_unit(modes, activations)
                self._calibration_peaks.append((modes, peak))
            self.stage += 1
            self._snapshot = None  # the stage is counted: a later discarded step takes nothing of it back
            self._skip_unfit_stages()
            if not self.calibrating:
                self._finish()
            return
        if not self.done and mixed and activations <= self.target:  # the plan's own peak is at most the step's
            self.messages.append(f"budget plan {mode_mix(self.chosen.modes)} verified within the budget on a step "
                                 f"with micro-batches of another shape ({format_bytes(activations)})")
            self.measured = None  # no reading of its own (an earlier one was another plan's: never credit it)
            self._choice.settle(tuple(self.chosen.modes))
            self.stage = len(self.stages) + 1
        elif not self.done:
            self._verify(activations)

    def _verify(self, activations: int) -> None:
        """The chosen plan's step read ``activations``: it is checked (:class:`CheckedChoice`); a reading off its
        prediction by more than the margin corrects the prediction (the bases move by the difference), and the plan
        is chosen again, settled when the choice is a plan already checked, else verified on the next step (class
        docstring, step 3)."""
        chosen = self.chosen
        self._note_step(chosen.modes, activations)
        self.measured, self._verifications = activations, self._verifications + 1
        self.measured_plans[tuple(chosen.modes)] = activations  # from now on it competes with its measured peak
        self._verified.add(tuple(chosen.modes))
        self._choice.record(tuple(chosen.modes), activations)
        error = activations - chosen.predicted_peak
        self.messages.append(f"budget plan: predicted {format_bytes(chosen.predicted_peak)}, measured "
                             f"{format_bytes(activations)}")
        if not chosen.fits:  # nothing fits: the plan with the lowest peak, as measured
            self._choice.settle(tuple(chosen.modes))
        elif abs(error) > self.margin * self.budget:
            self._raised = max(0, self._raised + error)
        self._next_plan()
        if not self.done:
            self.messages.append(f"budget plan corrected: {mode_mix(chosen.modes)} read {format_bytes(abs(error))} "
                                 f"{'above' if error > 0 else 'below'} its prediction; verifying "
                                 f"{mode_mix(self.chosen.modes)} on the next step")

    def _start_choice(self) -> None:
        """The stages are over: the choose-check routine. Its checks are verifying steps only: the stages' readings
        price plans for the solver but settle nothing (exact steps run eagerly, with per-operator tracking, and a
        real step that reads off its prediction says the stages' readings may be off too)."""
        checked = {p: v for p, v in self.measured_plans.items() if p not in self.unfit and p in self._verified}
        self._choice = CheckedChoice(self._solve, self.target, self._plan_seconds, checked)
        self._choice.checks = self._verifications

    def _solve(self, checked: Dict[Tuple[str, ...], int]) -> Tuple[str, ...]:
        self._choose(measured=checked, apply=False)
        return tuple(self.chosen.modes)

    def _plan_seconds(self, modes: Sequence[str]) -> float:
        return plan_seconds(self.costs(), modes)

    def _next_plan(self, apply: bool = True) -> None:
        """The routine's next plan becomes :attr:`chosen`: settled (a plan already checked), the calibration is
        done; else it is verified on the next step. ``apply``: set it on the blocks now (else on the next step)."""
        before = self.chosen
        modes = self._choice.propose()
        if self._choice.settled is not None:
            if tuple(self.chosen.modes) != modes:  # the give-up rule's plan, or one checked earlier
                self.chosen = self._known_plan(modes)
            self.measured = self._choice.checked[modes]
            self.stage = len(self.stages) + 1
            if self._choice.gave_up:
                self.messages.append(f"budget plan kept after {self._verifications} verifying steps: "
                                     f"{self.chosen.describe()}")
        if apply and (before is None or tuple(before.modes) != tuple(self.chosen.modes)):
            self.apply(list(self.chosen.modes))
            self.plan.annotate(self.chosen.notes())
        elif not apply:
            self._reapply = True

    def _known_plan(self, modes: Tuple[str, ...]) -> BudgetPlan:
        """A plan checked by the routine, as a :class:`BudgetPlan` at its checked peak."""
        costs, peak = self.costs(), self._choice.checked[modes]
        return BudgetPlan(modes, peak, self._plan_seconds(modes), peak <= self.target, self.budget,
                          self.chosen.smallest_budget if self.chosen else 0,
                          tuple((c.option(m), c.option("off")) for c, m in zip(costs, modes)))

    def run(self, step: Callable[[bool], int]) -> None:
        """Calibrate outside a training loop (the frontier command, benchmarks, tests, the pricing of a shape):
        ``step(exact)`` runs one optimizer step, measured exactly when ``exact``, and returns its activation peak;
        the plan is chosen at the end (the verifying step is the caller's)."""
        while self.calibrating:
            self.begin_step()
            if self.calibrating:  # begin_step may have replaced the last stages by none, and chosen
                self.end_step(step(self.exact_step))

    # -- resume: everything measured, the stage reached and the chosen plan, as primitives
    _SAVED = ("stage", "interior", "boundary", "seconds", "kept", "replay_bytes", "forward_seconds", "mode_seconds",
              "measured", "block_seconds", "compiled_kept", "_unit", "_raised", "_verifications")
    _SAVED_OPTIONAL = ("backward_seconds", "backward_off")  # absent from earlier saves: their replays price them

    def state_dict(self) -> Dict[str, object]:
        """What a resumed run needs to go on without calibrating again (lists, dicts, numbers and strings only)."""
        state: Dict[str, object] = {name: copy.deepcopy(getattr(self, name))
                                    for name in (*self._SAVED, *self._SAVED_OPTIONAL)}
        state.update(
            stages=[[label, list(modes), kind] for label, modes, kind in self.stages],
            measured_plans=[[list(m), v] for m, v in self.measured_plans.items()],
            calibration_peaks=[[list(m), v] for m, v in self._calibration_peaks],
            unfit=[list(m) for m in self.unfit], verified=[list(m) for m in sorted(self._verified)],
            measured_off=sorted(self._measured_off), base=list(self._base),
            worst_step=None if self.worst_step is None else [self.worst_step[0], list(self.worst_step[1])],
            chosen=None if self.chosen is None else {
                "modes": list(self.chosen.modes), "predicted_peak": self.chosen.predicted_peak,
                "fits": self.chosen.fits, "smallest_budget": self.chosen.smallest_budget})
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Go on where a saved run stopped: a stage in flight when it was saved runs again; a chosen plan is applied
        as it was (no stage runs again, none above the budget)."""
        if len(state["interior"]) != self.plan.num_blocks:
            raise ValueError(f"the saved budget calibration covers {len(state['interior'])} blocks, this model has "
                             f"{self.plan.num_blocks}")
        before = dict(self.__dict__)
        try:
            self._load(state)
        except Exception:  # nothing of an unreadable state stays: the calibration starts from the beginning
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    def _load(self, state: Dict[str, object]) -> None:
        for name in self._SAVED:
            setattr(self, name, copy.deepcopy(state[name]))
        for name in self._SAVED_OPTIONAL:
            if name in state:
                setattr(self, name, copy.deepcopy(state[name]))
        self.stages = [(label, tuple(modes), kind) for label, modes, kind in state["stages"]]
        self.measured_plans = {tuple(m): v for m, v in state["measured_plans"]}
        self._calibration_peaks = [(tuple(m), v) for m, v in state["calibration_peaks"]]
        self.unfit = [tuple(m) for m in state["unfit"]]
        self._verified = {tuple(m) for m in state.get("verified", [])}
        self._measured_off, self._base = set(state["measured_off"]), tuple(state["base"])
        worst = state.get("worst_step")
        self.worst_step = None if worst is None else (worst[0], tuple(worst[1]))
        chosen = state.get("chosen")
        self.chosen = None
        if chosen is not None:
            costs = self.costs()
            modes = tuple(chosen["modes"])
            self.chosen = BudgetPlan(modes, chosen["predicted_peak"], plan_seconds(costs, modes), chosen["fits"],
                                     self.budget, chosen["smallest_budget"],
                                     tuple((c.option(m), c.option("off")) for c, m in zip(costs, modes)))
            self._reapply = not self.done  # the verifying step applies it again
            if self._choosing:
                self._start_choice()
                if self.done:
                    self._choice.settle(modes)
            if self.done:
                self.apply(list(modes))
                self.plan.annotate(self.chosen.notes())

    @property
    def failed(self) -> bool:
        """The step in flight is no stage's (it ran out of memory, or was discarded)."""
        return self._failed

    def other_shape(self) -> None:
        """A micro-batch of another shape runs in this step, under a plan of its own: the stage's blocks are measured
        on the micro-batches of the calibration's shape only, and the step's peak, which may be the other one's, is
        not the stage's (its prediction stands in for it; a verifying step within the budget verifies the plan)."""
        self._mixed = True
        self.measuring = False
        self._open.clear()

    def discard_step(self) -> None:
        """The step in flight is no stage's (a micro-batch of another shape ran in it, under a plan of its own):
        what it measured is taken back, :meth:`end_step` ignores it, and the stage runs again on the next step."""
        if self.done:
            return
        self._open.clear()
        if self.calibrating and self._snapshot is not None:
            self._restore(self._snapshot)
        elif not self.calibrating and self.chosen is not None:  # the verifying step: verify on the next one
            self._reapply = True
        self._failed = True

    @property
    def stage_modes(self) -> Optional[Tuple[str, ...]]:
        """The modes of the stage in flight (``None`` when not calibrating)."""
        return tuple(self.stages[self.stage][1]) if self.calibrating else None

    def out_of_memory(self) -> None:
        """The step in flight ran out of memory; the caller retries it under a stronger plan of its own choosing
        (the escalation's next policy). Records the plan as not fitting, takes back what the stage had measured, and
        replaces the stage (or, on the verifying step, the chosen plan: chosen again, verified on the next step);
        the retried step is ignored by :meth:`end_step`, and the calibration's hooks measure nothing until the next
        :meth:`begin_step`. A second error in the same step (the retry's) changes nothing more."""
        if self._failed or self.done:
            return
        self._failed = True
        self._open.clear()
        if self.calibrating:
            if self._snapshot is not None:
                self._restore(self._snapshot)
            label, modes, kind = self.stages[self.stage]
            self._note_unfit(modes)
            replaced = self._replace_stage()
            self.messages.append(f"budget calibration: the {kind} stage {mode_mix(modes)} ran out of memory; "
                                 f"measuring {label!r} with {len(replaced)} stronger stage(s) instead")
            return
        if self.chosen is None:
            return
        failed = tuple(self.chosen.modes)
        self._note_unfit(failed)
        self._choice.checked.pop(failed, None)
        self._next_plan(apply=False)
        if self.chosen.modes in self.unfit:  # even the plans that ran no longer fit (memory grew): give up
            self.stage, self._reapply = len(self.stages) + 1, False
            self.messages.append(f"budget plan {mode_mix(failed)} ran out of memory and no plan the calibration ran "
                                 "fits any more; training goes on under the retried step's plan")
            return
        self.messages.append(f"budget plan {mode_mix(failed)} ran out of memory; verifying "
                             f"{mode_mix(self.chosen.modes)} on the next step")

    def _stage_modes(self, stage: int) -> List[str]:
        return list(self.stages[stage][1])

    def _finish(self) -> None:
        """The stages are over: price what was not measured, fit the bases, choose the plan and apply it."""
        self._remove()
        if self.block_caller is not None:
            self._time_blocks()
        self._price_unmeasured_interiors()
        ran = [(modes, peak) for modes, peak in self._calibration_peaks if modes not in self.unfit]
        self.measured_plans.update(dict(ran))
        # what the blocks do not explain (embeddings, logits, loss), forward and backward apart
        self._base = self._fit_base([list(m) for m, _ in self._calibration_peaks],
                                    [peak for _, peak in self._calibration_peaks])
        if self._choosing:
            self._start_choice()
            self._next_plan()
        else:  # measured only: nothing is chosen, nothing is verified
            self.stage = len(self.stages) + 1

    # -- out of memory: stages that do not fit, and what replaces them
    def _note_unfit(self, modes: Sequence[str]) -> None:
        modes = tuple(modes)
        if modes not in self.unfit:
            self.unfit.append(modes)
        self.measured_plans.pop(modes, None)

    def _dominated(self, modes: Sequence[str]) -> bool:
        """``modes`` is, block by block, at most as strong as a plan that ran out of memory: it would too."""
        strength = [_STRENGTH.get(m, 0) for m in modes]
        return any(all(a <= _STRENGTH.get(b, 0) for a, b in zip(strength, unfit)) for unfit in self.unfit)

    def _skip_unfit_stages(self) -> None:
        """Replace, without running them, the next stages that would run out of memory (:meth:`_dominated`) or are
        predicted above the budget (class docstring)."""
        while self.calibrating:
            label, modes, kind = self.stages[self.stage]
            if self._dominated(modes):
                self._replace_stage()
            elif not self._predicted_to_fit(modes):
                replaced = self._replace_stage()
                self.messages.append(f"budget calibration: the {kind} stage {mode_mix(modes)} is predicted at "
                                     f"{format_bytes(self.predicted(modes) or 0)}, above the budget less its margin "
                                     f"({format_bytes(self.target)}); measuring {label!r} with {len(replaced)} "
                                     "stronger stage(s) instead")
            else:
                return

    def _predicted_to_fit(self, modes: Sequence[str]) -> bool:
        """Whether a stage may run: predicted within :attr:`target`, or nothing stronger is left to run instead."""
        if not self._choosing or all(_STRENGTH.get(m, 0) >= _STRENGTH["recompute"] for m in modes):
            return True
        predicted = self.predicted(modes)
        return predicted is None or predicted <= self.target

    def _replace_stage(self) -> List[Tuple[str, Tuple[str, ...], str]]:
        """Put :meth:`_stronger_stages` of the current stage in its place (none already planned or run)."""
        label, modes, kind = self.stages[self.stage]
        planned = {(m, k) for _, m, k in self.stages}
        new: List[Tuple[str, Tuple[str, ...], str]] = []
        for stronger in self._stronger_stages(modes):
            if (stronger, kind) not in planned:
                planned.add((stronger, kind))
                new.append((label, stronger, kind))
        self.stages[self.stage:self.stage + 1] = new
        return new

    @staticmethod
    def _stronger_stages(modes: Sequence[str]) -> List[Tuple[str, ...]]:
        """Plans stronger than ``modes`` (a stage that does not fit) that measure what it was to measure.

        Its ``off`` blocks (priced by their interior) in two halves, each with the other half recomputed; with one
        ``off`` block left, that block beside recomputed ones, and the stage's other weak blocks (``selective``)
        without it; with no ``off`` block, the ``selective`` blocks in halves the same way. Nothing when one block
        is all that is left to measure: it does not fit beside blocks that are all recomputed or stronger.
        """
        weak = [i for i, m in enumerate(modes) if _STRENGTH.get(m, 0) < _STRENGTH["recompute"]]
        off = [i for i in weak if modes[i] == "off"]
        others = [i for i in weak if modes[i] != "off"]

        def recomputed(blocks: Sequence[int]) -> Tuple[str, ...]:
            return tuple("recompute" if i in blocks else m for i, m in enumerate(modes))

        group = off or others
        if len(group) >= 2:
            half = len(group) // 2
            return [recomputed(group[half:]), recomputed(group[:half])]
        if off and others:
            return [recomputed(others), recomputed(off)]
        return []

    def _measurements(self) -> tuple:
        """What a stage writes, as it is before the stage (taken back if the stage runs out of memory)."""
        values = (self.interior, self.boundary, self.seconds, self.kept, self.replay_bytes, self.forward_seconds,
                  self.mode_seconds, self.backward_seconds, self.backward_off, self._measured_off)
        return copy.deepcopy(values), dict(self._inputs)  # the captured inputs are tensors: not copied

    def _restore(self, snapshot: tuple) -> None:
        values, inputs = snapshot
        (self.interior, self.boundary, self.seconds, self.kept, self.replay_bytes, self.forward_seconds,
         self.mode_seconds, self.backward_seconds, self.backward_off, self._measured_off) = copy.deepcopy(values)
        self._inputs = dict(inputs)  # drops what the failed attempt captured (and the memory it holds)

    def _price_unmeasured_interiors(self) -> None:
        """Blocks never run ``off`` in a stage that fitted: the interior measured on a block of the same class, else
        what the block's replay created (an upper bound of what it saves)."""
        classes = [type(b).__name__ for b in self.plan.blocks]
        replays = self.replay_bytes.get("recompute", [None] * self.plan.num_blocks)
        priced = []
        for i in range(self.plan.num_blocks):
            if i in self._measured_off:
                continue
            same = [self.interior[j] for j in self._measured_off if classes[j] == classes[i]]
            estimate = max(same) if same else replays[i]
            if estimate is not None:
                self.interior[i] = estimate
                priced.append(i)
        if priced:
            self.messages.append(f"budget calibration: blocks {priced} never fitted 'off'; priced with "
                                 "the interior of a block of their class, else with what their replay creates")

    def _device_limit(self, costs: Sequence["BlockCost"]) -> Optional[int]:
        """The lowest activation peak of the plans that ran out of memory: measured where they ran (a bytes stage
        whose time stage did not fit), else predicted; ``None`` when every plan fitted."""
        ran = dict(self._calibration_peaks)
        peaks = []
        for modes in self.unfit:
            try:
                predicted = predict_peak(costs, modes, self._base)
            except ValueError:  # a mode never measured on some block: that plan cannot be chosen anyway
                predicted = None
            candidates = [v for v in (predicted, ran.get(modes)) if v is not None]
            if candidates:
                peaks.append(min(candidates))
        return min(peaks) if peaks else None

    def _fallback(self, costs: Sequence["BlockCost"], budget: int) -> Optional[BudgetPlan]:
        """The fastest plan that ran and fitted (within ``budget`` if one does, else the lowest), as a plan."""
        known = [(p, v) for p, v in self.measured_plans.items() if p not in self.unfit and len(p) == len(costs)]
        if not known:
            return None

        def seconds(plan: Sequence[str]) -> float:
            return plan_seconds(costs, plan)

        within = [(p, v) for p, v in known if v <= budget]
        plan, peak = min(within, key=lambda pv: (seconds(pv[0]), pv[1])) if within else min(known,
                                                                                         key=lambda pv: pv[1])
        choices = tuple((c.option(m), c.option("off")) for c, m in zip(costs, plan))
        return BudgetPlan(tuple(plan), peak, seconds(plan), peak <= budget, budget, min(v for _, v in known),
                          choices)

    def compiled_savings(self, modes: Sequence[str]) -> int:
        """Bytes a plan's ``compiler:<f>`` blocks save compiled against the same plan run eagerly (where they are
        ``off``), under the peak model: what to subtract from an eager reference step's figure (0 without them)."""
        if not compiler_modes(modes):
            return 0
        costs = self.costs()
        return max(predict_peak(costs, run_eagerly(modes), self._base) - predict_peak(costs, modes, self._base), 0)

    def _fit_base(self, plans: Sequence[Sequence[str]], peaks: Sequence[int]) -> Tuple[int, int]:
        """What the blocks do not explain, from the calibration steps: each step's peak is
        ``max(base_f + prefix, base_b + transient)`` (module docstring), so each base is at most the smallest
        residual over the steps, and equal to it on the steps that peak in its phase. Those smallest residuals are
        taken, then raised where a step still reads above its prediction (the phase predicted higher takes the
        difference), so that every calibration step is predicted at or above what it measured.

        Which phase a step peaks in is not decided from the blocks alone: a model whose logits dwarf a block
        (the Llama's vocabulary) peaks at the end of the forward even where a replay's transient outweighs the
        kept blocks; read as a backward peak, that step's residual had set ``base_b`` to the logits' size."""
        costs = self.costs()
        shapes = [_prefix_and_transient(costs, modes) for modes in plans]
        base_f = max(0, min((peak - prefix for (prefix, _), peak in zip(shapes, peaks)), default=0))
        replays = [(transient, peak) for (_, transient), peak in zip(shapes, peaks) if transient]
        base_b = max(0, min(peak - transient for transient, peak in replays)) if replays else base_f
        for (prefix, transient), peak in zip(shapes, peaks):
            short = peak - _peak(prefix, transient, (base_f, base_b))
            if short > 0 and (not transient or base_f + prefix >= base_b + transient):
                base_f += short
            elif short > 0:
                base_b += short
        return base_f, base_b

    def costs(self) -> List[BlockCost]:
        """The measured :class:`BlockCost` of every block (times: the median over blocks of the same class)."""
        out = []
        for i in range(self.plan.num_blocks):
            off = self._shared(self.seconds, i) or 0.0
            recompute = self._mode_seconds("recompute", i, off)
            selective_kept = self.kept["selective"][i] if "selective" in self.modes else None
            out.append(BlockCost(
                self.interior[i], self.boundary[i], recompute_s=recompute if recompute is not None else off,
                selective_kept=selective_kept,
                selective_s=self._mode_seconds("selective", i, off) if selective_kept is not None else None,
                offload_s=self._mode_seconds("offload", i, off),
                recompute_replay=self.replay_bytes["recompute"][i] if "recompute" in self.modes else None,
                selective_replay=self.replay_bytes["selective"][i] if "selective" in self.modes else None,
                compiler=self._compiler_costs(i)))
        return out

    def _compiler_costs(self, i: int) -> Tuple[Tuple[str, int, float], ...]:
        """Block ``i``'s ``compiler:<f>`` options: its interior scaled by the compiled graph's kept share."""
        name = type(self.plan.blocks[i]).__name__
        kept, seconds = self.compiled_kept.get(name, {}), self.block_seconds.get(name, {})
        off = kept.get("off", 0)
        return tuple((mode, self.boundary[i] + (round(self.interior[i] * kept[mode] / off) if off else 0),
                      seconds[mode]) for mode in self.compiler_modes if mode in kept and mode in seconds)

    def _shared(self, values_by_block: Sequence[Sequence[float]], i: int) -> Optional[float]:
        """The median of the values measured on every block of block ``i``'s class."""
        classes = [type(b).__name__ for b in self.plan.blocks]
        pooled = sorted(v for j, vs in enumerate(values_by_block) if classes[j] == classes[i] for v in vs)
        return pooled[len(pooled) // 2] if pooled else None

    def _mode_seconds(self, mode: str, i: int, off: float) -> Optional[float]:
        """Seconds ``mode`` adds to block ``i`` per step: its forward's extra time over ``off`` plus its replay."""
        if mode not in self.modes:
            return None
        if not self._timing:  # bytes only: every mode priced at no time
            return 0.0
        if self.block_caller is not None:
            return self.block_seconds.get(type(self.plan.blocks[i]).__name__, {}).get(mode)
        forward, replay = self._shared(self.forward_seconds[mode], i), self._shared(self.mode_seconds[mode], i)
        if mode == "offload":  # the copies out in the forward, and back in the backward
            return None if forward is None else 2 * max(forward - off, 0.0)
        forward_added = (forward if forward is not None else off) - off
        backward, backward_off = self._shared(self.backward_seconds[mode], i), self._shared(self.backward_off[mode], i)
        if backward is not None and backward_off is not None:
            return max(forward_added + backward - backward_off, 0.0)
        if replay is None:
            return None
        return max(forward_added, 0.0) + replay  # no backward timed (no input needs a gradient): the replay alone

    def _choose(self, budget: Optional[int] = None, apply: bool = True,
                measured: Optional[Dict[Tuple[str, ...], int]] = None) -> None:
        """Choose the plan for ``budget`` (default :attr:`target`), held below every plan that ran out of memory
        (:attr:`unfit`), its bases raised by what verifying steps read above their predictions; ``measured``: the
        peaks checked so far (default: every plan measured that fitted)."""
        budget = self.target if budget is None else budget
        modes = ("off", *self.modes, *[COMPILER_MODE] * bool(self.compiler_modes))
        costs = self.costs()
        base = (self._base[0] + self._raised, self._base[1] + self._raised)
        limit = self._device_limit(costs)
        if limit is not None and limit <= budget:
            budget = limit - 1
            self.messages.append(f"budget plan held below {format_bytes(limit)}: {len(self.unfit)} plan(s) at or "
                                 "above it ran out of memory on this device")
        if measured is None:
            measured = {p: v for p, v in self.measured_plans.items() if p not in self.unfit}
        chosen = plan_budget(costs, max(budget, 0), base=base, modes=modes, measured=measured, tie=TIME_TIE)
        if self.unfit and (chosen.modes in self.unfit or not chosen.fits):  # nothing predicted fits: one that ran
            chosen = self._fallback(costs, max(budget, 0)) or chosen
        # the user's budget, and the smallest one that holds a plan with the margin left free
        self.chosen = chosen = dataclasses.replace(chosen, budget=self.budget, smallest_budget=math.ceil(
            chosen.smallest_budget / (1 - self.margin)))
        if apply:
            self.apply(chosen.modes)
            self.plan.annotate(chosen.notes())
        self.messages.append(chosen.summary())

    def _install(self) -> None:
        from lightning_ckpt.core.replay import register_replay_hook

        for index, block in enumerate(self.plan.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(index)))
            self._handles.append(block.register_forward_hook(self._post(index)))
        self._handles.append(register_replay_hook(self._replay))
        if self.block_caller is not None:
            for index in self._timed_blocks():
                self._handles.append(self.plan.blocks[index].register_forward_pre_hook(self._capture(index),
                                                                                        with_kwargs=True))

    def _timed_blocks(self) -> List[int]:
        """The last block of each class (the first carries the engine's phase hook; any member would do)."""
        last = {type(block).__name__: i for i, block in enumerate(self.plan.blocks)}
        return sorted(last.values())

    def _capture(self, index: int):
        import torch

        from lightning_ckpt.decide.block_timing import capture_block_input

        def hook(module, args, kwargs):
            if index not in self._inputs and module.training and torch.is_grad_enabled() and self.measuring and not (
                    self._failed or self._paused):
                self._inputs[index] = capture_block_input(args, kwargs)

        return hook

    def _time_blocks(self) -> None:
        """Price each mode on one block per class, run alone as training runs it (the blocks are compiled)."""
        from lightning_ckpt.decide.block_timing import saved_block_bytes, time_block_modes

        n = self.plan.num_blocks
        for index, block_input in self._inputs.items():

            def set_mode(mode: str, index: int = index) -> None:
                self.apply([mode if i == index else "off" for i in range(n)])

            block, modes = self.plan.blocks[index], (*self.modes, *self.compiler_modes)
            call = self.block_caller(block)
            name = type(block).__name__
            self.block_seconds[name] = time_block_modes(call, set_mode, block_input, modes, self.repeats,
                                                        self.synchronize)
            if self.compiler_modes:
                self.compiled_kept[name] = saved_block_bytes(call, set_mode, block_input,
                                                             ("off", *self.compiler_modes), list(block.parameters()))
        self._inputs.clear()

    def close(self) -> None:
        """Remove the calibration's hooks (idempotent): the run ended, calibrated or not."""
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _live(self) -> int:
        """Bytes live now: the exact count on exact steps, else the saved-tensor view."""
        live = self.meter.live_bytes()
        return live if live is not None else (self.meter.live_saved_bytes() or 0)

    def _saved_activations(self) -> int:
        """Bytes held for backward now, less the autocast copies of parameters alive (exact steps): under autocast
        every linear saves its weight's low-precision copy, which the activation figure the budget is held to
        leaves out (``StepMeter``); counted, they priced every kept block ~15 % high on the bf16 demo GPT."""
        return (self.meter.live_saved_bytes() or 0) - (self.meter.live_copies_bytes() or 0)

    def _pre(self, index: int):
        import time

        import torch

        def hook(module, args):
            if not (module.training and torch.is_grad_enabled() and self.measuring) or self._failed or self._paused:
                return
            self.boundary[index] = max(self.boundary[index], sum(
                a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))
            if self.calibrating and self.stages[self.stage][2] in TIME_KINDS:
                self._time_backward(index, args, end=True)
            self.synchronize()
            self._open[index] = (time.perf_counter(), self._saved_activations(), self._live())

        return hook

    def _post(self, index: int):
        import time

        def hook(module, args, output):
            if index not in self._open:
                return
            self.synchronize()
            t0, saved0, live0 = self._open.pop(index)
            elapsed = time.perf_counter() - t0
            mode, kind = self.plan.modes[index], self.stages[self.stage][2] if self.calibrating else None
            if kind in TIME_KINDS:
                (self.seconds if mode == "off" else self.forward_seconds[mode])[index].append(elapsed)
                self._time_backward(index, output, end=False)
            elif kind == "bytes" and mode == "off":
                self.interior[index] = self._saved_activations() - saved0
                self._measured_off.add(index)
            elif kind == "bytes" and mode in self.kept:
                # what the block leaves alive: its output (the next block's boundary) and what the mode keeps
                self.kept[mode][index] = max(self._live() - live0 - self._output_bytes(output), 0) \
                    + self.boundary[index]

        return hook

    def _time_backward(self, index: int, tensors, end: bool) -> None:
        """Time block ``index``'s whole backward on a time step: it begins when its output's gradient is ready and
        ends when its input's is (a hook on each). That span holds the replay and everything the mode changes in
        the backward: the replay alone priced a recompute ~60 % above what it adds to a step on the demo GPT (the
        backward that follows a replay reads its fresh tensors faster) and a selective block below it."""
        import time

        import torch
        from torch.utils._pytree import tree_flatten

        first = next((t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is None or first.grad_fn is None:  # a leaf's hooks outlive the step: its block goes untimed
            return
        stage_mode, mode = self.stages[self.stage][0], self.plan.modes[index]
        if mode not in ("off", stage_mode):  # a stronger stage's recomputed blocks price no mode of the stage
            return
        spans = "backward_off" if mode == "off" else "backward_seconds"

        def begin(grad, index=index):
            self.synchronize()
            self._backward_open[index] = time.perf_counter()

        def finish(grad, index=index, spans=spans, stage_mode=stage_mode):
            start = self._backward_open.pop(index, None)
            if start is not None:
                self.synchronize()
                getattr(self, spans)[stage_mode][index].append(time.perf_counter() - start)

        first.register_hook(finish if end else begin)

    @staticmethod
    def _output_bytes(output) -> int:
        import torch
        from torch.utils._pytree import tree_flatten

        return sum(t.numel() * t.element_size() for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))

    def _replay(self, owner, fn, args, kwargs):
        import time

        from lightning_ckpt.measure.tracker import LiveBytes, exit_mode

        index, mode = getattr(owner, "index", None), getattr(owner, "mode", None)
        if (index is None or mode not in self.mode_seconds or not self.calibrating or self._failed or self._paused
                or not self.measuring):
            return fn(*args, **kwargs)
        if self.stages[self.stage][2] == "bytes":  # what the replay creates, at its peak
            scope = LiveBytes(self.meter.device)
            scope.__enter__()
            try:
                return fn(*args, **kwargs)
            finally:  # checkpoint's early stop ends a replay with an exception once everything needed is recomputed
                exit_mode(scope)
                self.replay_bytes[mode][index] = scope.peak  # the replay's weight copies apart, as the meter
        self.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.synchronize()
            self.mode_seconds[mode][index].append(time.perf_counter() - t0)


# a block's strength against running out of memory, as lightning_ckpt.decide.escalation ranks modes on an accelerator
# (not imported: that module imports torch, this one does not)
_STRENGTH = {"off": 0, "selective": 1, "recompute": 3, "offload": 4}


def _compiler_modes(fractions: Sequence[float], block_caller) -> Tuple[str, ...]:
    """``compiler:<f>`` mode names for ``fractions``, refused without compiled blocks or outside [0, 1]."""
    if not fractions:
        return ()
    if block_caller is None:
        raise ValueError(f"compiler_fractions={list(fractions)} needs blocks that run compiled one by one "
                         "(block.compile()); pass block_caller, or leave compiler_fractions empty.")
    modes = tuple(f"{COMPILER_MODE}:{float(f):g}" for f in fractions)
    bad = [f for f, m in zip(fractions, modes) if compiler_fraction(m) is None]
    if bad:
        raise ValueError(f"compiler_fractions {bad} are outside [0, 1]; the compiler's budget is a fraction of what "
                         "the block keeps un-checkpointed, e.g. (0.0, 0.25, 0.5, 0.75).")
    return modes
