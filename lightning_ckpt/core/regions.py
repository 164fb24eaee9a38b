"""``group:K`` regions: consecutive blocks replayed in backward as one checkpointed region.

A region is replayed as its blocks back to back, from the random-number state it had when its first block was
called. That equals the forward only when nothing of the parent's that the replay skips changed what the blocks
see, so the blocks of one forward pass join a region only while they are *provably* back to back, checked when each
block is called:

- blocks called in the region's order, each pass (a stack looped twice, two forwards before one backward, a block
  reused) replaying its own record of the calls;
- no random numbers drawn by the parent since the previous block returned (dropout after each block, Hugging
  Face's LayerDrop): the CPU generator and the generators the region restores are compared;
- the previous block's outputs not changed in place by the parent (their version counters), and recognised by
  identity while a reference is held (``id()`` alone is recycled by Python);
- autocast as it was when the region opened (the replay runs all its blocks under that state);
- the saved-tensor hooks as they were: between two blocks the region's own hooks are taken off, so the parent's
  saves go through the user's hooks (``save_on_cpu``) exactly as without checkpointing.

When a check fails the region is closed before that block, which starts a new region of the remaining blocks:
the gradients stay those of the plain model, the memory saved is less, and one warning per plan says why.
Tensors a later block receives that are not the previous block's outputs are kept as they were; one changed in place
before backward is refused when the region is replayed, as PyTorch refuses a modified saved tensor.

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
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ckpt.core.positional import keywords_as_positional
from lightning_ckpt.core.replay import notify_replay, replay_hooks_active

__all__ = ["GroupRegion"]

_hooks = torch._C._autograd


class _FromPrevious:
    """Placeholder for an input that is output leaf ``i`` of the previous block in the region."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


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


def _rng_devices(args, kwargs) -> Tuple[str, List[int]]:
    """The device type and devices whose generators the frame restores (those of the first block's tensors, as
    ``checkpoint`` infers them; read here without calling it, so each frame is inferred once)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    accelerated = [t for t in tensors if t.device.type not in ("cpu", "meta")]
    if not accelerated:
        return "cpu", []
    device_type = accelerated[0].device.type
    module = _cp._get_device_module(device_type)
    if not getattr(module, "_initialized", False):
        return device_type, []
    return device_type, sorted({t.get_device() for t in accelerated if t.device.type == device_type})


def _rng_snapshot(device_type: str, devices: List[int]) -> List[bytes]:
    """The generators' states as bytes: compared without dispatching an op (a fake-tensor trace or the user's
    dispatch mode around the forward must not see, or refuse, the comparison)."""
    with _disable_current_modes():  # the real generators' states, never a fake tensor
        states = [torch.get_rng_state()]
        if devices:
            module = _cp._get_device_module(device_type)
            states.extend(module.get_rng_state(d) for d in devices)
        return [state.numpy().tobytes() for state in states]


def _autocast_state(device_type: str) -> Tuple[Any, ...]:
    """What the frame's replay restores of autocast: enabled and dtype, on the CPU and the region's device type."""
    types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
    return tuple((torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types
                 if torch.amp.is_autocast_available(t))


def _same_hooks(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] is b[1]


class _Span:
    """The replay owner of part of a region (a region split by the parent's work); ``members`` as on the region."""

    def __init__(self, members: List[Any]) -> None:
        self.members = members


class _Pass:
    """One run of consecutive blocks of a region under one checkpoint frame, with its own record of the calls.

    Between two blocks (the *gap*) the frame's saved-tensor hooks are off the stack, and what the next block must
    find unchanged is held: the previous outputs with their versions and the random-number state.
    """

    def __init__(self, region: "GroupRegion", start: int, args, kwargs) -> None:
        self.region = region
        self.start = start
        self.next = start
        first = region.members[start]
        self.options = first.shared.options
        self.records: List[Tuple[Any, Any, Any]] = [(first, None, None)]
        self.held: List[Tuple[torch.Tensor, int]] = []  # inputs kept as they were, with their versions
        self.prev: Dict[int, Tuple[int, torch.Tensor, int]] = {}  # id -> (leaf index, tensor, version)
        self.rng: Optional[List[bytes]] = None
        self.devices = _rng_devices(args, kwargs)
        self.autocast = _autocast_state(self.devices[0])
        self.frame_hooks = None
        self.gap_hooks = None
        self.in_gap = False
        below = _hooks._top_saved_tensors_default_hooks(False)
        self.gen = _frame_generator(self.replay, args, kwargs, self.options)
        next(self.gen)
        top = _hooks._top_saved_tensors_default_hooks(False)
        self.frame_hooks = None if _same_hooks(top, below) else top

    # -- forward
    def step(self, member: Any, args, kwargs):
        """Run ``member`` inside the frame; after it, open the gap (or finish after the region's last block)."""
        try:
            out = member.run(*args, **kwargs)
        except BaseException as err:
            self.abort(err)
            raise
        self.next += 1
        if self.next == len(self.region.members):
            self.finish()
            return out
        self._open_gap(out)
        return out

    def _open_gap(self, out) -> None:
        leaves, _ = tree_flatten(out)
        self.prev = {id(t): (i, t, t._version) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
        if self.options.preserve_rng_state:
            self.rng = _rng_snapshot(*self.devices)
        top = _hooks._top_saved_tensors_default_hooks(False)
        if self.frame_hooks is not None:
            if not _same_hooks(top, self.frame_hooks):  # the block left hooks of its own behind: stop here
                self.finish()
                return
            _hooks._pop_saved_tensors_default_hooks()  # the parent's own saves go where they would go unwrapped
        self.gap_hooks = _hooks._top_saved_tensors_default_hooks(False)
        self.in_gap = True

    def why_not(self, member: Any) -> Optional[str]:
        """Why ``member`` cannot join this pass now (``None`` when it can)."""
        if member is not self.region.members[self.next]:
            return "its blocks were not called back to back in order"
        if not _same_hooks(_hooks._top_saved_tensors_default_hooks(False), self.gap_hooks):
            return "the saved-tensor hooks changed between its blocks"
        if _autocast_state(self.devices[0]) != self.autocast:
            return "autocast is switched between its blocks"
        if self.rng is not None:
            now = _rng_snapshot(*self.devices)
            if now != self.rng:
                return "the model draws random numbers between its blocks (dropout or LayerDrop outside the blocks)"
        if any(t._version != v for _, t, v in self.prev.values()):
            return "the model changes a block's output in place between its blocks"
        return None

    def join(self, member: Any, args, kwargs):
        """Close the gap and run ``member`` as the next block of this pass."""
        self._close_gap()
        self.records.append((member, self._template(args), self._template(kwargs)))
        self.prev = {}
        return self.step(member, args, kwargs)

    def _template(self, tree):
        def mark(x):
            if not isinstance(x, torch.Tensor):
                return x
            entry = self.prev.get(id(x))
            if entry is not None and entry[1] is x:
                return _FromPrevious(entry[0])
            self.held.append((x, x._version))
            return x

        return tree_map(mark, tree)

    def _close_gap(self) -> None:
        if self.in_gap and self.frame_hooks is not None:
            _hooks._push_saved_tensors_default_hooks(*self.frame_hooks)
        self.in_gap = False
        self.rng = None

    def finish(self) -> None:
        """Close the frame: the recorded blocks are replayed together in backward."""
        self._close_gap()
        self.prev = {}
        gen, self.gen = self.gen, None
        if self.region.open is self:
            self.region.open = None
        try:
            next(gen)
        except StopIteration:
            pass

    def abort(self, err: BaseException) -> None:
        self._close_gap()
        gen, self.gen = self.gen, None
        if self.region.open is self:
            self.region.open = None
        try:
            gen.throw(err)
        except BaseException:
            pass

    # -- backward
    def replay(self, *first_args, **first_kwargs):
        if any(tensor._version != version for tensor, version in self.held):
            names = [m.name for m, _, _ in self.records]
            # PyTorch refuses a saved tensor changed in place the same way; replaying from it would be silently wrong
            raise RuntimeError(
                "lightning_ckpt: do not change a tensor in place after passing it to a block (or use 'all' instead "
                f"of 'group:K'): an input of blocks {names[0]}…{names[-1]} was changed before backward, so they "
                "cannot be replayed.")
        owner = self.region.span(self.start, self.start + len(self.records))
        if replay_hooks_active():
            return notify_replay(owner, self._replay_members, first_args, first_kwargs)
        return self._replay_members(*first_args, **first_kwargs)

    def _replay_members(self, *first_args, **first_kwargs):
        out = self.records[0][0].run(*first_args, **first_kwargs)
        for member, args, kwargs in self.records[1:]:
            leaves, _ = tree_flatten(out)
            fill = lambda x, leaves=leaves: leaves[x.i] if isinstance(x, _FromPrevious) else x  # noqa: E731
            out = member.run(*tree_map(fill, args), **tree_map(fill, kwargs))


class GroupRegion:
    """Consecutive blocks replayed as one checkpointed region (``group:K``); see the module docstring."""

    def __init__(self, members: List[Any], anchor: nn.Module) -> None:
        self.members = members
        self.anchor = anchor  # closest called ancestor; its forward hook closes a region left open
        self.open: Optional[_Pass] = None
        self._spans: Dict[Tuple[int, int], Any] = {}
        anchor.register_forward_hook(self._close_if_open, always_call=True)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(open=None, _spans={})
        return state

    def __setstate__(self, state) -> None:
        # a region pickled by an older version carries its forward state in other attributes: start afresh
        self.members, self.anchor = state["members"], state["anchor"]
        self.open, self._spans = None, {}

    def span(self, start: int, stop: int) -> Any:
        """The replay owner of members ``start:stop``: the region itself when whole, else a stable part."""
        if (start, stop) == (0, len(self.members)):
            return self
        if (start, stop) not in self._spans:
            self._spans[(start, stop)] = _Span(self.members[start:stop])
        return self._spans[(start, stop)]

    def call(self, member: Any, args, kwargs):
        current = self.open
        if current is not None:
            reason = current.why_not(member)
            if reason is None:
                return current.join(member, args, kwargs)
            self._close(reason)
        start = self.members.index(member)
        if start == len(self.members) - 1:  # a region of one block is that block checkpointed alone
            fn, inputs = keywords_as_positional(member.run, args, kwargs)
            return _cp.checkpoint(fn, *inputs, **member.shared.checkpoint_kwargs("recompute"))
        self.open = _Pass(self, start, args, kwargs)
        return self.open.step(member, args, kwargs)

    def _close(self, reason: Optional[str]) -> None:
        current = self.open
        if current is None:
            return
        if reason is not None:
            self._warn(reason)
        current.finish()

    def _warn(self, reason: str) -> None:
        warned = self.members[0].shared.group_warnings
        if reason in warned:
            return
        warned.add(reason)
        from lightning_ckpt.core.wrap import _user_stacklevel  # wrap imports this module

        names = [m.name for m in self.members]
        warnings.warn(
            f"lightning_ckpt: use 'all' or 'every:N' instead of 'group:K' for this model: in group region "
            f"{names[0]}…{names[-1]} {reason}, so it was checkpointed in smaller regions (the gradients are "
            "unchanged; less memory is saved).",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )

    def _close_if_open(self, module, args, output):
        self._close("the region was left open: the forward returned before its last block")

    def detach(self) -> None:
        self._close(None)
        always = getattr(self.anchor, "_forward_hooks_always_called", {})
        for key in [k for k, h in self.anchor._forward_hooks.items() if getattr(h, "__self__", None) is self]:
            del self.anchor._forward_hooks[key]
            always.pop(key, None)


# A region spans several calls of the parent's forward, which torch.compile cannot trace as one graph: under
# compile the region and its blocks run eagerly (dynamo breaks the graph at each block call of the region).
GroupRegion.call = torch._dynamo.disable(GroupRegion.call)
