"""The arguments of the callback and of every ``*_ac`` strategy, declared once, and validated once before any training.

:class:`Options` declares them: its ``__init__`` is the one place where each argument's name, type, default and help
are written. :class:`~lightning_ckpt.ActivationCheckpointing` inherits that ``__init__``; each ``*_ac`` strategy's
``__init__`` takes the same arguments (:func:`strategy_signature`, :func:`options_help`), so LightningCLI, ``help()``
and an IDE see them all. :class:`Settings` holds the values given, validated: a bad value raises here, in the
``__init__`` of the callback or the strategy, with a message that names the value, lists the valid choices and says
how to fix it. Adding an argument is one edit here, plus its validation in :class:`Settings` and its documentation.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import FrozenInstanceError
from typing import Any, Callable, Dict, List, Literal, Optional, Union

import torch

from lightning_ckpt.core.blocks import BlockSelector
from lightning_ckpt.core.policy import BudgetPolicy, Policy, parse_policy
from lightning_ckpt.core.units import parse_size, parse_size_or_fraction
from lightning_ckpt.core.wrap import CheckpointOptions, validate_options
from lightning_ckpt.decide.controller import DEFAULT_LADDER, Controller, resolve_threshold
from lightning_ckpt.decide.safety import STATEFUL_CHOICES
from lightning_ckpt.decide.shapes import Shape, parse_shape

__all__ = ["ON_OOM", "OPTION_NAMES", "Options", "Settings", "options_help", "strategy_signature"]

ON_OOM = ("raise", "escalate")

_AUTO = "auto_threshold (e.g. 0.8 or '18GiB')"
_BUDGET = "a budget policy (e.g. policy='budget:18GiB')"


def _auto(s: "Settings") -> bool:
    return s.auto_threshold is not None


def _budget(s: "Settings") -> bool:
    return s.budget is not None


_UNUSED_PREFIX = "lightning_ckpt: pass "  # the warning about an argument that acts only with another begins so
_ACTS_WITH = {  # an argument that only acts together with another: whether it acts, and what makes it act
    "ladder": (lambda s: _auto(s) or s.on_oom == "escalate", "auto_threshold or on_oom='escalate'"),
    "release": (_auto, _AUTO),
    "cooldown": (_auto, _AUTO),
    "decide_every_n_steps": (_auto, _AUTO),
    "max_shape": (_budget, _BUDGET),
    "per_shape": (lambda s: _auto(s) or _budget(s), "a budget policy or auto_threshold"),
}


class Options:
    """What takes the arguments (see :meth:`__init__`); a subclass receives them validated in :meth:`_configure`."""

    def __init__(
        self,
        policy: Union[str, Policy, None] = None,
        blocks: BlockSelector = None,
        preserve_rng_state: bool = True,
        determinism_check: Literal["default", "none"] = "default",
        debug: bool = False,
        measure: bool = True,
        exact_every_n_steps: int = 0,
        tokens_fn: Optional[Callable[[Any], Any]] = None,
        prefix: str = "",
        auto_threshold: Optional[Union[str, int, float]] = None,
        capacity: Optional[Union[str, int]] = None,
        ladder: Optional[List[str]] = None,
        release: float = 0.8,
        cooldown: int = 20,
        decide_every_n_steps: int = 1,
        on_oom: Literal["raise", "escalate"] = "raise",
        stateful: Literal["warn", "skip", "error"] = "warn",
        verify: bool = False,
        report: bool = True,
        compile_blocks: bool = False,
        max_shape: Optional[Union[str, List[int]]] = None,
        shape_fn: Optional[Callable[[Any], Any]] = None,
        per_shape: bool = True,
        snapshot_on_oom: Union[bool, int] = False,
        zero_grad_before_forward: bool = False,
    ) -> None:
        """Every argument is validated here: a bad value raises before any training. An argument that acts only
        together with another warns when given without it: ``ladder`` (with ``auto_threshold`` or
        ``on_oom="escalate"``), ``release``, ``cooldown`` and ``decide_every_n_steps`` (with ``auto_threshold``),
        ``max_shape`` (with a ``budget:`` policy), ``per_shape`` (with either).

        Args:
            policy: which blocks to checkpoint and how: ``"all"``, ``"none"``, ``"every:N"``, ``"first:K"``,
                ``"blocks:0-5,9"``, ``"group:K"``, ``"group:sqrt"``, ``"selective"``, ``"selective:mm,sdpa"``,
                ``"offload"``, ``"budget:18GiB"`` (or a :class:`~lightning_ckpt.core.policy.Policy`). ``None``:
                ``"all"``, or with ``auto_threshold`` the first policy of ``ladder``.
            blocks: which modules are the blocks: ``None`` detects them; otherwise a class name (``"GPT2Block"``),
                a path glob (``"model.layers.*"``), an ``nn.Module`` class, or a list of these.
            preserve_rng_state: replay dropout with the same random state (keep ``True`` when dropout is active).
            determinism_check: ``"default"`` checks that recomputed tensors match the originals' metadata;
                ``"none"`` skips the check.
            debug: add operator traces to checkpoint errors (slow).
            measure: log the ledger, throughput and checkpointing metrics.
            exact_every_n_steps: make every n-th measured step an exact (per-op, slow) calibration step; 0 never.
            tokens_fn: ``tokens_fn(batch) -> int`` to count tokens yourself.
            prefix: root for the metric names (``"ac"`` gives ``ac/memory/...``).
            auto_threshold: activation peak that triggers more checkpointing: a size (``"18GiB"``, ``"512MiB"``,
                bytes) or a fraction of capacity (``0.8``). ``None`` disables auto-toggling.
            capacity: device capacity (``"24GiB"``) when it cannot be read from the device (CPU) or when planning
                for another card.
            ladder: policy strings from least to most checkpointing (default ``["none", "every:2", "all"]``).
            release: the policy below is taken when its predicted peak stays under ``release × auto_threshold``.
            cooldown: optimizer steps of calm before stepping down, and the minimum dwell after a switch.
            decide_every_n_steps: with ``auto_threshold``, the auto-toggle reads and decides on every n-th optimizer
                step. Under several processes a decision step costs one collective of one float and one host sync;
                the other steps (neither logged nor deciding) cost no sync, no collective, no hook.
            on_oom: ``"raise"`` (diagnose and re-raise) or ``"escalate"`` (retry the step one policy up).
            stateful: modules with running statistics in checkpointed blocks: ``"warn"``, ``"skip"`` (keep those
                blocks un-checkpointed) or ``"error"``.
            verify: compare one checkpointed and one plain step on the first batch before training.
            report: print and save the ledger report at the end of ``fit``.
            compile_blocks: give every block its own ``torch.compile`` graph (``block.compile()``, the torchtitan /
                FSDP2 way) when the plan is applied. A whole-model compile (``torch.compile(model)`` in
                ``configure_model``, or ``trainer.fit(torch.compile(model))``) is turned into per-block graphs with
                its own backend and options (its wrapper stays, so ``state_dict()`` keys do not change; the modules
                outside the blocks then run eagerly); without a compile the blocks get ``torch.compile``'s defaults.
                In one whole-model graph a checkpointed model holds 17-26 % more activation memory than eager and
                the budget cannot use the compiler's budget per block (``compiler:<f>``); per block, both are as
                eager measures them (:mod:`lightning_ckpt.lightning.compiled`).
            max_shape: the longest batch the run can see, micro-batch first (``"4x2048"``, ``[4, 2048]``; an
                encoder-decoder ``"4x512x128"``), for ``budget:``: before the first step a budget no plan meets
                there raises. ``None``: the longest length the budget holds at the first batch's micro-batch is
                found on fake tensors before the first step and said (the config's maximum positions never refuse
                a run).
            shape_fn: ``shape_fn(batch) -> (micro-batch, length, ...)`` when the batch's shape cannot be read from
                it (:func:`lightning_ckpt.decide.shapes.shape_of` reads token ids, masks, encoder-decoder and image
                batches).
            per_shape: plan each step from its batch's shape before it runs: ``budget:`` a plan per shape bucket
                (:mod:`lightning_ckpt.lightning.shaped`), ``auto_threshold`` the lowest policy of the ladder a
                bucket needs (:mod:`lightning_ckpt.lightning.gate`). ``False``: one plan, changed after measured
                steps only.
            snapshot_on_oom: on CUDA, record the allocator's history during ``fit`` and, when an allocation fails,
                write ``oom_snapshot_rank{r}.pickle`` beside the logs (PyTorch's memory viewer opens it) before
                anything is released; the out-of-memory diagnosis names it. ``True`` keeps the newest 100000
                events, an int that many. Recording costs host time per allocation: off by default
                (:mod:`lightning_ckpt.lightning.snapshot`).
            zero_grad_before_forward: free the previous step's gradients (``optimizer.zero_grad(set_to_none=True)``)
                before the first micro-batch's forward. Lightning frees them between ``training_step`` and
                ``backward``, so they stay alive through the forward's peak; the gradients the step builds are the
                same. Automatic optimization only (``lightning-ckpt plan --remedies`` prices it).
        """
        given = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self._configure(Settings(**given))

    def _configure(self, settings: "Settings") -> None:
        raise NotImplementedError(f"{type(self).__name__} takes the options but does nothing with them.")


# Python names the function in its own argument errors ("... got an unexpected keyword argument 'polcy'"): the
# name users call it by
Options.__init__.__qualname__ = "ActivationCheckpointing.__init__"


def _declared(resolved: bool = False) -> Dict[str, inspect.Parameter]:
    """:class:`Options`' arguments, in order (``self`` left out); ``resolved``: annotations as types, not strings
    (for a signature read outside this module)."""
    return dict(list(inspect.signature(Options.__init__, eval_str=resolved).parameters.items())[1:])


def strategy_signature() -> inspect.Signature:
    """A strategy mixin's ``__init__`` signature: ``self, *args``, then every option as a keyword, then
    ``**kwargs`` (what it passes on to the strategy)."""
    kind = inspect.Parameter
    return inspect.Signature(
        [kind("self", kind.POSITIONAL_OR_KEYWORD), kind("args", kind.VAR_POSITIONAL, annotation=Any),
         *(p.replace(kind=kind.KEYWORD_ONLY) for p in _declared(resolved=True).values()),
         kind("kwargs", kind.VAR_KEYWORD, annotation=Any)],
        return_annotation=None)


OPTION_NAMES = tuple(_declared())
""":class:`Options`' argument names, in order."""


def options_help() -> str:
    """The ``Args:`` section of :meth:`Options.__init__`'s docstring (for a strategy's ``__init__``)."""
    doc = inspect.getdoc(Options.__init__) or ""
    return doc[doc.index("Args:"):]


class Settings:
    """The validated arguments (read-only). Derived values: :attr:`start` (the policy applied first),
    :attr:`budget` (a ``budget:`` policy, or ``None``), :attr:`ladder` (a tuple of policy strings),
    :attr:`capacity_bytes`, :attr:`options` (the checkpoint options), :attr:`shape_cap`.

    ``Settings(**arguments)`` takes :class:`Options`' arguments by name; those not given take their defaults.
    """

    start: Policy
    budget: Optional[BudgetPolicy]
    options: CheckpointOptions
    capacity_bytes: Optional[int]
    shape_cap: Optional[Shape]

    def __init__(self, **arguments: Any) -> None:
        declared = _declared()
        unknown = sorted(set(arguments) - set(declared))
        if unknown:
            raise TypeError(f"{unknown[0]!r} is not an argument of ActivationCheckpointing; the arguments are "
                            f"{list(declared)}.")
        for name, parameter in declared.items():
            object.__setattr__(self, name, arguments.get(name, parameter.default))
        self.__post_init__()

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}: the settings are read-only")

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in OPTION_NAMES) + ")"

    def replace(self, **changes: Any) -> "Settings":
        """New settings with ``changes`` (validated again, as ``dataclasses.replace`` did when these were a
        dataclass; an argument that does nothing without another was said when the user gave it, not again here)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNUSED_PREFIX, category=UserWarning)
            return Settings(**{**{name: getattr(self, name) for name in OPTION_NAMES}, **changes})

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        declared = _declared()
        given = [name for name in _ACTS_WITH if getattr(self, name) != declared[name].default
                 and not (name == "ladder" and tuple(self.ladder) == DEFAULT_LADDER)]  # replace() passes the default
        set_(self, "ladder", tuple(self.ladder) if self.ladder is not None else DEFAULT_LADDER)
        set_(self, "options", validate_options(False, self.preserve_rng_state, self.determinism_check, self.debug))
        set_(self, "blocks", check_selector(self.blocks))
        self._check_choices()
        set_(self, "capacity_bytes", None if self.capacity is None else parse_size(self.capacity, name="capacity"))
        set_(self, "budget", self._budget_policy())
        set_(self, "shape_cap", parse_shape(self.max_shape, name="max_shape"))
        set_(self, "start", parse_policy("every:2") if self.budget is not None else self._starting_policy())
        if self.auto_threshold is not None:  # threshold, release and cooldown checked now, not at the first step
            fraction = isinstance(parse_size_or_fraction(self.auto_threshold, name="auto_threshold"), float)
            self._check_fraction_has_capacity("auto_threshold", self.auto_threshold, fraction)
            Controller(threshold=resolve_threshold(self.auto_threshold, self.capacity_bytes or 2**62),
                       ladder=self.ladder, release=self.release, cooldown=self.cooldown,
                       level=self.ladder.index(self.start.spec))
        self._warn_unused(given)

    def _warn_unused(self, given: List[str]) -> None:
        """An argument given that only acts with another, which is not: said before any training (the run goes on;
        nothing reads it)."""
        for name in given:
            if not self.acts(name):
                partner = _ACTS_WITH[name][1]
                value = getattr(self, name)
                value = list(value) if isinstance(value, tuple) else value  # the ladder, as it was given
                warnings.warn(f"{_UNUSED_PREFIX}{partner} as well, or leave {name} out: {name}={value!r} does nothing "
                              "without it.", UserWarning, stacklevel=5)

    def acts(self, name: str) -> bool:
        """Whether the argument ``name``, one that acts only together with another (``ladder``, ``release``,
        ``cooldown``, ``decide_every_n_steps``, ``max_shape``, ``per_shape``), acts in this run."""
        return _ACTS_WITH[name][0](self)

    @property
    def changes_plan(self) -> str:
        """The option that may change the plan during training (``""`` when the plan is fixed), for messages."""
        if self.auto_threshold is not None:
            return "auto_threshold"
        if self.budget is not None:
            return f"policy={self.budget.spec!r}"
        return "on_oom='escalate'" if self.on_oom == "escalate" else ""

    def _check_choices(self) -> None:
        if self.on_oom not in ON_OOM:
            raise ValueError(f"on_oom={self.on_oom!r} is not valid; choose one of {list(ON_OOM)}.")
        if self.stateful not in STATEFUL_CHOICES:
            raise ValueError(f"stateful={self.stateful!r} is not valid; choose one of {list(STATEFUL_CHOICES)}.")
        n = self.exact_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"exact_every_n_steps={n!r} must be an integer ≥ 0 (0 = never).")
        n = self.decide_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"decide_every_n_steps={n!r} must be an integer ≥ 1 (optimizer steps between two "
                             "auto-toggle decisions).")
        if not isinstance(self.prefix, str):
            raise TypeError(f"prefix={self.prefix!r} must be a string such as 'ac' (or '' for none).")
        for name in ("measure", "verify", "report", "compile_blocks", "per_shape", "zero_grad_before_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.tokens_fn is not None and not callable(self.tokens_fn):
            raise TypeError(f"tokens_fn={self.tokens_fn!r} must be a function batch -> number of tokens, or None.")
        n = self.snapshot_on_oom
        if not isinstance(n, bool) and (not isinstance(n, int) or n < 1):
            raise ValueError(f"snapshot_on_oom={n!r} is not valid; pass True (keep the newest 100000 allocator "
                             "events), a positive number of events to keep, or False.")
        if self.shape_fn is not None and not callable(self.shape_fn):
            raise TypeError(f"shape_fn={self.shape_fn!r} must be a function batch -> (micro-batch, length, ...) "
                            "integers, or None.")
        for rung in self.ladder:
            if isinstance(parse_policy(rung), BudgetPolicy):
                raise ValueError(f"Use fixed policies in the ladder (e.g. ['none', 'every:2', 'all']): {rung!r} is a "
                                 "budget, which the ladder cannot hold.")
        if len({parse_policy(r).spec for r in self.ladder}) != len(self.ladder) or len(self.ladder) < 2:
            raise ValueError(f"ladder={list(self.ladder)!r} needs at least two different policies, e.g. "
                             "['none', 'every:2', 'all'].")
        object.__setattr__(self, "ladder", tuple(parse_policy(r).spec for r in self.ladder))

    def _check_fraction_has_capacity(self, name: str, value: Any, fraction: bool) -> None:
        if fraction and self.capacity is None and not torch.cuda.is_available():
            raise ValueError(
                f"{name}={value!r} is a fraction of device capacity, but there is no CUDA device to read it from. "
                "Pass capacity='24GiB' (the card you plan for) or an absolute size such as '18GiB'.")

    def _budget_policy(self) -> Optional[BudgetPolicy]:
        parsed = None if self.policy is None else parse_policy(self.policy)
        if not isinstance(parsed, BudgetPolicy):
            return None
        if self.auto_threshold is not None:
            raise ValueError(f"policy={parsed.spec!r} chooses the plan itself; it cannot be combined with "
                             "auto_threshold. Use one of the two.")
        self._check_fraction_has_capacity("policy", parsed.spec, isinstance(parsed.budget, float))
        return parsed

    def _starting_policy(self) -> Policy:
        if self.auto_threshold is None:
            return parse_policy("all" if self.policy is None else self.policy)
        if self.policy is None:
            return parse_policy(self.ladder[0])
        spec = parse_policy(self.policy).spec
        if spec not in self.ladder:
            raise ValueError(
                f"Leave policy unset to start at the ladder's first policy, or add it to the ladder: "
                f"policy={self.policy!r} is not one of ladder {list(self.ladder)} (with auto_threshold the policy "
                "names where the auto-toggle starts).")
        return parse_policy(spec)


def check_selector(blocks: BlockSelector) -> BlockSelector:
    """Type-check a ``blocks=`` selector eagerly (``find_blocks`` resolves it against the model later)."""
    if blocks is None:
        return None
    many = isinstance(blocks, (list, tuple))
    items = list(blocks) if many else [blocks]
    if not items:
        raise ValueError("blocks=[] selects nothing; pass None for automatic detection or at least one selector.")
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, torch.nn.Module))):
            raise TypeError(
                f"blocks={blocks!r} is not a block selector. Pass None (detect the repeated blocks), a class name "
                "such as 'GPT2Block', a path glob such as 'transformer.h.*', an nn.Module class, or a list of these.")
    return tuple(items) if many else blocks

