"""The engine behind both Lightning doors: configure → validate → apply → persist.

:class:`~lightning_ckpt.callback.ActivationCheckpointing` and
:class:`~lightning_ckpt.strategy.ActivationCheckpointingMixin` each hold one :class:`CheckpointingEngine` and
only decide *when* to call it; everything about *what* happens (argument checks, conflict detection,
applying the policy, saving and restoring the plan) lives here, so no logic is written twice.

Lightning is imported here only for the conflict checks and the pre-strategy-setup hook; the wrapping itself
is :func:`lightning_ckpt.wrap.apply_policy`.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Union

from torch import nn

from lightning_ckpt.blocks import BlockSelector
from lightning_ckpt.policy import BudgetPolicy, Policy, parse_policy
from lightning_ckpt.wrap import CheckpointPlan, _validate_options, apply_policy, get_plan

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = [
    "ENGINE_ATTR",
    "STATE_VERSION",
    "CheckpointingEngine",
    "EngineDoor",
    "check_strategy",
    "remove_before_strategy_setup",
    "run_before_strategy_setup",
]

ENGINE_ATTR = "_lightning_ckpt_engine"
"""Attribute under which each door (callback or strategy) keeps its engine; used to find every owner."""

STATE_VERSION = 1
_STATE_KEYS = frozenset({"version", "policy", "plan_policy", "names", "modes"})
_SHIM_FLAG = "_lightning_ckpt_pre_setup"


class CheckpointingEngine:
    """Configuration, validation, application and persistence of one activation-checkpointing plan.

    Args:
        policy: a policy string (``"all"``, ``"every:2"``, ``"selective"``, ... see
            :data:`lightning_ckpt.policy.GRAMMAR`) or a :class:`~lightning_ckpt.policy.Policy`.
        blocks: block selector for :func:`~lightning_ckpt.blocks.find_blocks`; ``None`` detects the blocks.
        preserve_rng_state: replay dropout with the same RNG state.
        determinism_check: ``"default"`` or ``"none"``.
        debug: operator traces in checkpoint errors.
        owner: how the owning door describes itself in error messages.

    Raises:
        ValueError, TypeError: an invalid policy, selector or option; raised here, before any training.
    """

    def __init__(
        self,
        policy: Union[str, Policy] = "all",
        blocks: BlockSelector = None,
        *,
        preserve_rng_state: bool = True,
        determinism_check: str = "default",
        debug: bool = False,
        owner: str = "lightning_ckpt",
    ) -> None:
        self.policy = _static_policy(policy)
        self.blocks = _check_selector(blocks)
        self.options = _validate_options(False, preserve_rng_state, determinism_check, debug)
        self.owner = owner
        self.plan: Optional[CheckpointPlan] = None
        self._pending: Optional[Dict[str, Any]] = None
        self._applied_in_run = False

    def begin_run(self) -> None:
        """Mark the start of a Trainer run, before any checkpoint is read (see :meth:`load_state_dict`)."""
        self._applied_in_run = False
        self._pending = None

    def describe(self) -> str:
        """``Owner(policy='every:2')``: used in conflict messages."""
        return f"{self.owner}(policy={self.policy.spec!r})"

    # ------------------------------------------------------------------------------------------ checks
    def check_trainer(self, trainer: "pl.Trainer") -> None:
        """Refuse a second owner of activation checkpointing (callback, strategy, FSDP, DeepSpeed)."""
        owners = _owners(trainer)
        if len(owners) > 1:
            raise RuntimeError(_two_owners_message(owners))
        check_strategy(trainer.strategy)

    # ------------------------------------------------------------------------------------------ apply
    def apply(self, model: nn.Module) -> CheckpointPlan:
        """Checkpoint ``model``'s blocks under the configured policy, then re-apply any restored state.

        Idempotent: on a model that already holds a plan, that plan is re-targeted in place (nothing is
        wrapped twice), so ``fit`` twice or ``fit`` then ``validate`` keep one wrapping.
        """
        existing = get_plan(model)
        if existing is not None and existing is not self.plan and existing.spec != self.policy.spec:
            warnings.warn(
                f"lightning_ckpt: the model already holds a plan with policy {existing.spec!r} set outside "
                f"{self.describe()}; re-targeting it to {self.policy.spec!r}.",
                RuntimeWarning,
                stacklevel=3,
            )
        o = self.options
        self.plan = apply_policy(
            model,
            self.policy,
            self.blocks,
            preserve_rng_state=o.preserve_rng_state,
            determinism_check=o.determinism_check,
            debug=o.debug,
        )
        self._applied_in_run = True
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)
        return self.plan

    # ------------------------------------------------------------------------------------------ persist
    def state_dict(self) -> Dict[str, Any]:
        """Primitives only: ``version``, configured ``policy``, plan ``plan_policy``/``names``/``modes``."""
        if self.plan is None:
            if self._pending is not None:  # restored but not applied yet: keep what the user had
                return dict(self._pending)
            return {"version": STATE_VERSION, "policy": self.policy.spec}
        plan = self.plan.state_dict()
        return {
            "version": STATE_VERSION,
            "policy": self.policy.spec,
            "plan_policy": plan["policy"],
            "names": list(plan["names"]),
            "modes": list(plan["modes"]),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a saved plan: at once if this run already applied it (the strategy restores after setup),
        else at this run's :meth:`apply` (a plan left by an earlier run would be re-targeted there)."""
        state = _check_state(state)
        if state is None:
            return
        if self._applied_in_run:
            self._restore(state)
        else:
            self._pending = state

    def _restore(self, state: Dict[str, Any]) -> None:
        assert self.plan is not None
        saved = state.get("policy")
        if saved != self.policy.spec:
            warnings.warn(
                f"lightning_ckpt: the checkpoint was trained with policy {saved!r} but {self.describe()} is "
                f"configured with {self.policy.spec!r}; the configured policy wins. To resume with the saved "
                f"plan, pass policy={saved!r}.",
                UserWarning,
                stacklevel=3,
            )
            self.plan.retarget(self.policy)
            return
        if "plan_policy" not in state:
            return
        if list(state.get("names", [])) != list(self.plan.names):
            warnings.warn(
                f"lightning_ckpt: the checkpoint's plan covers blocks {state.get('names')}, this model has "
                f"{list(self.plan.names)}; keeping the configured policy {self.policy.spec!r}.",
                UserWarning,
                stacklevel=3,
            )
            return
        self.plan.load_state_dict(
            {
                "version": 1,
                "policy": state["plan_policy"],
                "names": state.get("names", []),
                "modes": state.get("modes", []),
            }
        )


class EngineDoor:
    """What both doors (the callback and the strategy mixin) expose about the engine they hold."""

    @property
    def _engine(self) -> CheckpointingEngine:
        return getattr(self, ENGINE_ATTR)

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """The applied :class:`~lightning_ckpt.wrap.CheckpointPlan`, or ``None`` before ``fit``."""
        return self._engine.plan

    @property
    def policy(self) -> Policy:
        """The configured (starting) policy."""
        return self._engine.policy


# ---------------------------------------------------------------------------------------------- helpers


def _static_policy(policy: Union[str, Policy]) -> Policy:
    parsed = parse_policy(policy)
    if isinstance(parsed, BudgetPolicy):
        raise ValueError(
            f"policy={parsed.spec!r} is chosen from measured activation memory, which only the "
            "ActivationCheckpointing callback measures. Use the callback with this policy (and a plain "
            "strategy), or give the *_ac strategy a fixed policy such as 'all', 'every:2' or 'selective'."
        )
    return parsed


def _check_selector(blocks: BlockSelector) -> BlockSelector:
    """Type-check a ``blocks=`` selector eagerly (``find_blocks`` resolves it against the model later)."""
    if blocks is None:
        return None
    many = isinstance(blocks, (list, tuple))
    items = list(blocks) if many else [blocks]
    if not items:
        raise ValueError(
            "blocks=[] selects nothing; pass None for automatic detection or at least one selector."
        )
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(
                f"blocks={blocks!r} is not a block selector. Pass None (detect the repeated blocks), a class "
                "name such as 'GPT2Block', a path glob such as 'transformer.h.*', an nn.Module class, or a "
                "list of these."
            )
    return items if many else blocks


def _check_state(state: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(state, dict) or not isinstance(state.get("policy"), str):
        warnings.warn(
            f"lightning_ckpt: ignoring unreadable saved state {state!r}; using the configured policy.",
            UserWarning,
            stacklevel=3,
        )
        return None
    if state.get("version") != STATE_VERSION:
        warnings.warn(
            f"lightning_ckpt: saved state version {state.get('version')!r} is not {STATE_VERSION}; "
            "loading what is compatible.",
            UserWarning,
            stacklevel=3,
        )
    unknown = sorted(set(state) - _STATE_KEYS)
    if unknown:
        warnings.warn(
            f"lightning_ckpt: ignoring unknown keys {unknown} in saved state.", UserWarning, stacklevel=3
        )
    return state


def _owners(trainer: "pl.Trainer") -> List[Any]:
    doors = [cb for cb in trainer.callbacks if getattr(cb, ENGINE_ATTR, None) is not None]
    if getattr(trainer.strategy, ENGINE_ATTR, None) is not None:
        doors.append(trainer.strategy)
    return doors


def _two_owners_message(owners: Sequence[Any]) -> str:
    described = [getattr(o, ENGINE_ATTR).describe() for o in owners]
    return (
        f"Activation checkpointing is configured {len(owners)} times: {', '.join(described)}. Exactly one "
        "owner may checkpoint the model. Keep one ActivationCheckpointing callback, or a *_ac strategy "
        "(e.g. strategy='ddp_ac') without the callback, or the callback with a plain strategy (e.g. 'ddp')."
    )


def check_strategy(strategy: Any) -> None:
    """Refuse a strategy that checkpoints activations itself (Lightning FSDP policy, DeepSpeed)."""
    fsdp_ac = getattr(strategy, "_activation_checkpointing_kwargs", None)
    if fsdp_ac:
        raise RuntimeError(
            f"{type(strategy).__name__} was given `activation_checkpointing_policy` (or "
            "`activation_checkpointing`) and lightning_ckpt checkpoints the model too: the blocks would be "
            "recomputed twice. Remove `activation_checkpointing_policy` from the FSDP strategy and let "
            "lightning_ckpt choose the blocks (keep `auto_wrap_policy` for sharding), or drop lightning_ckpt."
        )
    if _is_deepspeed(strategy):
        section = (getattr(strategy, "config", None) or {}).get("activation_checkpointing") or {}
        enabled = sorted(k for k, v in section.items() if v) if isinstance(section, dict) else []
        if enabled:
            raise RuntimeError(
                f"DeepSpeed activation checkpointing is configured ({enabled} in the "
                "'activation_checkpointing' config section) and lightning_ckpt checkpoints the model too. "
                "Turn those DeepSpeed options off or drop lightning_ckpt."
            )


def _is_deepspeed(strategy: Any) -> bool:
    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:  # pragma: no cover
        return False
    return isinstance(strategy, DeepSpeedStrategy)


# ------------------------------------------------------------------------------ pre-strategy-setup hook


def run_before_strategy_setup(strategy: Any, fn: Callable[["pl.Trainer"], None]) -> None:
    """Call ``fn(trainer)`` once, right before ``strategy.setup(trainer)``, then restore ``strategy.setup``.

    Lightning has no callback hook between ``configure_model`` (plus the checkpoint restore) and the
    strategy's model wrapping, which happens inside ``strategy.setup``. This puts a one-shot instance
    attribute in front of that method; it removes itself when called, and installing again replaces it
    (never stacks).
    """
    remove_before_strategy_setup(strategy)  # a shim left by a run that failed early is replaced, not stacked
    current = strategy.__dict__.get("setup")
    original = strategy.setup

    @functools.wraps(original)
    def setup(trainer: "pl.Trainer") -> Any:
        remove_before_strategy_setup(strategy)
        fn(trainer)
        return original(trainer)

    setattr(setup, _SHIM_FLAG, True)
    setup._lightning_ckpt_prior = current  # type: ignore[attr-defined]
    strategy.setup = setup


def remove_before_strategy_setup(strategy: Any) -> None:
    """Undo :func:`run_before_strategy_setup` if it has not fired (e.g. the run failed before setup)."""
    current = strategy.__dict__.get("setup")
    if not getattr(current, _SHIM_FLAG, False):
        return
    prior = current._lightning_ckpt_prior
    if prior is None:
        del strategy.setup
    else:
        strategy.setup = prior
