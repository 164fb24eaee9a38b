"""``verify=True`` as a feature of the run: :class:`Verification`.

On the first training batch of the callback's life (a second ``fit`` does not verify again), before anything of its
step is measured, every checkpointed block of the plan runs against itself plain, inside the precision plugin's
training-step context (its autocast), block by block within the checkpointed step's memory
(:mod:`lightning_ckpt.decide.verify`); the table of what agreed goes to the user.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_ckpt.decide.verify import verify_equivalence
from lightning_ckpt.lightning import conflicts
from lightning_ckpt.lightning.feature import Feature
from lightning_ckpt.lightning.port import PlanPort

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["Verification"]


class Verification(Feature):
    """Checks the plan once, on the first training batch (see the module docstring).

    Args:
        port: what the feature reaches of the run.
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self.verified = False

    @classmethod
    def wanted(cls, settings: Any) -> bool:
        return bool(settings.verify)

    def before_batch(self, pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        if self.verified:
            return
        self.verified = True
        plan = self.port.plan
        if plan is None or not plan.num_checkpointed:
            return
        sharded = next((name for name, m in pl_module.named_modules() if conflicts.is_fsdp_module(m)), None)
        if sharded is not None:
            raise ValueError(
                f"{self.port.owner}(verify=True): verify the plan without FSDP (the same policy on one device), then "
                f"drop verify=True here; {sharded or type(pl_module).__name__!r} is sharded by FSDP, and verify runs "
                "each checkpointed block alone, outside the root's forward, where FSDP cannot gather its parameters.")
        trainer = pl_module.trainer
        report = verify_equivalence(
            pl_module, plan, lambda: pl_module.training_step(batch, batch_idx),
            context=trainer.strategy.precision_plugin.train_step_context, precision=str(trainer.precision))
        self.port.info("verify: every checkpointed block agrees with its plain run\n" + report.table())
