"""The two places where Lightning has no hook and the engine puts one on the strategy instance.

- right before ``strategy.setup(trainer)``: the only moment after ``configure_model`` (and the checkpoint restore)
  and before the strategy wraps the model in DDP/FSDP — where the plan is applied;
- around ``strategy.optimizer_step(optimizer, closure, ...)``: Lightning runs forward and backward inside the
  closure, so an out-of-memory error of the step is caught there and retried or diagnosed.

Both are instance attributes that shadow the class method, removed at teardown (or when a run fails early), so
the strategy is left exactly as it was. Installing again replaces a shim, never stacks one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = [
    "install_optimizer_step_guard",
    "remove_before_strategy_setup",
    "remove_optimizer_step_guard",
    "run_before_strategy_setup",
]

_SETUP_FLAG = "_lightning_ckpt_pre_setup"
_STEP_FLAG = "_lightning_ckpt_oom_guard"


def run_before_strategy_setup(strategy: Any, fn: Callable[[Any], None]) -> None:
    """Call ``fn(trainer)`` once, right before ``strategy.setup(trainer)``, then restore ``strategy.setup``."""
    remove_before_strategy_setup(strategy)  # a shim left by a run that failed early is replaced, not stacked
    current = strategy.__dict__.get("setup")
    original = strategy.setup

    @functools.wraps(original)
    def setup(trainer: Any) -> Any:
        remove_before_strategy_setup(strategy)
        fn(trainer)
        return original(trainer)

    setattr(setup, _SETUP_FLAG, True)
    setup._lightning_ckpt_prior = current  # type: ignore[attr-defined]
    strategy.setup = setup


def remove_before_strategy_setup(strategy: Any) -> None:
    """Undo :func:`run_before_strategy_setup` if it has not fired (e.g. the run failed before setup)."""
    current = strategy.__dict__.get("setup")
    if not getattr(current, _SETUP_FLAG, False):
        return
    prior = current._lightning_ckpt_prior
    if prior is None:
        del strategy.setup
    else:
        strategy.setup = prior


def install_optimizer_step_guard(strategy: Any, guard: Callable[..., Any]) -> None:
    """Route ``strategy.optimizer_step(optimizer, closure, ...)`` through ``guard(original, optimizer, closure,
    ...)`` until :func:`remove_optimizer_step_guard`."""
    remove_optimizer_step_guard(strategy)
    original = strategy.optimizer_step

    def optimizer_step(optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        return guard(original, optimizer, closure, *args, **kwargs)

    setattr(optimizer_step, _STEP_FLAG, True)
    strategy.optimizer_step = optimizer_step


def remove_optimizer_step_guard(strategy: Any) -> None:
    if getattr(strategy.__dict__.get("optimizer_step"), _STEP_FLAG, False):
        del strategy.optimizer_step
