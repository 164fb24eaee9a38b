"""Train a tiny Transformer sharded with FSDP2 (``fully_shard`` per block, then the root) through Lightning's
``ModelParallelStrategy`` on 2 CPU processes (gloo), with lightning_ckpt's callback; rank 0 writes each step's
full gradients (``full_tensor()``) and the final plan to ``--out``. Run by ``tests/lightning/test_fsdp2.py``:

    python tests/fsdp2_script.py --policies "none;all;every:2" --out results.pt [--plan-first]

The Lightning launcher re-runs this script for rank 1 with the same arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _lightning_models import TinyTransformer, trainer_kwargs  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from lightning_ckpt import ActivationCheckpointing, apply_policy  # noqa: E402


class Sharded(TinyTransformer):
    """Shards each block, then the root, in ``configure_model`` (the FSDP2 recipe)."""

    def __init__(self, plan_first: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.plan_first = plan_first

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        if self.plan_first:  # the user applied a plan before sharding; the callback re-targets it afterwards
            apply_policy(self, "all")
        mesh = self.device_mesh["data_parallel"] if self.device_mesh.mesh_dim_names else self.device_mesh
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def train_dataloader(self):
        from _lightning_models import token_dataset
        from torch.utils.data import DataLoader

        dataset = token_dataset(self.hparams.n_samples, 0)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(torch.utils.data.Subset(dataset, range(rank, len(dataset), world)),
                          batch_size=self.hparams.batch_size)


class FullGrads(Callback):
    def __init__(self) -> None:
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = {}
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = grad.detach().clone()
        self.steps.append(grads)


def _fit(args, policy: str, out_dir: str) -> dict:
    seed_everything(0)
    model = Sharded(plan_first=args.plan_first, build_in="configure_model", optimizer="sgd", lr=0.1, batch_size=4,
                    n_samples=64)
    if policy == "auto":  # auto-toggle from none, a 1-byte threshold: up one rung per step
        kwargs = dict(auto_threshold=1, cooldown=100)
    elif policy.startswith("budget"):
        kwargs = dict(policy=policy)
    else:
        kwargs = dict(policy=policy)
    cb = ActivationCheckpointing(**kwargs)
    grads = FullGrads()
    trainer = Trainer(callbacks=[cb, grads],
                      **trainer_kwargs(out_dir, strategy=ModelParallelStrategy(), devices=2, max_steps=args.steps,
                                       limit_val_batches=0, num_sanity_val_steps=0,
                                       accumulate_grad_batches=args.accumulate, log_every_n_steps=1,
                                       use_distributed_sampler=False))
    try:
        trainer.fit(model)
    except Exception as err:  # noqa: BLE001 - a refusal is a result
        return {"error": f"{type(err).__name__}: {err}"}
    return {"grads": grads.steps, "modes": list(cb.plan.modes), "spec": cb.plan.spec,
            "activations": cb.last_metrics.get("memory/activations_gib"), "rank": trainer.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policies", default="none")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--plan-first", action="store_true")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    results = {policy: _fit(args, policy, os.path.join(out_dir, policy.replace(":", "_")))
               for policy in args.policies.split(";")}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(results, args.out)
    # Lightning leaves the gloo group alive; a rank exiting while its peer still holds the connection can abort in
    # gloo's threads ("terminate called without an active exception": once in a clean-clone run, 2026-12-04)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
