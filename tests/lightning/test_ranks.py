"""``lightning_ckpt.lightning.ranks``: the engine's gloo group, and the reduction of host figures through it (no
device copy, no wait for the device), in one process on a one-rank group (an in-memory store: no network)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from _lightning_models import CleanDistributedExit, TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from torch.overrides import TorchFunctionMode

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.lightning.metrics import reduce_across_ranks
from lightning_ckpt.lightning.ranks import HostGroup


class _Trainer:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


class _Strategy:
    """Two ranks as the strategy sees them; its own collective must not be used when a host group is given."""

    world_size = 2
    root_device = torch.device("cpu")

    def all_gather(self, tensor):
        raise AssertionError("the strategy's collective was used: it goes through the device")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_process_makes_no_group():
    assert HostGroup().setup(_Trainer(world_size=1)) is None


def test_the_group_is_made_once_where_torch_distributed_runs(one_rank):
    ranks = HostGroup()
    group = ranks.setup(_Trainer(world_size=2))
    assert group is not None and ranks.setup(_Trainer(world_size=2)) is group
    assert dist.get_backend(group) == "gloo"
    ranks.close()
    assert ranks.group is None


def test_figures_reduced_over_the_host_group_never_touch_the_device_or_the_strategy(one_rank):
    """The old reduction had no host path: every decision step went through the strategy's (NCCL) collective and a
    copy back that waits for the whole step on a GPU."""

    class Moves(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.moved = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.moved += func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
            return func(*args, **(kwargs or {}))

    group = HostGroup().setup(_Trainer(world_size=2))
    mine = {"memory/activations_gib": 1.5, "throughput/tokens_per_sec": 100.0}
    with Moves() as moves:
        reduced = reduce_across_ranks(_Strategy(), dict(mine), group=group)
    assert reduced == mine and moves.moved == 0


class _GathersPerStep(Callback):
    """Per optimizer step on each rank: whether the engine decided or logged, and each ``all_gather`` the plugin made
    with whether it went over the engine's host group; written per rank."""

    def __init__(self, cb, folder: str) -> None:
        self.cb, self.folder, self.calls, self.rows = cb, folder, [], []

    def setup(self, trainer, pl_module, stage):
        gather = dist.all_gather

        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = getattr(self.cb._engine, "ranks", None)
            self.calls.append(group is not None and ranks is not None and group is ranks.group)
            return gather(*args, **kwargs)

        dist.all_gather = recorded
        self._restore = lambda: setattr(dist, "all_gather", gather)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        measurement = self.cb._engine.measurement
        self.rows.append({"deciding": measurement.deciding, "logging": measurement.logging, "host": list(self.calls)})

    def on_train_end(self, trainer, pl_module):
        self._restore()
        with open(f"{self.folder}/rank{trainer.global_rank}.json", "w") as fh:
            json.dump(self.rows, fh)


@pytest.mark.slow
def test_under_ddp_the_auto_toggle_agrees_on_the_host_group_every_step_it_decides(tmp_path):
    """Two ranks, the auto-toggle deciding every step and logging every fourth: every step's one collective goes over
    the engine's gloo group (on a GPU the strategy's NCCL one would wait for the step on every decision); the old
    engine had no host group."""
    cb = ActivationCheckpointing(policy="every:2", auto_threshold="1GiB", decide_every_n_steps=1)
    seen = _GathersPerStep(cb, str(tmp_path))
    Trainer(callbacks=[cb, seen, CleanDistributedExit()],
            **trainer_kwargs(tmp_path, strategy="ddp_spawn", devices=2, max_steps=4, log_every_n_steps=4,
                             limit_val_batches=0, num_sanity_val_steps=0)).fit(TinyTransformer(batch_size=4))
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(rows) == 4 and all(r["deciding"] for r in rows), rows
        assert any(not r["logging"] for r in rows), rows  # decision-only steps are among them
        assert all(r["host"] == [True] for r in rows), rows
