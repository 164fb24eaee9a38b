"""``snapshot_on_oom`` (:mod:`lightning_ckpt.lightning.snapshot`): the allocator's record written at the failed
allocation. The CUDA calls are faked on the CPU; the GPU-marked test runs the real ones."""

from __future__ import annotations

import pickle

import pytest
import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything

import lightning_ckpt.lightning.snapshot as snapshot
from lightning_ckpt import ActivationCheckpointing


class FakeHistory:
    """The allocator's history API as a CUDA machine has it, recorded."""

    calls: list = []
    observers: list = []

    @staticmethod
    def available():
        return True

    @classmethod
    def record(cls, max_entries):
        cls.calls.append(("record", max_entries))

    @classmethod
    def dump(cls, path):
        cls.calls.append(("dump", path))
        with open(path, "wb") as fh:
            pickle.dump({"segments": [], "device_traces": [[]]}, fh)

    @classmethod
    def attach(cls, observer):
        cls.observers.append(observer)


class OOMAtStep(TinyTransformer):
    """The allocator fails in the third step's forward: it tells its observers, then raises."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            for observer in FakeHistory.observers:
                observer(0, 4 << 30, 0, 0)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (injected)")
        return super().training_step(batch, batch_idx)


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeHistory.calls, FakeHistory.observers = [], []
    monkeypatch.setattr(snapshot, "CUDA_MEMORY", FakeHistory)
    return FakeHistory


def test_the_snapshot_is_written_at_the_failed_allocation_and_named_in_the_error(tmp_path, fake_cuda):
    seed_everything(0)
    cb = ActivationCheckpointing(policy="none", snapshot_on_oom=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[cb])
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer.fit(OOMAtStep())
    path = tmp_path / "csv" / "version_0" / "oom_snapshot_rank0.pickle"
    assert path.is_file() and pickle.loads(path.read_bytes())["segments"] == []
    assert f"Allocator snapshot of this rank at the failed allocation: {path}" in str(err.value)
    assert "memory_viz" in str(err.value)
    assert fake_cuda.calls == [("record", 100_000), ("dump", str(path)), ("record", None)]  # bounded, then off


def test_a_bound_of_its_own_and_no_snapshot_without_an_error(tmp_path, fake_cuda):
    seed_everything(0)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2),
                      callbacks=[ActivationCheckpointing(policy="all", snapshot_on_oom=5000)])
    trainer.fit(TinyTransformer())
    assert fake_cuda.calls == [("record", 5000), ("record", None)]
    assert not list(tmp_path.rglob("oom_snapshot*"))


@pytest.mark.parametrize("bad", [0, -3, "yes", 2.5])
def test_a_bad_snapshot_on_oom_is_refused_when_the_callback_is_made(bad):
    with pytest.raises(ValueError, match=r"snapshot_on_oom=.* is not valid; pass True"):
        ActivationCheckpointing(snapshot_on_oom=bad)


def test_on_the_cpu_it_warns_that_it_does_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine records")
    seed_everything(0)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=1),
                      callbacks=[ActivationCheckpointing(policy="all", snapshot_on_oom=True)])
    with pytest.warns(UserWarning, match="snapshot_on_oom=True does nothing here: there is no CUDA allocator"):
        trainer.fit(TinyTransformer())


@pytest.mark.gpu
def test_a_real_out_of_memory_writes_a_snapshot_the_memory_viewer_reads(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    class Huge(TinyTransformer):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                free, _ = torch.cuda.mem_get_info()
                torch.empty(free * 2, dtype=torch.uint8, device="cuda")  # more than the card has
            return super().training_step(batch, batch_idx)

    seed_everything(0)
    cb = ActivationCheckpointing(policy="none", snapshot_on_oom=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, accelerator="gpu"), callbacks=[cb])
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer.fit(Huge())
    (path,) = list(tmp_path.rglob("oom_snapshot_rank0.pickle"))
    data = pickle.loads(path.read_bytes())
    assert {"segments", "device_traces"} <= set(data) and data["segments"]  # torch.cuda.memory._snapshot()'s form
    assert str(path) in str(err.value)
