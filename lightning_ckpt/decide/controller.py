"""The auto-toggle: a pure state machine from activation readings to a policy of the escalation ladder.

Readings in, decisions out: no torch, no Lightning. The caller feeds one reading per optimizer step (already
reduced across ranks, so every rank decides the same) and applies the decision between optimizer steps.

Rules:

- **Up** one policy as soon as a reading crosses ``threshold`` (memory pressure cannot wait).
- **Down** one policy only after ``cooldown`` consecutive steps whose *predicted* reading one policy lower stays
  under the release level ``release × threshold``. The prediction scales the current reading by the ratio
  observed the last time the controller moved between those two policies; never having seen the lower one, it
  uses the current reading itself (conservative: a lower policy never uses less memory).
- Every switch starts a dwell of ``cooldown`` steps before the next *down* move, so an oscillating reading
  causes at most one down-switch per ``cooldown`` steps, and an up-switch cannot be followed by a down-switch
  sooner than that either.
- A policy that ran out of memory (:meth:`Controller.out_of_memory`, told by the escalation that moved the plan up)
  is marked with the first reading after the retry, on the policy the retry ran. The controller does not move down
  into it again until a reading predicts it at most ``release`` × what it was when it failed: the threshold says
  nothing about the device's capacity, so without the mark a calm run walked back into the same error every
  ``cooldown`` steps.
- Ratios are learnt only between neighbouring policies, from a reading before and after the controller's own move; an
  escalation drops the pending reading (its step was not the pair's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from lightning_ckpt.core.units import format_bytes, parse_size_or_fraction

__all__ = ["DEFAULT_LADDER", "Controller", "Decision", "resolve_threshold"]

DEFAULT_LADDER: Tuple[str, ...] = ("none", "every:2", "all")


def resolve_threshold(value: Union[int, float, str], capacity: Optional[int]) -> int:
    """Turn a size (``"18GiB"``, bytes) or a fraction of ``capacity`` (``0.8``) into bytes.

    Raises:
        TypeError: for ``bool`` and other non-size types.
        ValueError: for malformed, non-finite, non-positive or > 1 fractional values, or a fraction without a
            known capacity.
    """
    parsed = parse_size_or_fraction(value, name="auto_threshold")
    if isinstance(parsed, float):
        if capacity is None:
            raise ValueError(
                f"auto_threshold={value!r} is a fraction of device capacity, but the capacity is unknown (no "
                "CUDA device). Pass capacity='24GiB' (the card you plan for) or an absolute auto_threshold "
                "such as '18GiB'."
            )
        return int(parsed * capacity)
    return parsed


@dataclass(frozen=True)
class Decision:
    """What the controller chose after one reading."""

    level: int
    policy: str
    changed: bool
    reason: str


@dataclass
class Controller:
    """Threshold + hysteresis + cooldown over an escalation ladder of policy strings.

    Args:
        threshold: bytes; a reading above it moves one policy up.
        ladder: policy strings from cheapest (no recompute) to most memory-saving.
        release: fraction of ``threshold`` under which the predicted lower policy's reading must stay to move down.
        cooldown: consecutive qualifying steps needed to move down, and the dwell after any switch.
        level: the starting policy's position in the ladder.
    """

    threshold: int
    ladder: Sequence[str] = DEFAULT_LADDER
    release: float = 0.8
    cooldown: int = 20
    level: int = 0
    calm_steps: int = 0
    since_switch: int = 0
    switches: int = 0
    # reading observed at ladder position i just before/after a move between positions i and i+1: (lower, upper)
    pair_ratio: Dict[int, float] = field(default_factory=dict)
    # policy that ran out of memory -> (policy the retry ran, its first reading there); None until that reading comes
    oom_marks: Dict[int, Optional[Tuple[int, float]]] = field(default_factory=dict)
    _last: Optional[Tuple[int, float]] = None

    def __post_init__(self) -> None:
        self.ladder = tuple(self.ladder)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold <= 0:
            raise ValueError(f"threshold={self.threshold!r} must be a positive number of bytes.")
        if len(self.ladder) < 2:
            raise ValueError(f"ladder={list(self.ladder)!r} needs at least two policies, e.g. ['none', 'all'].")
        if not (isinstance(self.release, (int, float)) and 0 < self.release < 1) or isinstance(self.release, bool):
            raise ValueError(f"release={self.release!r} must be a fraction in (0, 1), e.g. 0.8.")
        if isinstance(self.cooldown, bool) or not isinstance(self.cooldown, int) or self.cooldown < 1:
            raise ValueError(f"cooldown={self.cooldown!r} must be an integer ≥ 1 (optimizer steps).")
        if not 0 <= self.level < len(self.ladder):
            raise ValueError(f"Pass a level from 0 to {len(self.ladder) - 1}: level={self.level!r} is not a position "
                             f"in the ladder {list(self.ladder)}.")

    @property
    def policy(self) -> str:
        return self.ladder[self.level]

    @property
    def release_bytes(self) -> int:
        return int(self.release * self.threshold)

    def observe(self, reading: float) -> Decision:
        """Feed one optimizer step's activation peak (bytes, max over ranks); get the policy's position to use next."""
        if not isinstance(reading, (int, float)) or isinstance(reading, bool) or math.isnan(reading) or reading < 0:
            raise ValueError(f"reading={reading!r} must be a non-negative number of bytes.")
        self._learn_ratio(reading)
        self._take_marks(reading)
        self.since_switch += 1
        if reading > self.threshold:
            self.calm_steps = 0
            if self.level + 1 < len(self.ladder):
                return self._move(+1, reading, f"activation peak {format_bytes(reading)} > threshold "
                                              f"{format_bytes(self.threshold)}")
            return self._stay(f"above the threshold with the ladder's last policy {self.policy!r}")
        predicted = self.predict_lower(reading)
        blocked = self._failed_below(reading)
        if predicted is not None and predicted < self.release_bytes and blocked is None:
            self.calm_steps += 1
        else:
            self.calm_steps = 0
        if blocked is not None:
            return self._stay(blocked)
        if self.calm_steps >= self.cooldown and self.since_switch >= self.cooldown:
            lighter = self.ladder[self.level - 1]
            return self._move(-1, reading, f"predicted {format_bytes(predicted)} under {lighter!r} stayed under the "
                                           f"release level {format_bytes(self.release_bytes)} for "
                                           f"{self.calm_steps} steps")
        return self._stay("within limits")

    def predict_lower(self, reading: float) -> Optional[float]:
        """Expected reading one policy lower (``None`` at the ladder's first policy)."""
        if self.level == 0:
            return None
        return reading * self.pair_ratio.get(self.level - 1, 1.0)

    def out_of_memory(self, failed: int) -> None:
        """The policy at ``failed`` ran out of memory and the plan was moved up (the caller set :attr:`level`): mark it
        with the next reading, and forget the pending reading of the last move (the step it would pair with is not)."""
        if not 0 <= failed < len(self.ladder):
            raise ValueError(f"Pass a level from 0 to {len(self.ladder) - 1}: failed={failed!r} is not a position in "
                             f"the ladder {list(self.ladder)}.")
        self.oom_marks[failed] = None
        self._last = None

    def _take_marks(self, reading: float) -> None:
        for failed, mark in self.oom_marks.items():
            if mark is None:
                self.oom_marks[failed] = (self.level, float(reading))

    def _at(self, reading: float, level: int, lower: int) -> float:
        """A reading at ``level`` as predicted at the lower policy ``lower`` (the learnt ratios; 1 where unknown)."""
        return reading * math.prod(self.pair_ratio.get(i, 1.0) for i in range(lower, level))

    def _failed_below(self, reading: float) -> Optional[str]:
        """Why the policy below may not be taken: it ran out of memory and this reading does not show the room, with
        the ``release`` margin, that the failed step lacked; ``None`` when it may."""
        below = self.level - 1
        mark = self.oom_marks.get(below)
        if below < 0 or below not in self.oom_marks:
            return None
        if mark is None:  # no reading since the failure yet: this one is the mark
            return f"policy {self.ladder[below]!r} ran out of memory; staying on {self.policy!r}"
        level, failed_reading = mark
        now, then = self._at(reading, self.level, below), self._at(failed_reading, level, below)
        if now < self.release * then:
            return None
        return (f"policy {self.ladder[below]!r} ran out of memory on a step that read {format_bytes(failed_reading)} "
                f"here; staying on {self.policy!r} until a step reads under {self.release:.0%} of that")

    def _learn_ratio(self, reading: float) -> None:
        if self._last is None:
            return
        old_level, old_reading = self._last
        self._last = None
        if reading <= 0 or old_reading <= 0 or abs(old_level - self.level) != 1:  # a pair of neighbours only
            return
        low, high = sorted((old_level, self.level))
        lower, upper = (old_reading, reading) if old_level < self.level else (reading, old_reading)
        self.pair_ratio[low] = max(1.0, lower / upper)  # a lower policy never needs less memory

    def _move(self, step: int, reading: float, reason: str) -> Decision:
        self._last = (self.level, reading)
        self.level += step
        self.calm_steps = 0
        self.since_switch = 0
        self.switches += 1
        before = self.ladder[self.level - step]
        return Decision(self.level, self.policy, True, f"{reason}: {before!r} -> {self.policy!r}")

    def _stay(self, reason: str) -> Decision:
        return Decision(self.level, self.policy, False, reason)

    def state_dict(self) -> Dict[str, object]:
        """Primitives only (``torch.load(weights_only=True)`` safe)."""
        return {
            "level": self.level,
            "ladder": list(self.ladder),
            "threshold": self.threshold,
            "calm_steps": self.calm_steps,
            "since_switch": self.since_switch,
            "switches": self.switches,
            "pair_ratio": {str(k): float(v) for k, v in self.pair_ratio.items()},
            "pending": None if self._last is None else [self._last[0], float(self._last[1])],
            "out_of_memory": {str(k): None if v is None else [v[0], float(v[1])] for k, v in self.oom_marks.items()},
        }

    def load_state_dict(self, state: Dict[str, object]) -> List[str]:
        """Restore progress; returns warnings (e.g. a different ladder) for the caller to surface."""
        notes = []
        if list(state.get("ladder", [])) != list(self.ladder):
            notes.append(f"saved ladder {state.get('ladder')} differs from the configured {list(self.ladder)}; "
                         "starting from the saved position in the configured ladder where it exists")
        level = int(state.get("level", 0))
        self.level = min(max(level, 0), len(self.ladder) - 1)
        self.calm_steps = int(state.get("calm_steps", 0))
        self.since_switch = int(state.get("since_switch", 0))
        self.switches = int(state.get("switches", 0))
        self.pair_ratio = {int(k): float(v) for k, v in dict(state.get("pair_ratio", {})).items()}
        if notes:  # positions in another ladder: its pending reading and marks say nothing of this one's
            return notes
        pending = state.get("pending")
        self._last = None if pending is None else (int(pending[0]), float(pending[1]))
        self.oom_marks = {int(k): None if v is None else (int(v[0]), float(v[1]))
                          for k, v in dict(state.get("out_of_memory", {})).items()}
        return notes
