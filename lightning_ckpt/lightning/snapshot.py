"""``snapshot_on_oom``: on CUDA, the allocator's own record of the memory, written when the step runs out of it.

PyTorch's caching allocator can record every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``) and dump that history with the live segments as a *snapshot*
(``_dump_snapshot``), which https://pytorch.org/memory_viz opens. Lightning's request for one on out-of-memory is
still open (#16901); torchtitan dumps one and leaves the reading to the user. With ``snapshot_on_oom=True``
(:class:`OOMSnapshot`):

- from ``on_fit_start`` the history is recorded, bounded to ``max_entries`` events (the newest kept; 100 000 by
  default, an int given instead of ``True``);
- an out-of-memory *observer* (``torch._C._cuda_attach_out_of_memory_observer``) runs inside the allocator the moment
  an allocation fails — before the error propagates and before the plugin's recovery releases the failed attempt's
  tensors — and writes ``oom_snapshot_rank{r}.pickle`` beside the logs, one per rank;
- the out-of-memory diagnosis names the file (:mod:`lightning_ckpt.lightning.recovery`);
- recording stops at the end of the run.

Recording costs host time per allocation (a stack is captured each time); it is off by default. Its cost has not
been measured here (no GPU was available); ``benchmarks/gpu_check.py`` is where it will be. On the CPU there is no
allocator to record: the option warns once and does nothing. The CUDA calls go through :data:`CUDA_MEMORY`, which a
test replaces with a fake (the mechanism is tested on the CPU; the GPU-marked test runs the real one).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

__all__ = ["CUDA_MEMORY", "DEFAULT_MAX_ENTRIES", "CudaMemoryHistory", "OOMSnapshot"]

DEFAULT_MAX_ENTRIES = 100_000


class CudaMemoryHistory:
    """The CUDA allocator's history API (private in torch; every call is here, so a test can fake them)."""

    available = staticmethod(lambda: __import__("torch").cuda.is_available())

    @staticmethod
    def record(max_entries: Optional[int]) -> None:
        import torch

        if max_entries is None:
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            torch.cuda.memory._record_memory_history(max_entries=max_entries)

    @staticmethod
    def dump(path: str) -> None:
        import torch

        torch.cuda.memory._dump_snapshot(path)

    @staticmethod
    def attach(observer: Callable[..., None]) -> None:
        import torch

        torch._C._cuda_attach_out_of_memory_observer(observer)


CUDA_MEMORY: Any = CudaMemoryHistory
"""What :class:`OOMSnapshot` calls; replace it in a test."""


class OOMSnapshot:
    """Record the allocator's history during a run and write a snapshot when it runs out of memory.

    Args:
        folder: where the snapshot goes (the logs' directory).
        rank: this process's global rank (one file per rank).
        max_entries: the history's bound (the newest events are kept).
    """

    def __init__(self, folder: str, rank: int = 0, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.folder, self.rank, self.max_entries = folder, rank, max_entries
        self.path: Optional[str] = None  # the snapshot written, once one is
        self.error: Optional[str] = None  # why it could not be
        self._recording = False

    def start(self) -> bool:
        """Record from now on; ``False`` (and nothing done) without CUDA."""
        api = CUDA_MEMORY
        if not api.available():
            return False
        api.record(self.max_entries)
        api.attach(self.observer)
        self._recording = True
        return True

    def observer(self, device: Any = None, alloc: Any = None, device_allocated: Any = None,
                 device_free: Any = None) -> None:
        """Called by the allocator when an allocation fails: write this rank's snapshot (the first failure's)."""
        if not self._recording or self.path is not None:
            return
        path = os.path.join(self.folder, f"oom_snapshot_rank{self.rank}.pickle")
        try:
            os.makedirs(self.folder, exist_ok=True)
            CUDA_MEMORY.dump(path)
            self.path = path
        except Exception as err:  # a snapshot that cannot be written must not hide the out-of-memory error
            self.error = f"{type(err).__name__}: {err}"

    def describe(self) -> Optional[str]:
        """One line for the diagnosis: where the snapshot is and how to read it."""
        if self.path is not None:
            return (f"Allocator snapshot of this rank at the failed allocation: {self.path} (open it at "
                    "https://pytorch.org/memory_viz: every allocation alive, with its Python stack).")
        if self.error is not None:
            return f"The allocator snapshot could not be written: {self.error}."
        return None

    def stop(self) -> None:
        """Stop recording (the end of the run)."""
        if self._recording:
            self._recording = False
            try:
                CUDA_MEMORY.record(None)
            except Exception:  # pragma: no cover - a torch without the history API
                pass
