"""Plan the cheapest per-block checkpointing whose predicted activation peak fits a budget.

Inputs are measured per block: ``interior`` (bytes the block keeps for backward when it is *not* checkpointed),
``boundary`` (bytes it keeps when it *is*: its input) and ``recompute_s`` (its forward time, the price of a
replay). ``base`` is the activation memory outside the blocks (embeddings, head, loss).

Peak model (blocks run 0…L-1 forward, L-1…0 backward):

- end of forward: ``base + Σ cost_j`` with ``cost_j = boundary_j`` if checkpointed else ``interior_j``;
- replay of checkpointed block i in backward: blocks after i are already freed, so
  ``base + Σ_{j<i} cost_j + boundary_i + interior_i`` (the replay transient);
- the peak is the larger of the two.

:func:`plan_budget` solves this exactly (a knapsack over blocks in order, see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = ["BlockCost", "BudgetCalibration", "BudgetPlan", "plan_budget", "predict_peak"]


@dataclass(frozen=True)
class BlockCost:
    interior: int
    boundary: int
    recompute_s: float


@dataclass(frozen=True)
class BudgetPlan:
    """The chosen plan and what it predicts.

    Attributes:
        modes: ``"recompute"`` or ``"off"`` per block.
        predicted_peak: bytes, under the peak model above.
        recompute_s: total replay time added per step.
        fits: whether ``predicted_peak <= budget`` (``False`` means even checkpointing everything does not fit).
    """

    modes: Tuple[str, ...]
    predicted_peak: int
    recompute_s: float
    fits: bool
    budget: int

    def describe(self) -> str:
        chosen = [i for i, m in enumerate(self.modes) if m != "off"]
        from lightning_ckpt.core.units import format_bytes

        return (
            f"budget {format_bytes(self.budget)}: checkpoint {len(chosen)}/{len(self.modes)} blocks {chosen}, "
            f"predicted activation peak {format_bytes(self.predicted_peak)}, replay cost "
            f"{self.recompute_s * 1e3:.1f} ms/step{'' if self.fits else ' (does NOT fit even with every block)'}"
        )


def predict_peak(costs: Sequence[BlockCost], checkpointed: Sequence[bool], base: int = 0) -> int:
    """Predicted activation peak (bytes) of a plan under the module's peak model."""
    prefix = 0
    transient = 0
    for cost, ckpt in zip(costs, checkpointed):
        if ckpt:
            transient = max(transient, prefix + cost.boundary + cost.interior)
            prefix += cost.boundary
        else:
            prefix += cost.interior
    return base + max(prefix, transient)


def plan_budget(costs: Sequence[BlockCost], budget: int, base: int = 0, max_states: int = 4096) -> BudgetPlan:
    """The least-replay-time plan whose predicted peak fits ``budget`` (or checkpoint-all if none does).

    Exact dynamic programme over blocks in order: a state is (bytes kept so far, worst replay transient so
    far, replay time); states that another state beats on all three are dropped, and so are states already
    over budget (both byte figures only grow). ``max_states`` bounds the frontier for very deep models, keeping
    the fastest states.
    """
    states: List[Tuple[int, int, float, Tuple[bool, ...]]] = [(0, 0, 0.0, ())]
    for cost in costs:
        grown = []
        for prefix, transient, time, mask in states:
            grown.append((prefix + cost.interior, transient, time, mask + (False,)))
            replay = prefix + cost.boundary + cost.interior
            grown.append((prefix + cost.boundary, max(transient, replay), time + cost.recompute_s, mask + (True,)))
        feasible = [s for s in grown if base + max(s[0], s[1]) <= budget]
        states = _pareto(feasible)[:max_states]
        if not states:
            mask = [True] * len(costs)
            return BudgetPlan(_modes(mask), predict_peak(costs, mask, base),
                              sum(c.recompute_s for c in costs), False, budget)
    prefix, transient, time, mask = min(states, key=lambda s: (s[2], max(s[0], s[1])))
    return BudgetPlan(_modes(mask), base + max(prefix, transient), time, True, budget)


def _pareto(states):
    kept = []
    for state in sorted(states, key=lambda s: (s[2], s[0], s[1])):
        if not any(k[0] <= state[0] and k[1] <= state[1] for k in kept):
            kept.append(state)
    return kept


def _modes(mask: Sequence[bool]) -> Tuple[str, ...]:
    return tuple("recompute" if m else "off" for m in mask)


class BudgetCalibration:
    """Measure every block, choose the plan, verify it once: the ``budget:`` policy at run time (no Lightning).

    Steps (one optimizer step each, driven by the callback):

    1. ``every:2`` on blocks 0, 2, 4, …: the others run plain, so their saved bytes (``interior``) and forward
       time (``recompute_s``) are measured by block hooks; 2. the complement, measuring the rest. The memory of
       both calibration steps stays near the ``every:2`` level, never the un-checkpointed peak.
    3. :func:`plan_budget` picks the plan; the step after it is measured and compared with the prediction;
       if it does not fit, the budget is lowered by the overshoot and the plan is chosen again, once.

    Args:
        plan: the :class:`~lightning_ckpt.core.wrap.CheckpointPlan` to drive.
        meter: the :class:`~lightning_ckpt.measure.meter.StepMeter` counting activations during the step.
        budget: activation budget in bytes.
        synchronize: called around block timings (``torch.cuda.synchronize`` on a GPU) during calibration only.
        apply: sets the per-block modes (default ``plan.set_modes``); the Lightning edge passes its own, so that
            every plan change goes through its safety checks.
    """

    def __init__(self, plan, meter, budget: int, synchronize=None, apply=None) -> None:
        self.plan, self.meter, self.budget = plan, meter, budget
        self.synchronize = synchronize or (lambda: None)
        self.apply = apply or plan.set_modes
        n = plan.num_blocks
        self.interior: List[int] = [0] * n
        self.boundary: List[int] = [0] * n
        self.seconds: List[float] = [0.0] * n
        self.stage = 0  # 0, 1: calibration steps; 2: first planned step (verify); 3: corrected/verified
        self.chosen: "BudgetPlan | None" = None
        self.measured: "int | None" = None
        self.messages: List[str] = []
        self._handles: list = []
        self._open: dict = {}
        self._base = 0
        self._calibration_peaks: List[int] = []

    @property
    def calibrating(self) -> bool:
        return self.stage < 2

    @property
    def done(self) -> bool:
        return self.stage >= 3

    def begin_step(self) -> None:
        """Before the first micro-batch of an optimizer step: set the modes for this stage."""
        if self.stage in (0, 1):
            self.apply(["recompute" if m else "off" for m in self._mask(self.stage)])
            if not self._handles:
                self._install()

    def end_step(self, activations: int) -> None:
        """After the optimizer step, with the step's measured activation peak (bytes)."""
        if self.stage in (0, 1):
            self._calibration_peaks.append(activations)
            self.stage += 1
            if self.stage == 2:
                self._remove()
                # what the blocks do not explain (embeddings, logits, loss): the larger residual of the two steps
                self._base = max(0, max(peak - predict_peak(self.costs(), self._mask(stage))
                                        for stage, peak in enumerate(self._calibration_peaks)))
                self._choose(self.budget)
            return
        if self.stage == 2:
            self.measured = activations
            self.messages.append(f"budget plan: predicted {self.chosen.predicted_peak / 2**20:.1f} MiB, measured "
                                 f"{activations / 2**20:.1f} MiB")
            if activations > self.budget and self.chosen.fits:
                self._choose(self.budget - (activations - self.chosen.predicted_peak))
                self.messages.append("budget plan corrected once: the measured peak exceeded the budget")
            self.stage = 3

    def _mask(self, stage: int) -> List[bool]:
        return [i % 2 == stage for i in range(self.plan.num_blocks)]

    def costs(self) -> List[BlockCost]:
        return [BlockCost(i, b, s) for i, b, s in zip(self.interior, self.boundary, self.seconds)]

    def _choose(self, budget: int) -> None:
        self.chosen = plan_budget(self.costs(), max(budget, 0), base=self._base)
        self.apply(self.chosen.modes)
        self.messages.append(self.chosen.describe())

    def _install(self) -> None:
        for index, block in enumerate(self.plan.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(index)))
            self._handles.append(block.register_forward_hook(self._post(index)))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, index: int):
        import time

        import torch

        def hook(module, args):
            if not (module.training and torch.is_grad_enabled()):
                return
            self.boundary[index] = max(self.boundary[index], sum(
                a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))
            self.synchronize()
            self._open[index] = (time.perf_counter(), self.meter.live_saved_bytes() or 0)

        return hook

    def _post(self, index: int):
        import time

        def hook(module, args, output):
            if index not in self._open:
                return
            self.synchronize()
            t0, live0 = self._open.pop(index)
            self.seconds[index] = time.perf_counter() - t0
            if self.plan.modes[index] == "off":
                self.interior[index] = (self.meter.live_saved_bytes() or 0) - live0

        return hook
