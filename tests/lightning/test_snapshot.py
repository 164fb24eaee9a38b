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
from lightning_ckpt.lightning.recovery import StepGuard


class FakeHistory:
    """The allocator's history API as a CUDA machine has it, recorded."""

    calls: list = []
    observers: list = []
    failures_so_far = 0  # the allocator's num_ooms
    refuse: str = ""  # set: record() raises as under PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync

    @staticmethod
    def available():
        return True

    @classmethod
    def record(cls, max_entries):
        if cls.refuse and max_entries is not None:
            raise RuntimeError(cls.refuse)
        cls.calls.append(("record", max_entries))

    @classmethod
    def dump(cls, path):
        cls.calls.append(("dump", path))
        with open(path, "wb") as fh:
            pickle.dump({"segments": [], "device_traces": [[]], "failure": cls.failures_so_far}, fh)

    @classmethod
    def attach(cls, observer):
        cls.observers.append(observer)

    @classmethod
    def failures(cls, device):
        return cls.failures_so_far

    @classmethod
    def backend(cls):
        return "cudaMallocAsync" if cls.refuse else "native"

    @classmethod
    def fail(cls, size=4 << 30, observed=True):
        """An allocation fails: the allocator counts it, tells its observers, and raises."""
        cls.failures_so_far += 1
        for observer in cls.observers if observed else ():
            observer(0, size, 0, 0)
        return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size >> 30}.00 GiB (injected)")


class OOMAtStep(TinyTransformer):
    """The allocator fails in the forward of step ``at`` (every attempt, or only the first: ``once``)."""

    def __init__(self, at=2, once=False, **kw):
        super().__init__(**kw)
        self.at, self.once, self.fired = at, once, False

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.at and not (self.once and self.fired):
            self.fired = True
            raise FakeHistory.fail()
        return super().training_step(batch, batch_idx)


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeHistory.calls, FakeHistory.observers, FakeHistory.failures_so_far, FakeHistory.refuse = [], [], 0, ""
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
    # bounded, written whole (then renamed), then off
    assert fake_cuda.calls == [("record", 100_000), ("dump", f"{path}.partial"), ("record", None)]


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


def test_the_history_records_python_stacks_bounded(monkeypatch):
    """C++ frames (the default "all") cost more per allocation and are slow to symbolize inside the failing one."""
    seen = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: seen.append((a, kw)))
    snapshot.CudaMemoryHistory.record(5000)
    snapshot.CudaMemoryHistory.record(None)
    assert seen == [((), {"max_entries": 5000, "stacks": "python"}), ((), {"enabled": None})]


def test_every_failed_allocation_overwrites_the_snapshot_and_the_latest_is_named(tmp_path, fake_cuda):
    """The allocator tells its observers of failures it recovers from too (cuDNN halving its workspace): the
    snapshot of the fatal one, later, must be the one on disk and in the error."""
    oom = snapshot.OOMSnapshot(str(tmp_path / "logs"))
    assert oom.start() is None and oom.recording
    fake_cuda.fail(1 << 30)  # recovered from by its caller
    error = fake_cuda.fail(4 << 30)  # the one that reaches the user
    path = tmp_path / "logs" / "oom_snapshot_rank0.pickle"
    assert pickle.loads(path.read_bytes())["failure"] == 2
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # one file per rank, nothing half-written left
    assert oom.describe(error).startswith(f"Allocator snapshot of this rank at the failed allocation: {path} ")


def test_no_snapshot_is_named_for_an_error_it_does_not_show(tmp_path, fake_cuda):
    oom = snapshot.OOMSnapshot(str(tmp_path))
    oom.start()
    fake_cuda.fail()
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    text = oom.describe(cublas)
    assert text.startswith("No allocator snapshot shows this error: the error did not come from the caching allocator")
    assert "is of an earlier failed allocation" in text
    unseen = fake_cuda.fail(observed=False)  # a failure the observer did not write (the count moved on)
    assert "the allocator failed 1 more time(s) after the latest snapshot" in oom.describe(unseen)


def test_a_snapshot_that_cannot_be_written_is_said_and_leaves_no_older_one_named(tmp_path, fake_cuda, monkeypatch):
    oom = snapshot.OOMSnapshot(str(tmp_path))
    oom.start()
    fake_cuda.fail()

    def full_disk(path):
        open(path, "wb").close()  # begun, then the disk fills
        raise OSError("No space left on device")

    monkeypatch.setattr(fake_cuda, "dump", full_disk)
    error = fake_cuda.fail()
    assert oom.path is None
    assert oom.describe(error) == "The allocator snapshot could not be written: OSError: No space left on device."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oom_snapshot_rank0.pickle"]  # the older one, whole


def test_a_retried_step_forgets_its_snapshot(tmp_path, fake_cuda):
    seed_everything(0)
    cb = ActivationCheckpointing(policy="none", on_oom="escalate", snapshot_on_oom=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[cb])
    trainer.fit(OOMAtStep(at=1, once=True))
    assert trainer.global_step == 3 and list(tmp_path.rglob("oom_snapshot_rank0.pickle"))
    record = cb._engine.feature(StepGuard).snapshot
    assert record.path is None and record.describe(torch.OutOfMemoryError("x")) is None


def test_a_second_fit_records_again(tmp_path, fake_cuda):
    seed_everything(0)
    cb = ActivationCheckpointing(policy="none", snapshot_on_oom=True)
    Trainer(**trainer_kwargs(tmp_path / "first", max_steps=2), callbacks=[cb]).fit(TinyTransformer())
    with pytest.raises(torch.OutOfMemoryError) as err:
        Trainer(**trainer_kwargs(tmp_path / "second", max_steps=3), callbacks=[cb]).fit(OOMAtStep(at=1))
    path = tmp_path / "second" / "csv" / "version_0" / "oom_snapshot_rank0.pickle"
    assert fake_cuda.calls == [("record", 100_000), ("record", None),
                               ("record", 100_000), ("dump", f"{path}.partial"), ("record", None)]
    assert f"Allocator snapshot of this rank at the failed allocation: {path}" in str(err.value)


def test_an_allocator_that_cannot_record_warns_and_the_run_goes_on(tmp_path, fake_cuda):
    fake_cuda.refuse = "cudaMallocAsync does not yet support checkPoolLiveAllocations"  # torch's TORCH_CHECK text
    seed_everything(0)
    cb = ActivationCheckpointing(policy="none", snapshot_on_oom=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2), callbacks=[cb])
    with pytest.warns(UserWarning, match="remove backend:cudaMallocAsync from PYTORCH_CUDA_ALLOC_CONF to get an "
                                         "out-of-memory snapshot"):
        trainer.fit(TinyTransformer())
    assert trainer.global_step == 2 and not fake_cuda.observers and cb._engine.feature(StepGuard).snapshot is None


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


@pytest.mark.gpu
def test_a_real_recovered_out_of_memory_is_not_the_one_named(tmp_path):
    """The allocator's observer also runs for a failure its caller recovers from; the fatal one's snapshot wins."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    class TwoFailures(TinyTransformer):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                free, _ = torch.cuda.mem_get_info()
                try:
                    torch.empty(free * 2, dtype=torch.uint8, device="cuda")  # caught, as cuDNN's workspace search does
                except torch.OutOfMemoryError:
                    pass
                torch.empty(free * 4, dtype=torch.uint8, device="cuda")
            return super().training_step(batch, batch_idx)

    seed_everything(0)
    cb = ActivationCheckpointing(policy="none", snapshot_on_oom=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, accelerator="gpu"), callbacks=[cb])
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer.fit(TwoFailures())
    (path,) = list(tmp_path.rglob("oom_snapshot_rank0.pickle"))
    traces = pickle.loads(path.read_bytes())["device_traces"]
    failed = [event["size"] for trace in traces for event in trace if event["action"] == "oom"]
    # written at the second (larger) failure, both in its history (an earlier run's may be there too)
    assert len(failed) >= 2 and failed[-1] > failed[-2]
    assert f"Allocator snapshot of this rank at the failed allocation: {path}" in str(err.value)
