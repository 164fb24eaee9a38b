"""``snapshot_on_oom``: on CUDA, the allocator's own record of the memory, written when the step runs out of it.

PyTorch's caching allocator can record every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``) and dump that history with the live segments as a *snapshot*
(``_dump_snapshot``), which https://pytorch.org/memory_viz opens. Lightning's request for one on out-of-memory is
still open (#16901); torchtitan dumps one and leaves the reading to the user. With ``snapshot_on_oom=True``
(:class:`OOMSnapshot`):

- from ``on_fit_start`` the history is recorded with Python stacks only (``stacks="python"``: C++ frames cost
  more per allocation and are slow to symbolize inside the failing allocation), bounded to ``max_entries`` events
  (the newest kept; 100 000 by default, an int given instead of ``True``);
- an out-of-memory *observer* (``torch._C._cuda_attach_out_of_memory_observer``) runs inside the allocator the moment
  an allocation fails — before the error propagates and before the plugin's recovery releases the failed attempt's
  tensors — and writes ``oom_snapshot_rank{r}.pickle`` beside the logs, one per rank. The allocator calls it on
  *every* failed allocation, also those that are recovered from (cuDNN halving its workspace, the plugin's own
  escalation), so each failure overwrites the file: it always holds the latest failure, and the disk holds at most
  one snapshot per rank;
- the out-of-memory diagnosis (:mod:`lightning_ckpt.lightning.recovery`) names the file only when it shows *this*
  error: the error is the caching allocator's and the allocator has counted no failure since (its ``num_ooms``).
  Otherwise it says that no snapshot matches. A step the plugin retried successfully forgets its snapshot;
- recording stops at the end of the run; the next ``fit`` records again.

Recording costs host time per allocation (a stack is captured each time); it is off by default.
``benchmarks/gpu_check.py`` measures the cost. On the CPU there is no allocator to record, and the
``cudaMallocAsync`` backend cannot record: the option warns once per run and does nothing. The CUDA calls go through
:data:`CUDA_MEMORY`, which a test replaces with a fake (the mechanism is tested on the CPU; the GPU-marked test runs
the real one).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

__all__ = ["CUDA_MEMORY", "DEFAULT_MAX_ENTRIES", "CudaMemoryHistory", "OOMSnapshot"]

DEFAULT_MAX_ENTRIES = 100_000

NO_CUDA = ("lightning_ckpt: snapshot_on_oom=True does nothing here: there is no CUDA allocator to record (the CPU); "
           "drop it, or run on a GPU.")


class CudaMemoryHistory:
    """The CUDA allocator's history API (private in torch; every call is here, so a test can fake them)."""

    available = staticmethod(lambda: __import__("torch").cuda.is_available())

    @staticmethod
    def record(max_entries: Optional[int]) -> None:
        import torch

        if max_entries is None:
            torch.cuda.memory._record_memory_history(enabled=None)
        else:  # Python frames only: the default "all" also captures C++ frames, slower on every allocation
            torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")

    @staticmethod
    def dump(path: str) -> None:
        import torch

        torch.cuda.memory._dump_snapshot(path)

    @staticmethod
    def attach(observer: Callable[..., None]) -> None:
        import torch

        torch._C._cuda_attach_out_of_memory_observer(observer)

    @staticmethod
    def failures(device: Any) -> int:
        """How many allocations have failed on ``device`` so far (the allocator counts before calling observers)."""
        import torch

        return int(torch.cuda.memory_stats(device).get("num_ooms", 0))

    @staticmethod
    def backend() -> str:
        import torch

        return torch.cuda.get_allocator_backend()


CUDA_MEMORY: Any = CudaMemoryHistory
"""What :class:`OOMSnapshot` calls; replace it in a test."""


def _unrecordable(backend: str, err: BaseException) -> str:
    """The warning when the allocator refuses to record: the fix first."""
    if backend != "native":
        return (f"lightning_ckpt: remove backend:{backend} from PYTORCH_CUDA_ALLOC_CONF to get an out-of-memory "
                "snapshot; that allocator cannot record its history, so snapshot_on_oom is off for this run.")
    return (f"lightning_ckpt: snapshot_on_oom is off for this run: the CUDA allocator refused to record its history "
            f"({type(err).__name__}: {err}).")


def _is_allocator_error(err: BaseException) -> bool:
    """The caching allocator raises ``torch.OutOfMemoryError``; cuBLAS, cuDNN and the CPU raise other errors."""
    import torch

    return isinstance(err, getattr(torch, "OutOfMemoryError", ()) or torch.cuda.OutOfMemoryError)


class OOMSnapshot:
    """Record the allocator's history during a run and write a snapshot whenever an allocation fails.

    Args:
        folder: where the snapshot goes (the logs' directory).
        rank: this process's global rank (one file per rank).
        max_entries: the history's bound (the newest events are kept).
    """

    def __init__(self, folder: str, rank: int = 0, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.folder, self.rank, self.max_entries = folder, rank, max_entries
        self.path: Optional[str] = None  # the snapshot of the latest failed allocation, once one is written
        self.error: Optional[str] = None  # why the latest could not be
        self.device: Any = None  # the device of the latest failed allocation
        self.failure: Optional[int] = None  # the allocator's failure count when it was written
        self._recording = False

    @property
    def recording(self) -> bool:
        return self._recording

    def start(self) -> Optional[str]:
        """Record from now on; else (nothing done) the warning that says why not: no CUDA, or a backend that
        cannot record (``cudaMallocAsync`` raises)."""
        api = CUDA_MEMORY
        if not api.available():
            return NO_CUDA
        try:
            api.record(self.max_entries)
        except RuntimeError as err:
            return _unrecordable(api.backend(), err)
        api.attach(self.observer)
        self._recording = True
        return None

    def observer(self, device: Any = None, alloc: Any = None, device_allocated: Any = None,
                 device_free: Any = None) -> None:
        """Called by the allocator when an allocation fails: this rank's snapshot, overwritten by each failure."""
        if not self._recording:
            return
        path = os.path.join(self.folder, f"oom_snapshot_rank{self.rank}.pickle")
        partial = path + ".partial"  # replaced in one step: a failed dump leaves the previous file whole
        self.path = self.error = None  # whatever happens, an older snapshot is not this failure's
        self.device, self.failure = device, self._failures(device)
        try:
            os.makedirs(self.folder, exist_ok=True)
            CUDA_MEMORY.dump(partial)
            os.replace(partial, path)
            self.path = path
        except Exception as err:  # a snapshot that cannot be written must not hide the out-of-memory error
            self.error = f"{type(err).__name__}: {err}"
            with contextlib.suppress(OSError):
                os.remove(partial)

    def _failures(self, device: Any) -> Optional[int]:
        try:
            return CUDA_MEMORY.failures(device)
        except Exception:  # noqa: BLE001 - without the count the snapshot is still named, unchecked
            return None

    def recovered(self) -> None:
        """The failed step was retried and succeeded: its snapshot (left on disk) names no error any more."""
        self.path = self.error = self.failure = None

    def describe(self, err: Optional[BaseException] = None) -> Optional[str]:
        """One line for the diagnosis of ``err``: the snapshot of this error and how to read it, or why none is."""
        if self.path is None and self.error is None:
            return None
        mismatch = self._mismatch(err)
        if mismatch is not None:
            latest = self.path or f"not written: {self.error}"
            return (f"No allocator snapshot shows this error: {mismatch} (the latest snapshot, {latest}, is of an "
                    "earlier failed allocation).")
        if self.path is not None:
            return (f"Allocator snapshot of this rank at the failed allocation: {self.path} (open it at "
                    "https://pytorch.org/memory_viz: every allocation alive, with its Python stack).")
        return f"The allocator snapshot could not be written: {self.error}."

    def _mismatch(self, err: Optional[BaseException]) -> Optional[str]:
        """Why the latest snapshot is not ``err``'s; ``None`` when it is (or nothing says otherwise)."""
        if err is not None and not _is_allocator_error(err):
            return "the error did not come from the caching allocator (a library's own allocation, or the CPU)"
        now = self._failures(self.device) if self.failure is not None else None
        if now is not None and now != self.failure:
            return f"the allocator failed {now - self.failure} more time(s) after the latest snapshot"
        return None

    def stop(self) -> None:
        """Stop recording (the end of the run); a later :meth:`start` records again."""
        if self._recording:
            self._recording = False
            try:
                CUDA_MEMORY.record(None)
            except Exception:  # pragma: no cover - a torch without the history API
                pass
