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

__all__ = ["BlockCost", "BudgetPlan", "predict_peak", "plan_budget"]


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
        return (
            f"budget {self.budget / 2**30:.3f} GiB: checkpoint {len(chosen)}/{len(self.modes)} blocks {chosen}, "
            f"predicted activation peak {self.predicted_peak / 2**30:.3f} GiB, replay cost "
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
