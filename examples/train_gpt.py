"""Train the demo GPT on the bundled essay with activation checkpointing.

Runs in well under two minutes on two CPU cores::

    python examples/train_gpt.py                       # every second block recomputed
    python examples/train_gpt.py --policy all --max-steps 30
    python examples/train_gpt.py --policy none         # measure only, for comparison
    python examples/train_gpt.py --auto-threshold 8MiB --log-every 1   # start plain, checkpoint when needed
    tensorboard --logdir runs                          # memory and throughput curves

On a CPU the memory curves are small and the allocator lines are absent; the run shows that the
blocks are found, wrapped and trained. Use ``--accelerator gpu`` for real memory numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import lightning_ckpt  # noqa: F401
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.demos import CharDataModule, GPTLightningModule

# logged by the demo modules' validation_step (torchmetrics objects: see lightning_ckpt/demos/lightning_gpt.py)
VAL_METRICS = ("val_ppl", "val_acc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; model size flags default to a CPU-friendly GPT."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="every:2", help="checkpointing policy string, e.g. none, all, every:2")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--logdir", default="runs", help="TensorBoard root directory")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--auto-threshold", default=None,
                   help="raise checkpointing when the activation peak crosses this size (e.g. 8MiB)")
    p.add_argument("--log-every", type=int, default=5, help="log_every_n_steps")
    return p.parse_args(argv)


def build_gpt(args: argparse.Namespace) -> GPTLightningModule:
    return GPTLightningModule(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, dropout=0.1)


def main(argv: list[str] | None = None, build_model=build_gpt, run_name: str = "gpt") -> None:
    """Train ``build_model(args)`` on the bundled text; ``examples/hf_model.py`` reuses this with GPT-2."""
    args = parse_args(argv)
    seed_everything(args.seed)
    model = build_model(args)
    data = CharDataModule(batch_size=args.batch_size, seq_len=args.seq_len)
    if args.auto_threshold is None:
        callback = ActivationCheckpointing(policy=args.policy)
    else:  # the ladder none -> every:2 -> all, starting at the bottom
        callback = ActivationCheckpointing(auto_threshold=args.auto_threshold)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.max_steps,
        callbacks=[callback],
        logger=TensorBoardLogger(args.logdir, name=run_name),
        log_every_n_steps=args.log_every,
        # Validate on a step schedule: a short run would otherwise never reach an epoch end.
        val_check_interval=min(20, args.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=4,
    )
    trainer.fit(model, datamodule=data)
    report(trainer, callback)


def report(trainer: Trainer, callback: ActivationCheckpointing) -> None:
    """Print the final losses, perplexity and accuracy and, when the callback exposes one, its checkpointing plan."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("loss") or k in VAL_METRICS}
    print("final metrics:", ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    plan = getattr(callback, "plan", None)
    if plan is not None:
        print(plan.summary())
    if trainer.logger is not None:
        print(f"TensorBoard logs: tensorboard --logdir {trainer.logger.save_dir}")


if __name__ == "__main__":
    main()
