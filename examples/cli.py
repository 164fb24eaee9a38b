"""A plain LightningCLI script for the demo GPT; the plugin is switched on from config or flags.

    python examples/cli.py fit --config examples/config.yaml
    python examples/cli.py fit --trainer.callbacks+=lightning_ckpt.ActivationCheckpointing \\
                               --trainer.callbacks.policy=selective --trainer.max_steps=20
    python examples/cli.py fit --help
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import lightning_ckpt  # noqa: F401
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.cli import LightningCLI

from lightning_ckpt.demos import CharDataModule, GPTLightningModule


def main() -> None:
    # overwrite=True: rerunning into the same log directory should not abort on config.yaml.
    LightningCLI(GPTLightningModule, CharDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
