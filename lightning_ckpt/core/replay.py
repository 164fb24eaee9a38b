"""Observe the backward replays of checkpointed regions: a small registry of hooks, empty by default.

The activation meter (:mod:`lightning_ckpt.measure.meter`) measures the transient interior of a block while it
is replayed in backward through :func:`register_replay_hook`; the Lightning edge names the block whose replay
failed. Without a registered hook nothing extra runs on the hot path.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["notify_replay", "observed", "register_replay_hook", "replay_hooks_active"]

_REPLAY_HOOKS: List[Callable[..., Any]] = []


class _ReplayHookHandle:
    """Returned by :func:`register_replay_hook`; ``remove()`` unregisters the hook (idempotent)."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def remove(self) -> None:
        for i in range(len(_REPLAY_HOOKS) - 1, -1, -1):
            if _REPLAY_HOOKS[i] is self.hook:
                del _REPLAY_HOOKS[i]
                return

    def __enter__(self) -> "_ReplayHookHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def register_replay_hook(hook: Callable[..., Any]) -> _ReplayHookHandle:
    """Observe every backward replay of a checkpointed region (all plans, all models).

    ``hook(owner, fn, args, kwargs)`` is called instead of ``fn(*args, **kwargs)`` each time a region is
    recomputed in backward, and must call ``fn(*args, **kwargs)`` exactly once and return its result (it may
    do work before and after, e.g. push a ``TorchDispatchMode``). ``owner`` is the block's forward object
    (attributes ``index``, ``name``, ``mode``, ``block``, ``shared``) for a block that is its own region, or the
    group region (attribute ``members``: the forward objects of its blocks, in order) for ``group:K``. The
    first, forward execution of a region is not reported. Only regions entered while at least one hook is
    registered are observed. Hooks registered later wrap earlier ones.

    Returns:
        A handle whose ``remove()`` unregisters the hook.
    """
    if not callable(hook):
        raise TypeError(f"register_replay_hook: hook={hook!r} is not callable; pass a function "
                        "hook(owner, fn, args, kwargs) that calls fn(*args, **kwargs) and returns its result.")
    _REPLAY_HOOKS.append(hook)
    return _ReplayHookHandle(hook)


def notify_replay(owner: Any, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    for hook in _REPLAY_HOOKS[:-1]:
        fn = functools.partial(_call_hook, hook, owner, fn)
    return _REPLAY_HOOKS[-1](owner, fn, args, kwargs) if _REPLAY_HOOKS else fn(*args, **kwargs)


def _call_hook(hook, owner, fn, *args, **kwargs):
    return hook(owner, fn, args, kwargs)


def observed(owner: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` as handed to ``checkpoint``: the first call is the forward, every later call a replay."""
    calls = 0

    def body(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1 or not _REPLAY_HOOKS:
            return run(*args, **kwargs)
        return notify_replay(owner, run, args, kwargs)

    return body




def replay_hooks_active() -> bool:
    """Whether any replay hook is registered (regions entered now will be observed)."""
    return bool(_REPLAY_HOOKS)
