"""A plain LightningCLI script with no lightning_ckpt code: the plugin arrives through flags or YAML only.

After the run it writes what actually happened to ``$LIGHTNING_CKPT_REPORT`` (JSON): the plan found on the
model (policy, per-block modes, summary), how often each block's forward ran per training step, and the
callbacks and strategy the CLI built. Used by ``tests/test_cli.py``.
"""

import json
import os
import sys

from lightning.pytorch import Callback
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lightning_models import TinyTransformer, TokenDataModule  # noqa: E402


class _StepCalls(Callback):
    def __init__(self):
        self.per_step = []

    def on_train_batch_start(self, trainer, pl_module, *args):
        self._before = pl_module.block_calls()

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.per_step.append([a - b for a, b in zip(pl_module.block_calls(), self._before)])


def main() -> None:
    calls = _StepCalls()
    cli = LightningCLI(
        TinyTransformer,
        TokenDataModule,
        trainer_defaults={"callbacks": [calls], "enable_progress_bar": False, "logger": False},
        save_config_kwargs={"overwrite": True},
    )
    plan = getattr(cli.model, "_lightning_ckpt_plan", None)
    report = {
        "plan": None if plan is None else plan.state_dict(),
        "summary": None if plan is None else plan.summary(),
        "per_step": calls.per_step,
        "callbacks": [type(cb).__name__ for cb in cli.trainer.callbacks],
        "strategy": type(cli.trainer.strategy).__name__,
        "ckpt_path": cli.trainer.checkpoint_callback.best_model_path
        if cli.trainer.checkpoint_callback
        else None,
    }
    with open(os.environ["LIGHTNING_CKPT_REPORT"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
