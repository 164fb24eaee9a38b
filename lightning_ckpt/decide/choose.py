"""Choose, check, choose again: the one routine every plan chosen from a prediction goes through. Pure Python.

Three parts of the plugin pick a plan from predictions and must not run one above their limit:

- the budget's calibration (:mod:`lightning_ckpt.decide.calibration`): its chosen plan is checked by the next real
  step, measured;
- the budget's per-shape plans (:mod:`lightning_ckpt.decide.shape_plans`): each choice is checked by a trace on fake
  tensors at the bucket's shape before it runs;
- the auto-toggle's gate (:mod:`lightning_ckpt.lightning.gate`): each policy of the ladder is checked by a trace at
  the batch's shape.

Each is a :class:`CheckedChoice`:

1. ``choose(checked)`` proposes a candidate from the peaks checked so far (a candidate already checked competes with
   its checked peak, never with a prediction);
2. the caller checks it (a trace, or a measured step) and :meth:`~CheckedChoice.record`\\ s the peak it read;
3. choose again. The choice is **settled** when choosing again proposes a candidate already checked: what runs is
   what was checked.

**The give-up rule** (one for all three): after ``tries`` checks (default :data:`MAX_CHECKS`) with no settled choice,
the fastest candidate checked within the limit; else the checked candidate with the lowest peak. Never a candidate
nobody checked.

**The margin.** The budget's plans are chosen against the budget less :data:`BUDGET_MARGIN`: the room left for what
a prediction can miss on a device (allocator rounding, a kernel the trace did not see).
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Hashable, Mapping, Optional, Tuple, TypeVar

__all__ = ["BUDGET_MARGIN", "MAX_CHECKS", "TIME_TIE", "CheckedChoice", "choose_checked"]

BUDGET_MARGIN = 0.02
"""A plan runs under ``budget:`` only when its predicted activation peak is at most ``(1 - BUDGET_MARGIN) × budget``.
A step that reads above its prediction by more than this share of the budget corrects the prediction before the next
step."""
TIME_TIE = 0.25
"""Plans predicted to add within this share of the fastest plan's seconds count as equally fast, and the one that
checkpoints the fewest blocks is run. A block's price per mode is a median of hook-timed spans, and a step is not the
sum of its blocks' prices: on the demo GPT (6 × 256, CPU, 2026-12-07) the calibration priced a recomputed block at
11–13 ms and a selective one at 4.6–5.0 ms, while whole steps read 7–10 ms and 4–7 ms, so one recomputed and two
selective blocks, priced 5–16 % faster than two recomputed ones, ran 7 ms (2 %) slower per step than them; a 5 % tie
let that mix through in both runs. A mix has to be priced a quarter faster before it is run instead."""
MAX_CHECKS = 4
"""Checks (traces, or measured steps) a choice may take before the give-up rule settles it."""

K = TypeVar("K", bound=Hashable)


class CheckedChoice(Generic[K]):
    """One choice, checked until it settles (see the module docstring).

    Args:
        choose: ``choose(checked) -> candidate``, given the peaks checked so far (bytes by candidate).
        limit: the peak a candidate must be checked within (bytes).
        seconds: ``seconds(candidate)``: what it costs per step, for the give-up rule's "fastest".
        checked: peaks already known for candidates (measured or traced earlier): they settle a choice at once.
        tries: checks before the give-up rule.
    """

    def __init__(self, choose: Callable[[Dict[K, int]], K], limit: int, seconds: Callable[[K], float],
                 checked: Optional[Mapping[K, int]] = None, tries: int = MAX_CHECKS) -> None:
        self._choose, self.limit, self._seconds, self.tries = choose, limit, seconds, tries
        self.checked: Dict[K, int] = dict(checked or {})
        self.checks = 0
        self.settled: Optional[K] = None
        self.gave_up = False

    def propose(self) -> K:
        """The candidate to check next, or the settled one (then :attr:`settled` is set)."""
        if self.settled is not None:
            return self.settled
        candidate = self._choose(dict(self.checked))
        if candidate in self.checked:
            self.settled = candidate
        elif self.checks >= self.tries and self.checked:
            self.settled, self.gave_up = self.give_up(), True
        return self.settled if self.settled is not None else candidate

    def record(self, candidate: K, peak: int) -> None:
        """``candidate`` was checked and read ``peak`` bytes."""
        self.checked[candidate] = peak
        self.checks += 1

    def settle(self, candidate: K) -> None:
        """Take ``candidate`` as it is (the caller verified it some other way)."""
        self.settled = candidate

    def give_up(self) -> K:
        """The fastest candidate checked within the limit, else the checked one with the lowest peak."""
        within = [c for c, peak in self.checked.items() if peak <= self.limit]
        if within:
            return min(within, key=lambda c: (self._seconds(c), self.checked[c]))
        return min(self.checked, key=lambda c: (self.checked[c], self._seconds(c)))


def choose_checked(choose: Callable[[Dict[K, int]], K], check: Callable[[K], Optional[int]], limit: int,
                   seconds: Callable[[K], float], checked: Optional[Mapping[K, int]] = None,
                   tries: int = MAX_CHECKS) -> Tuple[K, Optional[int]]:
    """Run a :class:`CheckedChoice` whose checks are immediate (traces): ``check(candidate)`` returns its peak, or
    ``None`` when it cannot be checked (then that candidate is returned with ``None``: the caller's own prediction
    stands). Returns the settled candidate and its checked peak."""
    choice = CheckedChoice(choose, limit, seconds, checked, tries)
    while True:
        candidate = choice.propose()
        if choice.settled is not None:
            return candidate, choice.checked[candidate]
        peak = check(candidate)
        if peak is None:
            return candidate, None
        choice.record(candidate, peak)
