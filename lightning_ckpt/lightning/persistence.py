"""What a checkpoint keeps of the run, and how a resumed run gets it back: :class:`SavedRun`.

The callback's ``state_dict`` (and so every Lightning checkpoint) holds primitives only: the state's ``version``, the
``policy`` as the user configured it (a budget's own string, not the plan it runs), the plan in force
(``plan_policy``, the blocks' ``names`` and ``modes``) and each feature's own state under its
:attr:`~lightning_ckpt.lightning.feature.Feature.state_key` (the auto-toggle's ``controller``, a budget's
``budget``: its calibration and plans per shape, so a resumed fit does not calibrate again).

A checkpoint is restored when Lightning hands it over: at once if this run already applied its plan (a strategy that
restores after its set-up: FSDP, ``ModelParallelStrategy``, DeepSpeed, where that comes after fit start), else when
the plan is applied. The auto-toggle's state (a rung of its ladder) is restored before the saved plan, which it would
move; a budget's (measured on these blocks) only onto the same blocks, after the plan: into this fit's budget when it
is made already, else it waits for fit start (:meth:`SavedRun.take`). A checkpoint trained with another policy leaves
the configured plan in place, with a warning that says how to resume it; one for other blocks keeps the configured
plan (the auto-toggle's rung, restored before, still moves it).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

from lightning_ckpt.lightning.autotoggle import AutoToggle
from lightning_ckpt.lightning.budgeting import BudgetFeature
from lightning_ckpt.lightning.feature import Feature
from lightning_ckpt.lightning.port import PlanPort

__all__ = ["STATE_VERSION", "SavedRun"]

STATE_VERSION = 1
_PLAN_KEYS = frozenset({"version", "policy", "plan_policy", "names", "modes"})
_RUNG_STATES = (AutoToggle.state_key,)  # a rung of a ladder: restored before the saved plan, which it moves
_BLOCK_STATES = (BudgetFeature.state_key,)  # measured on these blocks: restored after the plan, onto the same blocks


class SavedRun:
    """The run's part of a checkpoint (see the module docstring).

    Args:
        port: what it reaches of the run.
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self.applied = False  # this run applied its plan: a checkpoint is restored at once
        self._pending: Optional[Dict[str, Any]] = None  # restored state waiting for the plan to exist
        self._waiting: Dict[str, Any] = {}  # a budget's saved state waiting for the budget (made at fit start)
        self._made: List[Feature] = []  # this run's features (a feature of an earlier fit takes no state)

    @property
    def configured_spec(self) -> str:
        """The policy as the user configured it: a budget's own string, not the plan it starts from."""
        s = self.port.settings
        return s.budget.spec if s.budget is not None else s.start.spec

    def run_starts(self) -> None:
        """A new run (``fit``, ``validate``…): nothing of it applied or restored yet (a budget's state a checkpoint
        left waits on, for the next fit with a budget)."""
        self.applied, self._pending, self._made = False, None, []

    def plan_applied(self, features: Sequence[Feature]) -> None:
        """The run's plan was applied (``features``: those made with it): a checkpoint restored earlier applies now."""
        self.applied, self._made = True, list(features)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)

    def made(self, feature: Feature) -> None:
        """A feature made at fit start: the saved state waiting for it goes in now (none: it starts afresh), and a
        checkpoint restored after it (a strategy that restores after its set-up) goes into it."""
        waiting = self._waiting.pop(feature.state_key, None)
        if waiting is not None:
            feature.load_state_dict(waiting)
        self._made.append(feature)

    def state_dict(self, features: Sequence[Feature]) -> Dict[str, Any]:
        """Primitives only: ``version``, configured ``policy``, the plan's ``plan_policy``/``names``/``modes``, and
        each feature's state under its key."""
        plan = self.port.plan
        if plan is None:
            if self._pending is not None:  # restored but not applied yet: keep what the user had
                return dict(self._pending)
            return {"version": STATE_VERSION, "policy": self.configured_spec}
        saved = plan.state_dict()
        state = {"version": STATE_VERSION, "policy": self.configured_spec, "plan_policy": saved["policy"],
                 "names": list(saved["names"]), "modes": list(saved["modes"])}
        for feature in features:
            if feature.state_key is not None:
                state[feature.state_key] = feature.state_dict()
        for key, waiting in self._waiting.items():  # a resumed run goes on without calibrating again
            if waiting is not None:
                state.setdefault(key, waiting)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a saved run: at once if this run already applied its plan (the strategy restores after setup),
        else when this run applies the plan (a plan left by an earlier run would be re-targeted there)."""
        state = _check_state(state)
        if state is None:
            return
        if self.applied:
            self._restore(state)
        else:
            self._pending = state

    def _restore(self, state: Dict[str, Any]) -> None:
        port, start = self.port, self.port.settings.start
        saved = state.get("policy")
        if saved not in (self.configured_spec, start.spec):  # older checkpoints of a budget: its start
            warnings.warn(
                f"lightning_ckpt: the checkpoint was trained with policy {saved!r} but {port.owner}(policy="
                f"{start.spec!r}) is configured with {self.configured_spec!r}; the configured policy wins. To resume "
                f"with the saved plan, pass policy={saved!r}.", UserWarning, stacklevel=4)
            port.change_plan(start)
            return
        made = {feature.state_key: feature for feature in self._made if feature.state_key is not None}
        for key in _RUNG_STATES:  # the auto-toggle's rung is the plan from now on
            if key in made and state.get(key) is not None:
                made[key].load_state_dict(state[key])
        if "plan_policy" not in state:
            return
        names = list(port.plan.names)
        if list(state.get("names", [])) != names:
            warnings.warn(
                f"lightning_ckpt: the checkpoint's plan covers blocks {state.get('names')}, this model has "
                f"{names}; keeping the configured policy {start.spec!r}.", UserWarning, stacklevel=4)
            return
        port.restore_plan({"version": 1, "policy": state["plan_policy"], "names": state.get("names", []),
                           "modes": state.get("modes", [])})
        for key in _BLOCK_STATES:  # a budget's calibration: into this fit's budget, or at its fit start
            if key in made and state.get(key) is not None:
                made[key].load_state_dict(state[key])
            elif key not in made:
                self._waiting[key] = state.get(key)


def _check_state(state: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(state, dict) or not isinstance(state.get("policy"), str):
        warnings.warn(f"lightning_ckpt: ignoring unreadable saved state {state!r}; using the configured policy.",
                      UserWarning, stacklevel=4)
        return None
    if state.get("version") != STATE_VERSION:
        warnings.warn(f"lightning_ckpt: saved state version {state.get('version')!r} is not {STATE_VERSION}; "
                      "loading what is compatible.", UserWarning, stacklevel=4)
    unknown = sorted(set(state) - _PLAN_KEYS - {*_RUNG_STATES, *_BLOCK_STATES})
    if unknown:
        warnings.warn(f"lightning_ckpt: ignoring unknown keys {unknown} in saved state.", UserWarning, stacklevel=4)
    return state
