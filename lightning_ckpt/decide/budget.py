"""Plan the fastest per-block mix of checkpointing modes whose predicted activation peak fits a budget: the pure
solver (no torch, no measurement; the run-time calibration that feeds it is :mod:`lightning_ckpt.decide.calibration`).

Each block can run in one of several modes (:data:`SOLVER_MODES`), each with measured costs
(:class:`BlockCost`, :meth:`BlockCost.options`):

==============  ======================================  ===========================================  ==============
mode            kept for backward (``kept``)            live while its backward runs (``replay``)    time per step
==============  ======================================  ===========================================  ==============
``off``         its interior (every saved tensor)       nothing beyond what is kept                  0
``selective``   its input + the saved ops' outputs      input + interior (the rest is recomputed)    the replay
``recompute``   its input (the boundary)                input + interior (the replay transient)      the replay
``offload``     nothing on the device (CUDA only)       interior (brought back for its backward)     the copies
``compiler:f``  input + f of the compiled interior       input + interior (at most a full replay)     measured
==============  ======================================  ===========================================  ==============

``compiler:<f>`` (the family ``compiler`` in ``modes``) is offered when the blocks are compiled one by one: the
block's graph runs under the compiler's activation memory budget ``f`` and the partitioner chooses per operator what
to keep (:mod:`lightning_ckpt.core.wrap`). What it keeps is measured on the compiled block alone
(:func:`~lightning_ckpt.decide.block_timing.saved_block_bytes`) and carried into the eager figures every other mode
is measured in as the same share of the block's interior: ``boundary + interior × kept_f / kept_off`` (compiled).

``base`` is the activation memory outside the blocks: ``(forward, backward)`` — at the end of the forward the
logits and the loss are alive, in backward they are gone (an ``int`` is both).

Peak model (blocks run 0…L-1 forward, L-1…0 backward): at the end of the forward ``base_f + Σ kept_j``; while block
i's backward runs, blocks after i are freed, so ``base_b + Σ_{j<i} kept_j + replay_i``; the peak is the larger.

``offload`` prefetches one offloaded block ahead (:mod:`lightning_ckpt.core.offload`): when offloaded block q's
backward starts, it brings back its own interior, then that of p, the offloaded block that ran last before it in the
forward (blocks of other modes in between do not count), and p's copies stay on the device until p's own backward
has consumed them. So while the backward of any block i with p ≤ i ≤ q runs, p's interior is live too: the moment
of block i with p < i ≤ q is ``base_b + Σ_{j<i} kept_j + (replay_i, or kept_i for an off block) + interior_p``.

:func:`plan_budget` solves this exactly: a dynamic programme over blocks in order whose states are
(bytes kept so far, worst backward moment so far, time so far, where the state stands with the prefetch). An
offloaded block branches in two: either no later block is offloaded, or one is, and then its interior is charged
at once to the moment of every block up to that next offloaded block, which the state must then reach (a plan
that ends owing it is none). States another state beats are dropped: as fast, no more bytes kept, no worse moment,
and at least the same plans open for no more bytes (no block offloaded yet beats any stage; otherwise only the
same stage, prefetching no more). It is exact because a plan's peak depends on the state only, and only grows with
its numbers (tested against brute force).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from lightning_ckpt.core.policy import COMPILER_MODE, compiler_fraction, compiler_modes
from lightning_ckpt.core.units import format_bytes

__all__ = ["SOLVER_MODES", "BlockCost", "BudgetPlan", "ModeCost", "mode_mix", "plan_budget", "plan_seconds",
           "predict_peak", "run_eagerly", "smallest_budget"]

SOLVER_MODES = ("off", "selective", "recompute", "offload", COMPILER_MODE)


def run_eagerly(modes: Sequence[str]) -> Tuple[str, ...]:
    """The plan as an eager count sees it (a reference step, a fake trace): ``compiler:<f>`` blocks run ``off``."""
    compiled = set(compiler_modes(modes))
    return tuple("off" if m in compiled else m for m in modes)


def mode_mix(modes: Sequence[str]) -> str:
    """``"1 off, 2 selective, 5 compiler:0"``: how many blocks run in each mode, whole-block modes first, then the
    compiler's budgets from the most kept to the least."""

    def order(mode: str):
        fraction = compiler_fraction(mode)
        return (len(SOLVER_MODES), -fraction) if fraction is not None else (SOLVER_MODES.index(mode), 0.0)

    return ", ".join(f"{list(modes).count(m)} {m}" for m in sorted(set(modes), key=order))


@dataclass(frozen=True)
class ModeCost:
    """One block in one mode: bytes kept for backward, bytes live while its backward runs, seconds added."""

    mode: str
    kept: int
    replay: int
    seconds: float


@dataclass(frozen=True)
class BlockCost:
    """A block's measured costs. ``interior``: bytes it keeps un-checkpointed; ``boundary``: its input;
    ``recompute_s``: one replay. ``selective_kept`` / ``selective_s``: bytes kept and replay time under op-level
    selective checkpointing; ``offload_s``: the copies' time under offload (``None``: that mode is unavailable);
    ``compiler``: ``(mode, kept, seconds)`` of each ``compiler:<f>`` mode measured (kept in eager units)."""

    interior: int
    boundary: int
    recompute_s: float
    selective_kept: Optional[int] = None
    selective_s: Optional[float] = None
    offload_s: Optional[float] = None
    recompute_replay: Optional[int] = None
    selective_replay: Optional[int] = None
    compiler: Tuple[Tuple[str, int, float], ...] = ()

    def options(self, modes: Sequence[str] = SOLVER_MODES) -> List[ModeCost]:
        """The modes this block can run in, among ``modes`` (``off`` always). A replay's live bytes are the
        boundary plus what the replay creates, when measured (``*_replay``), else boundary + interior."""
        full = self.boundary + self.interior
        out = [ModeCost("off", self.interior, 0, 0.0)]
        if "selective" in modes and self.selective_kept is not None and self.selective_s is not None:
            replay = self.boundary + self.selective_replay if self.selective_replay is not None else full
            out.append(ModeCost("selective", self.selective_kept, max(self.selective_kept, replay),
                                self.selective_s))
        if "recompute" in modes:
            replay = self.boundary + self.recompute_replay if self.recompute_replay is not None else full
            out.append(ModeCost("recompute", self.boundary, replay, self.recompute_s))
        if "offload" in modes and self.offload_s is not None:
            out.append(ModeCost("offload", 0, self.interior, self.offload_s))
        if COMPILER_MODE in modes:  # its backward recomputes at most what a full replay would
            replay = self.boundary + self.recompute_replay if self.recompute_replay is not None else full
            out.extend(ModeCost(mode, kept, max(kept, replay), seconds) for mode, kept, seconds in self.compiler)
        return out

    def option(self, mode: str) -> ModeCost:
        for option in self.options():
            if option.mode == mode:
                return option
        raise ValueError(f"mode {mode!r} has no measured cost for this block; measured: "
                         f"{[o.mode for o in self.options()]}.")


@dataclass(frozen=True)
class BudgetPlan:
    """The chosen plan and what it predicts.

    Attributes:
        modes: one mode per block: ``off``, ``selective``, ``recompute``, ``offload`` or ``compiler:<f>``.
        predicted_peak: bytes, under the peak model above.
        recompute_s: total time the plan adds per step (replays and copies).
        fits: whether ``predicted_peak`` is within the budget (under the calibration: within the budget less its
            margin, :data:`~lightning_ckpt.decide.choose.BUDGET_MARGIN`).
        budget: the budget asked for (bytes).
        smallest_budget: the smallest budget any plan of these modes fits (bytes; under the calibration, with the
            margin left free).
        choices: per block, the :class:`ModeCost` chosen and the ``off`` cost, for :meth:`summary`.
    """

    modes: Tuple[str, ...]
    predicted_peak: int
    recompute_s: float
    fits: bool
    budget: int
    smallest_budget: int = 0
    choices: Tuple[Tuple[ModeCost, ModeCost], ...] = field(default=(), repr=False)

    def describe(self) -> str:
        chosen = [i for i, m in enumerate(self.modes) if m != "off"]
        mix = mode_mix([m for m in self.modes if m != "off"]) or "nothing"
        text = (f"budget {format_bytes(self.budget)}: {mix} of {len(self.modes)} blocks {chosen}, predicted "
                f"activation peak {format_bytes(self.predicted_peak)}, added time {self.recompute_s * 1e3:.1f} ms/step")
        if not self.fits:
            text += (f" (does NOT fit: the smallest feasible budget is {format_bytes(self.smallest_budget)}; raise the "
                     "budget to at least that, shorten the sequence or the micro-batch)")
        return text

    def notes(self) -> List[str]:
        """Per block, one line: what its mode keeps, saves against ``off`` and adds per step."""
        return [f"keeps {format_bytes(chosen.kept)}, saves {format_bytes(off.kept - chosen.kept)}, replay peak "
                f"{format_bytes(chosen.replay)}, +{chosen.seconds * 1e3:.2f} ms" for chosen, off in self.choices]

    def summary(self) -> str:
        """Per block: the mode chosen, what it saves against ``off`` and what it costs."""
        header = f"  {'block':<6}{'mode':<14}{'kept':>12}{'saves':>12}{'replay peak':>13}{'adds ms':>9}"
        rows = [self.describe(), header]
        for i, (chosen, off) in enumerate(self.choices):
            rows.append(f"  {i:<6}{chosen.mode:<14}{format_bytes(chosen.kept):>12}"
                        f"{format_bytes(off.kept - chosen.kept):>12}{format_bytes(chosen.replay):>13}"
                        f"{chosen.seconds * 1e3:>9.2f}")
        return "\n".join(rows)


def _as_modes(plan: Sequence[Union[bool, str]]) -> List[str]:
    return [("recompute" if m else "off") if isinstance(m, bool) else m for m in plan]


Base = Union[int, Tuple[int, int]]


def _bases(base: Base) -> Tuple[int, int]:
    return (base, base) if isinstance(base, int) else (int(base[0]), int(base[1]))


def _peak(prefix: int, transient: int, base: Base) -> int:
    forward, backward = _bases(base)
    return max(forward + prefix, backward + transient if transient else 0)


def _prefix_and_transient(costs: Sequence[BlockCost], plan: Sequence[Union[bool, str]]) -> Tuple[int, int]:
    """Bytes the blocks keep at the end of the forward, and their worst moment in backward (bases apart).

    The reference the solver is tested against: each block's moment straight from the module docstring."""
    options = [cost.option(mode) for cost, mode in zip(costs, _as_modes(plan))]
    offloaded = [i for i, option in enumerate(options) if option.mode == "offload"]
    prefix = transient = 0
    for i, option in enumerate(options):
        prefetched = _prefetched(options, offloaded, i)
        if option.replay or prefetched:
            transient = max(transient, prefix + (option.replay or option.kept) + prefetched)
        prefix += option.kept
    return prefix, transient


def _prefetched(options: Sequence[ModeCost], offloaded: Sequence[int], i: int) -> int:
    """Bytes brought back ahead of their own backward while block ``i``'s backward runs: the interior of the last
    offloaded block before ``i``, once an offloaded block at or after ``i`` has started its backward."""
    before = [j for j in offloaded if j < i]
    if not before or not any(j >= i for j in offloaded):
        return 0
    return options[before[-1]].replay


def plan_seconds(costs: Sequence[BlockCost], modes: Sequence[str]) -> float:
    """Seconds per step a plan adds over every block ``off``: each block's cost in its mode."""
    return sum(c.option(m).seconds for c, m in zip(costs, modes))


def predict_peak(costs: Sequence[BlockCost], plan: Sequence[Union[bool, str]], base: Base = 0) -> int:
    """Predicted activation peak (bytes) of a plan (modes, or ``True`` = recompute) under the peak model."""
    return _peak(*_prefix_and_transient(costs, plan), base)


# Where a state stands with offload's prefetch: no block offloaded yet; the last offloaded block is the last one
# (no later block may be offloaded); another offloaded block must follow the last one, whose interior it prefetches
_OPEN, _LAST, _AHEAD = 0, 1, 2
# kept so far, worst moment so far, interior prefetched ahead (_AHEAD only, else 0), _OPEN/_LAST/_AHEAD, time,
# option index per block
_State = Tuple[int, int, int, int, float, Tuple[int, ...]]


def _grow(state: _State, option: ModeCost, k: int) -> List[_State]:
    """The states ``state`` leads to when the next block runs as ``option`` (its index ``k`` among the block's
    options): an offloaded block branches on whether another offloaded block follows it."""
    prefix, transient, ahead, stage, seconds, picks = state
    offloads = option.mode == "offload"
    if offloads and stage == _LAST:
        return []
    if option.replay or ahead:  # live while its backward runs: an off block holds what it keeps
        transient = max(transient, prefix + (option.replay or option.kept) + ahead)
    prefix, seconds, picks = prefix + option.kept, seconds + option.seconds, picks + (k,)
    if not offloads:
        return [(prefix, transient, ahead, stage, seconds, picks)]
    return [(prefix, transient, 0, _LAST, seconds, picks), (prefix, transient, option.replay, _AHEAD, seconds, picks)]


def _frontier(options: Sequence[Sequence[ModeCost]], limit: Optional[int], base: Base, max_states: int
              ) -> List[_State]:
    states: List[_State] = [(0, 0, 0, _OPEN, 0.0, ())]
    for block in options:
        grown = [new for state in states for k, option in enumerate(block) for new in _grow(state, option, k)]
        if limit is not None:  # kept bytes and the worst moment only grow: a state over the limit stays over it
            grown = [s for s in grown if _peak(s[0], s[1], base) <= limit]
        states = _pareto(grown)[:max_states]
        if not states:
            return []
    return [s for s in states if s[3] != _AHEAD]  # a promised offloaded block that never came: no plan


def smallest_budget(costs: Sequence[BlockCost], base: Base = 0, modes: Sequence[str] = SOLVER_MODES,
                    max_states: int = 4096) -> int:
    """The lowest predicted activation peak any plan of ``modes`` reaches (bytes): the smallest feasible budget."""
    options = [c.options(modes) for c in costs]
    return min(_peak(s[0], s[1], base) for s in _frontier(options, None, base, max_states))


def plan_budget(costs: Sequence[BlockCost], budget: int, base: Base = 0, modes: Sequence[str] = SOLVER_MODES,
                max_states: int = 4096, strict: bool = False,
                measured: Optional[Dict[Tuple[str, ...], int]] = None, tie: float = 0.0) -> BudgetPlan:
    """The fastest plan whose predicted peak fits ``budget``; among equally fast plans, the one that changes the
    fewest blocks from ``off``, then the fastest, then the lowest peak.

    Exact (see the module docstring); ``max_states`` bounds the frontier for very deep models, keeping the
    fastest states. ``measured`` maps plans (mode tuples) already run to their measured peaks: a measurement
    beats the model, so those plans compete with their measured peak. ``tie``: plans whose added seconds are
    within this share of the fastest's count as equally fast (measured times are that noisy: the run-time choice
    passes :data:`~lightning_ckpt.decide.choose.TIME_TIE`). When nothing fits, ``strict`` raises a
    ``ValueError`` naming the smallest feasible budget; otherwise the plan with the lowest peak is returned with
    ``fits=False``.
    """
    bad = [m for m in modes if m not in SOLVER_MODES]
    if bad:
        raise ValueError(f"budget modes {bad} are not solver modes; choose among {list(SOLVER_MODES)}.")
    options = [c.options(modes) for c in costs]
    floor = smallest_budget(costs, base, modes, max_states)
    known = {plan: peak for plan, peak in (measured or {}).items()
             if len(plan) == len(costs) and all(m in [o.mode for o in opts] for m, opts in zip(plan, options))}
    if known:
        floor = min(floor, min(known.values()))
    states = [s for s in _frontier(options, budget, base, max_states)
              if known.get(tuple(options[i][k].mode for i, k in enumerate(s[5])), 0) <= budget]
    for plan, peak in known.items():  # measured plans that fit, at the peak they were measured at
        if peak <= budget:
            picks = tuple([o.mode for o in opts].index(m) for m, opts in zip(plan, options))
            seconds = sum(options[i][k].seconds for i, k in enumerate(picks))
            states.append((peak - _bases(base)[0], 0, 0, _LAST, seconds, picks))
    if not states:
        if strict:
            raise ValueError(f"budget {format_bytes(budget)} cannot be met: the smallest feasible activation budget "
                             f"with modes {list(modes)} is {format_bytes(floor)}; pass at least that.")
        states = [min(_frontier(options, None, base, max_states), key=lambda s: (_peak(s[0], s[1], base), s[4]))]
    # equal times: fewest blocks changed, then fastest, then lowest peak (a mode measured as free is free within
    # noise only; a mix of more changed blocks predicted faster by less than the noise is not known to be faster)
    fastest = min(s[4] for s in states)
    tied = [s for s in states if s[4] <= fastest * (1 + tie)]
    prefix, transient, _, _, time, picks = min(tied, key=lambda s: (sum(options[i][k].mode != "off"
                                                                        for i, k in enumerate(s[5])),
                                                                    s[4], _peak(s[0], s[1], base)))
    chosen = tuple(options[i][k] for i, k in enumerate(picks))
    peak = known.get(tuple(o.mode for o in chosen), _peak(prefix, transient, base))
    return BudgetPlan(tuple(o.mode for o in chosen), peak, time, peak <= budget, budget, floor,
                      tuple((o, opts[0]) for o, opts in zip(chosen, options)))


def _pareto(states: List[_State]) -> List[_State]:
    """The states no other state beats, fastest first. A state beats another when it is as fast, keeps no more
    bytes, has no worse moment and leaves at least the same plans open for no more bytes: a state with no block
    offloaded beats any; one whose last offloaded block is behind it beats only its like; one with an offloaded
    block to come beats only its like prefetching at most as many bytes."""
    kept: List[_State] = []
    open_, last = _Staircase(), _Staircase()
    ahead: Dict[int, _Staircase] = {}  # by the bytes prefetched
    for state in sorted(states, key=lambda s: (s[4], s[0], s[1], s[3], s[2])):  # every rival seen is as fast
        prefix, transient, prefetched, stage = state[:4]
        if open_.beats(prefix, transient):
            continue
        if stage == _OPEN:
            open_.add(prefix, transient)
        elif stage == _LAST:
            if last.beats(prefix, transient):
                continue
            last.add(prefix, transient)
        else:
            if any(rivals.beats(prefix, transient) for bytes_, rivals in ahead.items() if bytes_ <= prefetched):
                continue
            ahead.setdefault(prefetched, _Staircase()).add(prefix, transient)
        kept.append(state)
    return kept


class _Staircase:
    """Points (bytes kept, worst moment) none of which another beats, kept bytes rising and moments falling, so
    that whether a point added so far beats a new one is one binary search (the frontier runs to thousands)."""

    def __init__(self) -> None:
        self.prefixes: List[int] = []
        self.transients: List[int] = []

    def beats(self, prefix: int, transient: int) -> bool:
        """Whether a point added has both figures at most these."""
        i = bisect.bisect_right(self.prefixes, prefix)
        return i > 0 and self.transients[i - 1] <= transient

    def add(self, prefix: int, transient: int) -> None:
        """Add a point no point added beats; those it beats leave the staircase."""
        start = bisect.bisect_left(self.prefixes, prefix)
        end = start
        while end < len(self.transients) and self.transients[end] >= transient:
            end += 1
        self.prefixes[start:end] = [prefix]
        self.transients[start:end] = [transient]
