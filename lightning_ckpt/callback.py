"""The ``ActivationCheckpointing`` callback: the Callback door to the checkpointing engine."""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ckpt._engine import (
    ENGINE_ATTR,
    CheckpointingEngine,
    remove_before_strategy_setup,
    run_before_strategy_setup,
)
from lightning_ckpt.blocks import BlockSelector
from lightning_ckpt.policy import Policy
from lightning_ckpt.wrap import CheckpointPlan

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(Callback):
    """Checkpoint the repeated Transformer blocks of the LightningModule during ``fit``.

    The blocks are patched in place (non-reentrant ``torch.utils.checkpoint``, RNG preserved): module paths,
    ``state_dict()`` keys and parameters never change, so checkpoints load with or without the callback.

    What happens at which hook:

    - ``__init__``: the policy, the selector and the options are validated; a bad value raises here.
    - ``setup(stage="fit")``: refuses a second owner (another instance of this callback, a ``*_ac``
      strategy, Lightning FSDP's ``activation_checkpointing_policy``, DeepSpeed activation checkpointing) and
      arranges for the plan to be applied right before ``strategy.setup``.
    - right before ``strategy.setup`` (no callback hook exists there): the policy is applied. This is the
      first moment the final module tree exists (after ``LightningModule.setup`` and ``configure_model``,
      which run after this callback's ``setup``) and the last one before the strategy wraps the model (DDP,
      or FSDP's auto-wrapping, which would hide the blocks inside FSDP units). With a ``ckpt_path``,
      Lightning has restored this callback's state just before (unless the strategy restores after setup),
      so the saved plan is re-applied here too.
    - ``load_state_dict``: if the plan exists already (strategies with ``restore_checkpoint_after_setup``,
      e.g. FSDP, restore after ``strategy.setup``), the saved plan is re-applied immediately; either way it is
      in place before the first resumed step. When the configured policy differs from the saved one, the
      configured one wins with a warning.
    - ``on_fit_start``: a safety net that applies the plan if the strategy's ``setup`` was bypassed.
    - ``teardown`` / ``on_exception``: the one-shot hook is removed if it never fired (a run that failed
      before ``strategy.setup``), so the strategy is left as it was.
    - validation, test, predict and the sanity check run the plain forward (the blocks are in ``eval()`` mode
      or grad is disabled); nothing is recomputed.

    The plan stays on the model after ``fit`` (so ``fit`` again, or ``validate``, re-targets the same plan and
    nothing is wrapped twice); call :func:`lightning_ckpt.remove_checkpointing` to undo it.

    Args:
        policy: which blocks to checkpoint and how: ``"all"``, ``"none"``, ``"every:N"``, ``"first:K"``,
            ``"blocks:0-5,9"``, ``"group:K"``, ``"group:sqrt"``, ``"selective"``, ``"selective:mm,sdpa"``,
            ``"offload"`` (or a :class:`~lightning_ckpt.policy.Policy`).
        blocks: which modules are the blocks: ``None`` detects them; otherwise a class name (``"GPT2Block"``),
            a path glob (``"model.layers.*"``), an ``nn.Module`` class, or a list of these.
        preserve_rng_state: replay dropout with the same random state (keep ``True`` when dropout is active).
        determinism_check: ``"default"`` checks that recomputed tensors match the originals' metadata;
            ``"none"`` skips the check.
        debug: add operator traces to checkpoint errors (slow).

    Attributes:
        plan: the :class:`~lightning_ckpt.wrap.CheckpointPlan` once applied (``None`` before ``fit``).

    Known limitations:
        - Only ``fit`` applies the plan; ``validate``/``test``/``predict`` alone leave the model untouched.
        - Blocks created lazily inside the first ``forward`` are not found (build them in ``__init__``,
          ``setup`` or ``configure_model``).
        - A model already checkpointed by ``checkpoint_wrapper``, composable ``checkpoint`` or Hugging Face
          ``gradient_checkpointing_enable()`` is refused with an error instead of being checkpointed twice.
        - ``budget:`` policies need measurements and are not accepted yet.
    """

    def __init__(
        self,
        policy: str = "all",
        blocks: BlockSelector = None,
        preserve_rng_state: bool = True,
        determinism_check: Literal["default", "none"] = "default",
        debug: bool = False,
    ) -> None:
        engine = CheckpointingEngine(
            policy,
            blocks,
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            debug=debug,
            owner=type(self).__name__,
        )
        setattr(self, ENGINE_ATTR, engine)

    @property
    def _engine(self) -> CheckpointingEngine:
        return getattr(self, ENGINE_ATTR)

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """The applied :class:`~lightning_ckpt.wrap.CheckpointPlan`, or ``None`` before ``fit``."""
        return self._engine.plan

    @property
    def policy(self) -> Policy:
        """The configured policy."""
        return self._engine.policy

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._engine.begin_run()
        self._engine.check_trainer(trainer)
        if stage == "fit":
            run_before_strategy_setup(trainer.strategy, self._apply)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.plan is None:
            self._apply(trainer)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        remove_before_strategy_setup(trainer.strategy)

    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        remove_before_strategy_setup(trainer.strategy)

    def state_dict(self) -> Dict[str, Any]:
        return self._engine.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)

    def _apply(self, trainer: "pl.Trainer") -> None:
        plan = self._engine.apply(trainer.lightning_module)
        rank_zero_info(plan.summary().splitlines()[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(policy={self.policy.spec!r})"
