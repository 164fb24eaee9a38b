"""``group:K`` regions: consecutive blocks replayed in backward as one checkpointed region.

The region opens when its first block is called and closes after its last block returns; in backward the blocks
are replayed back to back. Block inputs that are exactly the previous block's outputs are recomputed; every other
input (masks, position tensors, or a hidden state the parent changed between blocks) is kept as it was. Tensors
saved by the parent's own code between two blocks are stored normally, outside the region.

Lightning's torch private API: a non-reentrant checkpoint frame is opened around code we do not call ourselves
(``_checkpoint_without_reentrant_generator``), so the region spans several ``Module.__call__`` of the parent.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint as _cp
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ckpt.core.positional import keywords_as_positional
from lightning_ckpt.core.replay import notify_replay, replay_hooks_active

__all__ = ["GroupRegion"]


class _FromPrevious:
    """Placeholder for an input that is output leaf ``i`` of the previous block in the region."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _PassThrough(torch.autograd.graph.saved_tensors_hooks):
    """Saves tensors normally; pushed between two blocks so the parent's own saves escape the region."""

    def __init__(self) -> None:
        super().__init__(_identity, _identity)


def _identity(x):
    return x


def _frame_generator(fn, args, kwargs, options: Any):
    """Open a non-reentrant checkpoint frame around code we do not call ourselves (torch private API).

    The keyword values are passed positionally: the frame saves the RNG state of the devices of its positional
    tensors only (:mod:`lightning_ckpt.core.positional`)."""
    fn, args = keywords_as_positional(fn, args, kwargs)
    kwargs = {}
    impl = getattr(_cp, "_checkpoint_without_reentrant_generator_impl", None)
    config = dict(
        preserve_rng_state=options.preserve_rng_state,
        context_fn=_cp.noop_context_fn,
        determinism_check=options.determinism_check,
        debug=options.debug,
    )
    if impl is not None:
        return impl(fn, args, kwargs, **config)
    legacy = _cp._checkpoint_without_reentrant_generator
    positional = [fn, *config.values()]
    if "early_stop" in inspect.signature(legacy).parameters:
        positional.append(True)
    return legacy(*positional, *args, **kwargs)


class GroupRegion:
    """Consecutive blocks replayed as one checkpointed region (``group:K``)."""

    def __init__(self, members: List[Any], anchor: nn.Module) -> None:
        self.members = members
        self.anchor = anchor  # closest called ancestor; its forward hook closes a region left open
        self._reset()
        anchor.register_forward_hook(self._close_if_open, always_call=True)

    def _reset(self) -> None:
        self.gen = None
        self.records: List[Tuple[Any, Any, Any]] = []
        self.next = 0
        self.prev_leaves: Dict[int, int] = {}
        self.between: Optional[_PassThrough] = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(gen=None, records=[], next=0, prev_leaves={}, between=None)
        return state

    def call(self, member: Any, args, kwargs):
        if member is self.members[0]:
            self._close(warn=self.gen is not None)
            return self._open(member, args, kwargs)
        if self.gen is None or member is not self.members[self.next]:
            self._close(warn=self.gen is not None)
            fn, inputs = keywords_as_positional(member.run, args, kwargs)
            return _cp.checkpoint(fn, *inputs, **member.shared.checkpoint_kwargs("recompute"))
        self.between.__exit__(None, None, None)
        self.between = None
        self.records.append((member, *self._template(args, kwargs)))
        return self._step(member, args, kwargs)

    def _open(self, first: Any, args, kwargs):
        self.records = [(first, None, None)]
        self.gen = _frame_generator(self._replay, args, kwargs, first.shared.options)
        next(self.gen)
        self.next = 0
        return self._step(first, args, kwargs)

    def _step(self, member: Any, args, kwargs):
        try:
            out = member.run(*args, **kwargs)
        except BaseException as err:
            self._abort(err)
            raise
        self.next += 1
        if self.next == len(self.members):
            self._finish()
        else:
            leaves, _ = tree_flatten(out)
            self.prev_leaves = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
            self.between = _PassThrough()
            self.between.__enter__()
        return out

    def _template(self, args, kwargs):
        def mark(x):
            i = self.prev_leaves.get(id(x)) if isinstance(x, torch.Tensor) else None
            return x if i is None else _FromPrevious(i)

        return tree_map(mark, args), tree_map(mark, kwargs)

    def _replay(self, *first_args, **first_kwargs):
        if replay_hooks_active():
            return notify_replay(self, self._replay_members, first_args, first_kwargs)
        return self._replay_members(*first_args, **first_kwargs)

    def _replay_members(self, *first_args, **first_kwargs):
        out = self.records[0][0].run(*first_args, **first_kwargs)
        for member, args, kwargs in self.records[1:]:
            leaves, _ = tree_flatten(out)
            fill = lambda x, leaves=leaves: leaves[x.i] if isinstance(x, _FromPrevious) else x  # noqa: E731
            out = member.run(*tree_map(fill, args), **tree_map(fill, kwargs))

    def _finish(self) -> None:
        gen, records = self.gen, self.records
        self._reset()
        self.records = records  # the replay closure reads them in backward
        try:
            next(gen)
        except StopIteration:
            pass

    def _abort(self, err: BaseException) -> None:
        if self.between is not None:
            self.between.__exit__(None, None, None)
        gen = self.gen
        self._reset()
        if gen is not None:
            try:
                gen.throw(err)
            except BaseException:
                pass

    def _close(self, warn: bool) -> None:
        if self.gen is None:
            return
        if warn:
            names = [m.name for m in self.members]
            warnings.warn(
                f"lightning_ckpt: group region {names[0]}…{names[-1]} was left open: its blocks were not "
                f"called back to back in order ({len(self.members)} expected, {self.next} seen). The region "
                "was closed early; if this repeats, use 'all' or 'every:N' instead of 'group:K'.",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.between is not None:
            self.between.__exit__(None, None, None)
            self.between = None
        self._finish()

    def _close_if_open(self, module, args, output):
        self._close(warn=True)

    def detach(self) -> None:
        self._close(warn=False)
        for hooks in (self.anchor._forward_hooks, getattr(self.anchor, "_forward_hooks_always_called", {})):
            for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is self]:
                del hooks[key]





# A region spans several calls of the parent's forward, which torch.compile cannot trace as one graph: under
# compile the region and its blocks run eagerly (dynamo breaks the graph at each block call of the region).
GroupRegion.call = torch._dynamo.disable(GroupRegion.call)
