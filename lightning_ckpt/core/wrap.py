"""Checkpoint blocks in place: non-reentrant, RNG-preserving, switchable per block without re-wrapping.

Each selected block gets an instance attribute ``forward`` (a :class:`_BlockForward`) that decides at every
call whether to run the plain forward or a checkpointed one. Nothing is re-parented, so ``state_dict()`` keys,
``named_parameters()``, ``named_modules()`` and ``named_buffers()`` never change (unlike
``torch.distributed...checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module.``). The block's own
forward hooks run once per call; only the body of ``forward`` is replayed.

Modes (per block, changeable at any time through :class:`CheckpointPlan`):

- ``off``: the plain forward.
- ``recompute``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
- ``selective``: the same with ``create_selective_checkpoint_contexts`` keeping the outputs of the policy's
  save list (matmuls and attention by default) and recomputing the rest; a call that draws random numbers is never
  kept (attention with ``dropout_p > 0`` is recomputed).
- ``offload``: no recompute; the saved activations move to (pinned) host memory on a side stream and come back
  in backward, parameters and their views staying on the device (:mod:`lightning_ckpt.core.offload`). Tensors
  already on the CPU stay where they are, so on a CPU-only machine this mode is a no-op.
- ``compiler:<fraction>``: no checkpoint; under ``torch.compile`` the block's forward is annotated with
  ``torch.autograd.graph.region_activation_memory_budget(fraction)`` and the compiler's partitioner chooses what the
  block's graph keeps and recomputes. PyTorch applies one budget per compiled graph, covering all of it, so the
  block must be its own graph (``block.compile()``); run eagerly (or with ``force_eager``) it is ``off``.

``group:K`` policies make K consecutive ``recompute`` blocks of one stack one region, split at run time where the
parent does work between them that the replay would skip (:mod:`lightning_ckpt.core.regions`).

Recompute happens only while the block is training and grad is enabled: ``eval()``, ``torch.no_grad()`` and
``torch.inference_mode()`` always take the plain forward.

Replays can be observed with :func:`lightning_ckpt.core.replay.register_replay_hook` (the activation meter
measures the transient interior of a block while it is replayed in backward this way). Without a registered hook
nothing extra runs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as _cp
from torch import nn

from lightning_ckpt.core import offload
from lightning_ckpt.core.blocks import BlockSelector, describe_blocks, find_blocks
from lightning_ckpt.core.policy import (
    COMPILER_MODE,
    MODES,
    GroupPolicy,
    Layout,
    ModesPolicy,
    Policy,
    parse_policy,
)
from lightning_ckpt.core.positional import keywords_as_positional
from lightning_ckpt.core.regions import GroupRegion
from lightning_ckpt.core.replay import observed, replay_hooks_active

__all__ = [
    "MODES",
    "CheckpointOptions",
    "CheckpointPlan",
    "ForeignCheckpointingError",
    "apply_policy",
    "get_plan",
    "remove_checkpointing",
    "validate_options",
]

_PLAN_ATTR = "_lightning_ckpt_plan"
_DETERMINISM_CHECKS = ("default", "none")
_STATE_VERSION = 1


class ForeignCheckpointingError(ValueError):
    """The model already holds activation checkpointing applied by another library."""


@dataclass(frozen=True)
class CheckpointOptions:
    """The ``torch.utils.checkpoint`` options every region of a plan uses (validated by
    :func:`validate_options`)."""

    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False


class _Shared:
    """State every block of one plan reads on the hot path: checkpoint options and the SAC policy.

    Attributes:
        save_ops: the ``torch.ops.aten`` op packets of the save list.
        sac_policy: the selective-checkpoint policy function over every overload of those ops (see
            :func:`_keep_unless_random`).
    """

    def __init__(self, options: CheckpointOptions) -> None:
        self.options = options
        self.group_warnings: set = set()  # reasons a group region was split, each warned once per plan
        self.set_save_ops(())

    def __getstate__(self) -> Dict[str, Any]:
        # op overloads do not pickle: the save list travels by name and is resolved again on load
        state = {k: v for k, v in self.__dict__.items() if k not in ("save_ops", "sac_policy", "_selective")}
        state["save_op_names"] = self.save_op_names
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        names = state.pop("save_op_names", ())
        self.__dict__.update(state)
        self.__dict__.setdefault("group_warnings", set())  # pickled by an older version
        self.set_save_ops(names)

    def set_save_ops(self, names: Sequence[str]) -> None:
        self.save_op_names = tuple(names)
        packets = [getattr(torch.ops.aten, n) for n in names]
        self.save_ops = frozenset(packets)
        self.sac_policy = functools.partial(_keep_unless_random, _keep_table(packets))
        # a functools.partial over constants (a module function, a dict of op overloads) all the way down:
        # torch.compile traces that, not a bound method
        self._selective = functools.partial(_cp.create_selective_checkpoint_contexts, self.sac_policy)

    def checkpoint_kwargs(self, mode: str) -> Dict[str, Any]:
        o = self.options
        kwargs: Dict[str, Any] = dict(use_reentrant=False, preserve_rng_state=o.preserve_rng_state,
                                      determinism_check=o.determinism_check, debug=o.debug)
        if mode == "selective":  # context_fn only where a mode needs it: torch.compile refuses any other callable
            kwargs["context_fn"] = self._selective
            if _SAC_RESPECTS_HOOKS:
                # tensors SAC keeps then pass through outer saved-tensor hooks (offload, the activation meter)
                kwargs["respect_saved_tensors_hooks"] = True
        return kwargs


_MUST_SAVE, _RECOMPUTE = _cp.CheckpointPolicy.MUST_SAVE, _cp.CheckpointPolicy.PREFER_RECOMPUTE


def _keep_table(packets) -> Dict[Any, Optional[Tuple[int, str, Any]]]:
    """For each overload of the listed ops that ``selective`` may keep: ``None`` when every call is deterministic,
    else ``(position, name, default)`` of its ``dropout_p`` argument. Overloads that always draw random numbers
    (tagged ``nondeterministic_seeded``, no ``dropout_p``) are left out: they are never kept."""
    table: Dict[Any, Optional[Tuple[int, str, Any]]] = {}
    for packet in packets:
        for name in packet.overloads():
            op = getattr(packet, name)
            arguments = op._schema.arguments
            position = next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None)
            if position is not None:
                argument = arguments[position]
                table[op] = (position, argument.name, argument.default_value if argument.has_default_value() else None)
            elif torch.Tag.nondeterministic_seeded not in op.tags:
                table[op] = None
    return table


def _keep_unless_random(keep, ctx, op, *args, **kwargs) -> _cp.CheckpointPolicy:
    """The ``selective`` policy function: keep a listed op's output unless this call draws random numbers.

    A kept op is skipped when the block is replayed in backward; if it drew random numbers, every later random op of
    the block (dropout) would draw from a shifted stream on replay and the gradients would be wrong. So an op with a
    ``dropout_p`` argument (the fused attention kernels, which draw their own dropout) is kept only when this call's
    ``dropout_p`` is 0, read by name from the keywords or by its schema position from the positional arguments (the
    dispatcher drops trailing defaults: absent means the schema default). With dropout it is recomputed: the simplest
    correct choice, since the replay starts from the block's restored RNG state and no earlier random op of the block
    is kept, so the kernel redraws exactly its forward mask (keeping it would need the generator advanced on replay).
    A ``dropout_p`` that is not a plain number (a symbolic float under dynamic shapes) counts as drawing.
    """
    if op not in keep:
        return _RECOMPUTE
    dropout = keep[op]
    if dropout is None:
        return _MUST_SAVE
    position, name, default = dropout
    p = kwargs[name] if name in kwargs else args[position] if position < len(args) else default
    return _MUST_SAVE if isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0 else _RECOMPUTE


_COMPILER_PREFIX = COMPILER_MODE + ":"
# calls fn(*args); dynamo, seeing this very function as a subgraph's body, lets that body mutate outer Python state
# (a private helper, found by feature: where a torch lacks it, a block with a side effect runs eagerly under compile)
_ALLOW_SIDE_EFFECTS = getattr(torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer", None)
_SAC_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_cp.checkpoint).parameters


class _BlockForward:
    """The callable installed as ``block.forward``; see the module docstring."""

    def __init__(self, block: nn.Module, index: int, name: str, shared: _Shared) -> None:
        self.block = block
        self.index = index
        self.name = name
        self.shared = shared
        self.mode = "off"
        self.region: Optional[GroupRegion] = None
        prior = block.__dict__.get("forward")
        # an instance-level forward set by someone else (e.g. accelerate hooks) must keep running: a method bound to
        # the block is kept unbound (called with the block), any other callable (torch.compile's wrapper forward)
        # is called as nn.Module calls it, without the block
        self.bind = inspect.ismethod(prior) and prior.__self__ is block
        self.prior = prior.__func__ if self.bind else prior

    def run(self, *args, **kwargs):
        """The block's own forward, whatever the mode."""
        if self.prior is None:
            return type(self.block).forward(self.block, *args, **kwargs)
        if self.bind:
            return self.prior(self.block, *args, **kwargs)
        return self.prior(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        mode = self.mode
        if mode == "off" or not (self.block.training and torch.is_grad_enabled()):
            return self.run(*args, **kwargs)
        if self.region is not None:
            return self.region.call(self, args, kwargs)
        if mode.startswith(_COMPILER_PREFIX):
            if not torch.compiler.is_compiling():  # the annotation only exists for the compiler
                return self.run(*args, **kwargs)
            # the fraction is parsed from the mode string, a constant to dynamo (a float attribute would be a symbol)
            with torch.autograd.graph.region_activation_memory_budget(float(mode[len(_COMPILER_PREFIX):])):
                return self.run(*args, **kwargs)
        if mode == "offload":
            if not offload.applies(self.shared, args, kwargs):  # already in host memory: no hooks to pay for
                return self.run(*args, **kwargs)
            return self._offloaded(args, kwargs)
        # replays are observable in eager only: compiled backward recomputes inside the graph, and the hook's
        # bookkeeping would break the graph
        # (is_compiling() first: dynamo folds it to True and never reads the hook list, so no guard on it)
        fn = observed(self, self.run) if not torch.compiler.is_compiling() and replay_hooks_active() else self.run
        # keyword values travel positionally: checkpoint restores the RNG of the devices of its positional tensors only
        fn, inputs = keywords_as_positional(fn, args, kwargs)
        if _ALLOW_SIDE_EFFECTS is not None and torch.compiler.is_compiling():
            # dynamo refuses a Python side effect in a checkpoint body (a graph break, the block run eagerly): the
            # attention of transformers >= 5.25 sets and resets a module-level context variable on every call. Its
            # effects run once in the forward, as without checkpointing; the compiled backward replays the traced
            # tensors only. Allowed in the plugin's own regions only, never in the user's checkpoint calls
            return _cp.checkpoint(_ALLOW_SIDE_EFFECTS, fn, *inputs, **self.shared.checkpoint_kwargs(mode))
        return _cp.checkpoint(fn, *inputs, **self.shared.checkpoint_kwargs(mode))

    # saved-tensor hooks cannot live inside a compiled graph: under torch.compile an offloaded block runs eagerly
    @torch._dynamo.disable
    def _offloaded(self, args, kwargs):
        return offload.offloaded_call(self.shared, self.block, self.index, self.run, args, kwargs)

    def __repr__(self) -> str:
        return f"<lightning_ckpt forward of {self.name} mode={self.mode}>"


# ------------------------------------------------------------------------------------------------------ plan


class CheckpointPlan:
    """Which blocks of a model are checkpointed and how; re-targetable in place.

    Obtained from :func:`apply_policy` (or :func:`get_plan`). Changing the policy or the per-block modes flips
    an attribute on each block's forward: no module is re-wrapped, so parameters, optimizer state, DDP/FSDP
    wrappers and module paths are untouched.

    Attributes:
        names: fully qualified block names relative to the model given to :func:`apply_policy`.
        policy: the current :class:`~lightning_ckpt.core.policy.Policy`.
    """

    def __init__(self, model: nn.Module, found: List[Tuple[str, nn.Module]], options: CheckpointOptions) -> None:
        self.names: Tuple[str, ...] = tuple(n for n, _ in found)
        self.shared = _Shared(options)
        self._forwards = [_BlockForward(block, i, name, self.shared) for i, (name, block) in enumerate(found)]
        # resolved now: an ancestor wrapped later (FSDP) would change the paths
        self._anchors = [_anchor(model, name) for name, _ in found]
        self._regions: List[GroupRegion] = []
        self._cache_configs: List[Any] = []  # Hugging Face configs whose use_cache this plan switched off
        self._model_name = type(model).__name__
        self._root = model
        self.policy: Policy = parse_policy("none")
        self.layout: Layout = Layout(("off",) * len(found))
        for fwd, (_, block) in zip(self._forwards, found):
            block.forward = fwd

    # -- reading
    @property
    def spec(self) -> str:
        return self.policy.spec

    @property
    def modes(self) -> Tuple[str, ...]:
        return tuple(f.mode for f in self._forwards)

    @property
    def num_checkpointed(self) -> int:
        return sum(f.mode != "off" for f in self._forwards)

    @property
    def num_blocks(self) -> int:
        return len(self._forwards)

    @property
    def blocks(self) -> List[nn.Module]:
        return [f.block for f in self._forwards]

    @property
    def options(self) -> Dict[str, Any]:
        return dict(vars(self.shared.options))

    # -- changing
    def retarget(self, policy: Union[str, Policy]) -> "CheckpointPlan":
        """Switch to another policy in place (between optimizer steps, never inside one)."""
        policy = parse_policy(policy)
        if isinstance(policy, GroupPolicy):  # a region never spans two stacks (an encoder's and a decoder's blocks)
            layout = policy.layout(self.num_blocks, stacks=_stack_lengths(self.names))
        else:
            layout = policy.layout(self.num_blocks)
        self._install(layout)
        self.policy = policy
        return self

    def set_modes(self, modes: Sequence[str]) -> "CheckpointPlan":
        """Set each block's mode explicitly (``len(modes)`` must equal the number of blocks)."""
        return self.retarget(ModesPolicy(tuple(modes), self.layout.save_ops))

    @contextlib.contextmanager
    def plain(self, indices: Sequence[int]) -> Iterator["CheckpointPlan"]:
        """Inside the ``with``, the blocks at ``indices`` run plain (``off``, outside their group region); their
        modes and regions come back on exit. Policy, layout and notes stay as they are (``verify`` compares a
        block in its planned mode with the same block plain without re-planning)."""
        saved = [(f, f.mode, f.region) for f in (self._forwards[i] for i in indices)]
        for f, _, _ in saved:
            f.mode, f.region = "off", None
        try:
            yield self
        finally:
            for f, mode, region in saved:
                f.mode, f.region = mode, region

    def _install(self, layout: Layout) -> None:
        for region in self._regions:
            region.detach()
        self._regions = []
        self.shared.set_save_ops(layout.save_ops)
        for fwd, mode in zip(self._forwards, layout.modes):
            fwd.mode, fwd.region = mode, None
        for start, stop in layout.groups:
            members = self._forwards[start:stop]
            region = GroupRegion(members, self._anchors[start])
            for member in members:
                member.region = region
            self._regions.append(region)
        self.layout = layout
        if "offload" not in layout.modes:  # the pinned host memory of an earlier offload plan goes back
            offload.release_host_memory(self.shared)
        if layout.num_checkpointed:
            self._cache_configs.extend(_disable_hf_cache(self._root))

    def set_options(self, options: CheckpointOptions) -> None:
        self.shared.options = options

    def remove(self) -> None:
        """Restore every block's original forward and forget the plan."""
        for region in self._regions:
            region.detach()
        self._regions = []
        offload.release_host_memory(self.shared)
        for fwd in self._forwards:
            if fwd.block.__dict__.get("forward") is fwd:
                if fwd.prior is None:
                    del fwd.block.forward
                else:
                    fwd.block.forward = fwd.prior.__get__(fwd.block) if fwd.bind else fwd.prior
        for config in self._cache_configs:  # what apply_policy changed is given back (save_pretrained sees it)
            config.use_cache = True
        self._cache_configs = []
        if self._root.__dict__.get(_PLAN_ATTR) is self:
            delattr(self._root, _PLAN_ATTR)

    # -- persistence
    def state_dict(self) -> Dict[str, Any]:
        """Primitives only, so ``torch.load(weights_only=True)`` can read a checkpoint holding it."""
        return {"version": _STATE_VERSION, "policy": self.spec, "names": list(self.names), "modes": list(self.modes)}

    def load_state_dict(self, state: Dict[str, Any]) -> "CheckpointPlan":
        """Re-apply a saved plan: its policy, then its per-block modes when they were changed at run time."""
        if state.get("version") != _STATE_VERSION:
            warnings.warn(f"lightning_ckpt: plan state version {state.get('version')!r} is not "
                          f"{_STATE_VERSION}; loading what is compatible.", RuntimeWarning, stacklevel=2)
        modes = tuple(state.get("modes", ()))
        if list(state.get("names", [])) != list(self.names):
            policy = parse_policy(state["policy"])
            if isinstance(policy, ModesPolicy):  # a per-block list for other blocks means nothing here
                warnings.warn("lightning_ckpt: the saved plan names different blocks than this model has; "
                              "the plan was left as it is.", RuntimeWarning, stacklevel=2)
                return self
            warnings.warn(
                "lightning_ckpt: the saved plan names different blocks than this model has; only its policy "
                f"{state['policy']!r} was re-applied.", RuntimeWarning, stacklevel=2,
            )
            return self.retarget(policy)
        self.retarget(state["policy"])
        if modes and modes != self.modes:
            self.set_modes(modes)
        return self

    # -- reporting
    def annotate(self, notes: Sequence[str]) -> None:
        """One line per block saying why it runs in its mode (a planner's explanation), shown by :meth:`summary`
        until the plan changes again."""
        if len(notes) != self.num_blocks:
            raise ValueError(f"{len(notes)} notes given for {self.num_blocks} blocks; give one per block.")
        self._notes = (self.layout, tuple(notes))

    context: str = ""
    """A planner's line under the table, for as long as it plans (the budget's bucket rule and this step's
    bucket)."""

    @property
    def notes(self) -> Tuple[str, ...]:
        """The planner's notes of the current layout (:meth:`annotate`), ``()`` when there are none."""
        layout, notes = getattr(self, "_notes", (None, ()))
        return notes if layout is self.layout else ()

    def summary(self) -> str:
        """A small table: block, class, mode, region, and a planner's note per block when there is one."""
        region_of = {id(f): r for r in self._regions for f in r.members}
        lines = [
            f"lightning_ckpt plan for {self._model_name}: policy {self.spec!r}, "
            f"{self.num_checkpointed}/{self.num_blocks} blocks checkpointed "
            f"({describe_blocks([(f.name, f.block) for f in self._forwards])})",
            f"  {'#':>3}  {'block':<40} {'class':<24} {'mode':<10} region",
        ]
        for f in self._forwards:
            region = region_of.get(id(f))
            own = "own" if f.mode != "off" else "-"
            where = f"{region.members[0].index}-{region.members[-1].index}" if region else own
            lines.append(f"  {f.index:>3}  {f.name:<40} {type(f.block).__name__:<24} {f.mode:<10} {where}")
        layout, notes = getattr(self, "_notes", (None, ()))
        if notes and layout is self.layout:  # notes of an earlier plan say nothing about this one
            lines = lines[:2] + [f"{row:<90}  {note}" for row, note in zip(lines[2:], notes)]
        if self.context:
            lines.append(f"  {self.context}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CheckpointPlan(policy={self.spec!r}, checkpointed={self.num_checkpointed}/{self.num_blocks})"


def _stack_lengths(names: Sequence[str]) -> Tuple[int, ...]:
    """The lengths of the runs of consecutive blocks that share a parent module (a stack: ``encoder.layers``)."""
    lengths: List[int] = []
    parents = [name.rpartition(".")[0] for name in names]
    for i, parent in enumerate(parents):
        if i and parent == parents[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return tuple(lengths)


def _anchor(root: nn.Module, block_name: str) -> nn.Module:
    """The closest ancestor of a block that is itself called (ModuleList/ModuleDict never are)."""
    parts = block_name.split(".")[:-1]
    while parts:
        module = root.get_submodule(".".join(parts))
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return module
        parts.pop()
    return root


# ------------------------------------------------------------------------------------------------ public API


def get_plan(model: nn.Module) -> Optional[CheckpointPlan]:
    """The plan :func:`apply_policy` installed on ``model``, or ``None``."""
    return model.__dict__.get(_PLAN_ATTR)


def apply_policy(
    model: nn.Module,
    policy: Union[str, Policy] = "all",
    blocks: BlockSelector = None,
    *,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    use_reentrant: bool = False,
) -> CheckpointPlan:
    """Checkpoint ``model``'s repeated blocks in place under ``policy``.

    Idempotent: on a model that already has a plan over the same blocks, the existing plan is re-targeted and
    returned; with a different ``blocks`` selector the old plan is removed first.

    Args:
        model: the model (or ``LightningModule``) that owns the blocks.
        policy: a policy string (see :mod:`lightning_ckpt.core.policy`) or object.
        blocks: block selector for :func:`~lightning_ckpt.core.blocks.find_blocks`; ``None`` detects them.
        preserve_rng_state: stash and restore the RNG state so dropout masks are identical on replay.
        determinism_check: ``"default"`` compares shapes/dtypes/devices of recomputed tensors; ``"none"`` skips it.
        debug: include operator traces in checkpoint errors.
        use_reentrant: must stay ``False``; reentrant checkpointing is refused.

    Returns:
        The :class:`CheckpointPlan`, also reachable with :func:`get_plan`.

    Raises:
        ValueError: reentrant requested, a bad policy/selector/``determinism_check``, no repeated blocks.
        ForeignCheckpointingError: the model is already checkpointed by another library.
    """
    options = validate_options(use_reentrant, preserve_rng_state, determinism_check, debug)
    policy = parse_policy(policy)
    plan = get_plan(model)
    if plan is not None:
        if blocks is None or tuple(n for n, _ in find_blocks(model, blocks)) == plan.names:
            plan.set_options(options)
            return plan.retarget(policy)
        plan.remove()
    _refuse_foreign_checkpointing(model)
    found = find_blocks(model, blocks)
    for name, block in found:
        if isinstance(block.__dict__.get("forward"), _BlockForward):
            raise ValueError(
                f"block {name!r} is already wrapped by another lightning_ckpt plan (applied to a submodule). "
                "Call remove_checkpointing() on that submodule first, or apply the policy there only."
            )
    plan = CheckpointPlan(model, found, options)
    model.__dict__[_PLAN_ATTR] = plan
    try:
        return plan.retarget(policy)
    except Exception:
        plan.remove()
        raise


def remove_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_policy`: every block gets its own forward back. A no-op without a plan."""
    plan = get_plan(model)
    if plan is not None:
        plan.remove()


def validate_options(use_reentrant, preserve_rng_state, determinism_check, debug) -> CheckpointOptions:
    if use_reentrant:
        raise ValueError(
            "use_reentrant=True is not supported: reentrant checkpointing breaks with DDP when blocks are "
            "checkpointed twice or have unused parameters, gives no gradients to frozen inputs (LoRA), and "
            "cannot stop replay early. lightning_ckpt always uses use_reentrant=False; drop the argument."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check={determinism_check!r} is not valid; choose one of {list(_DETERMINISM_CHECKS)}."
        )
    for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False.")
    return CheckpointOptions(preserve_rng_state, determinism_check, debug)


def _refuse_foreign_checkpointing(model: nn.Module) -> None:
    for name, module in model.named_modules():
        label = name or type(model).__name__
        if type(module).__name__ == "CheckpointWrapper" or hasattr(module, "_checkpoint_wrapped_module"):
            raise ForeignCheckpointingError(
                f"{label!r} is already wrapped by torch.distributed's checkpoint_wrapper (it adds "
                "'_checkpoint_wrapped_module.' to parameter names). Remove that wrapping (or Lightning FSDP's "
                "activation_checkpointing_policy) and let lightning_ckpt apply the policy instead."
            )
        if "checkpoint" in _composable_registry(module):
            raise ForeignCheckpointingError(
                f"{label!r} already has torch.distributed._composable.checkpoint applied; remove it before "
                "applying a lightning_ckpt policy."
            )
        if getattr(module, "gradient_checkpointing", False) is True:
            raise ForeignCheckpointingError(
                f"{label!r} has Hugging Face gradient checkpointing enabled; call {_hf_checkpointing_off(model)} "
                "first and let lightning_ckpt choose the boundaries."
            )


# the installed transformers' own switch, newest first: 5.24 renamed gradient_checkpointing_disable (now deprecated,
# "removed in v6") to activation_checkpointing_disable; 5.17 has only the old name
_HF_DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable")


def _hf_checkpointing_off(model: nn.Module) -> str:
    """The call that switches Hugging Face's checkpointing off, named as the installed transformers spells it, on
    the outermost module that has it (``model.backbone.activation_checkpointing_disable()`` for a wrapped model)."""
    for name, module in model.named_modules():
        method = next((m for m in _HF_DISABLE if callable(getattr(module, m, None))), None)
        if method is not None:
            return f"{'.'.join(('model', name)) if name else 'model'}.{method}()"
    flagged = next(name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True)
    return f"{'.'.join(('model', flagged)) if flagged else 'model'}.gradient_checkpointing = False"


def _composable_registry(module: nn.Module) -> Dict[str, Any]:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # torch built without distributed
        return {}
    return _get_registry(module) or {}


def _has_generation_cache(module: nn.Module, config: Any) -> bool:
    """Whether ``module``'s forward builds a key/value cache when ``config.use_cache`` is on.

    Encoder-decoders and decoder-only families do (``is_encoder_decoder``, or no ``is_decoder`` switch at all: GPT-2,
    Llama, their base models too); families that switch between the two (BERT, RoBERTa: ``config.is_decoder``) only
    as decoders: a masked LM carries ``use_cache=True`` and never builds a cache. ``can_generate()`` settles it for a
    model with ``generate()``.
    """
    if getattr(config, "is_encoder_decoder", False) is True:
        return True
    can_generate = getattr(module, "can_generate", None)
    if callable(can_generate) and can_generate():
        return True
    return getattr(config, "is_decoder", True) is True


# frames of these packages are not the user's: a warning points at the first frame outside them
_LIBRARY_PACKAGES = ("lightning_ckpt", "torch", "lightning", "pytorch_lightning")


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller that points at the user's own line: the first frame
    outside this package, torch and Lightning (``apply_policy(...)``, ``plan.retarget(...)`` or ``trainer.fit(...)``).
    """
    import sys

    roots = tuple(os.path.dirname(mod.__file__) + os.sep for mod in map(sys.modules.get, _LIBRARY_PACKAGES)
                  if mod is not None and getattr(mod, "__file__", None))
    frame, level = sys._getframe(1), 1  # level 1: the caller's own warnings.warn line
    while frame.f_back is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


def _disable_hf_cache(model: nn.Module) -> List[Any]:
    """A Hugging Face key/value cache built inside a checkpointed block is rebuilt on replay: switch it off where the
    model has one (:func:`_has_generation_cache`), warn once, at the user's call.

    Returns the configs changed (each once), so that removing the plan can switch the cache back on.
    """
    changed, configs = [], []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and _has_generation_cache(module, config):
            config.use_cache = False
            changed.append(type(module).__name__)
            configs.append(config)
    if changed:
        advice = ("remove_checkpointing() switches it back on, and generate() takes use_cache=True" if any(
            callable(getattr(m, "generate", None)) for m in model.modules()) else
            "remove_checkpointing() switches it back on")
        warnings.warn(
            f"lightning_ckpt: set {changed[0]}.config.use_cache=False for training: a key/value cache built inside "
            f"a checkpointed block would be rebuilt when the block is replayed in backward; {advice}.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )
    return configs
