"""The arguments both doors take, validated once, before any training: :class:`Settings`.

The callback and the strategy mixin accept the same keyword arguments and hand them to
:class:`Settings`; a bad value raises here, in the door's ``__init__``, with a message that names the value, lists
the valid choices and says how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from lightning_ckpt.core.blocks import BlockSelector
from lightning_ckpt.core.policy import BudgetPolicy, Policy, parse_policy
from lightning_ckpt.core.units import parse_size, parse_size_or_fraction
from lightning_ckpt.core.wrap import CheckpointOptions, validate_options
from lightning_ckpt.decide.controller import DEFAULT_LADDER, Controller, resolve_threshold
from lightning_ckpt.decide.safety import STATEFUL_CHOICES
from lightning_ckpt.decide.shapes import Shape, parse_shape

__all__ = ["ON_OOM", "Settings"]

ON_OOM = ("raise", "escalate")


@dataclass(frozen=True)
class Settings:
    """Everything a door was configured with; see :class:`~lightning_ckpt.ActivationCheckpointing` for each
    argument. Derived, validated values: :attr:`start` (the policy applied first), :attr:`budget` (a
    ``budget:`` policy, or ``None``), :attr:`ladder`, :attr:`capacity_bytes`, :attr:`options`."""

    policy: Union[str, Policy, None] = None
    blocks: BlockSelector = None
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    measure: bool = True
    exact_every_n_steps: int = 0
    tokens_fn: Optional[Callable[[Any], Any]] = None
    prefix: str = ""
    auto_threshold: Union[str, int, float, None] = None
    capacity: Union[str, int, None] = None
    ladder: Optional[Sequence[str]] = None
    release: float = 0.8
    cooldown: int = 20
    decide_every_n_steps: int = 1
    on_oom: str = "raise"
    stateful: str = "warn"
    verify: bool = False
    report: bool = True
    compile_blocks: bool = False
    max_shape: Union[str, Sequence[int], None] = None
    shape_fn: Optional[Callable[[Any], Any]] = None
    per_shape: bool = True
    snapshot_on_oom: Union[bool, int] = False
    zero_grad_before_forward: bool = False
    start: Policy = field(init=False)
    budget: Optional[BudgetPolicy] = field(init=False)
    options: CheckpointOptions = field(init=False)
    capacity_bytes: Optional[int] = field(init=False)
    shape_cap: Optional[Shape] = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
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

