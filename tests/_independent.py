"""The independent reference the activation figures are tested against: PyTorch's ``MemTracker``.

``benchmarks/_common.py`` holds ``ActivationPeakTracker`` (MemTracker with a running peak of its ACT line,
replays counted as ACT); none of it is lightning_ckpt's own tracking code, so a test that compares the meter or
the forecast with it can fail when either is wrong.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable, Tuple

ROOT = Path(__file__).resolve().parents[1]


def benchmark_common():
    """``benchmarks/_common.py`` as a module (loaded once)."""
    name = "_lightning_ckpt_bench_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "_common.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def memtracker_act_peak(step: Callable[[], None], external: Tuple = ()) -> int:
    """The running peak of MemTracker's ACT line over one forward + backward, in bytes."""
    return benchmark_common().measure_memory(step, external=external).act_peak


class LiveForward:
    """An independent live-tensor count: every storage an operator creates while grad mode is on (the forward,
    and the replays of checkpointed regions in backward, which run with grad enabled), until it is freed, with
    the peak of each of two lines: copies of parameters (``_to_copy`` of an ``nn.Parameter``: autocast's
    low-precision weights) and everything else (activations, the loss's upcast temporaries included).

    Written here, not imported from lightning_ckpt, so that a test comparing the meter with it can fail.
    """

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live = {"activations": 0, "copies": 0}
        self.peak = {"activations": 0, "copies": 0}
        self._refs = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if torch.is_grad_enabled():
                    tracker._created(func, args, kwargs, out)
                return out

        self._mode = _Mode()

    def _created(self, func, args, kwargs, out) -> None:
        import weakref

        import torch
        from torch import nn
        from torch.utils._pytree import tree_flatten

        line = "copies" if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter) \
            else "activations"
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr, size = st.data_ptr(), st.nbytes()
            if not ptr or ptr in inputs or ptr in self._refs:
                continue
            self._refs[ptr] = weakref.ref(st, self._on_free(ptr, line, size))
            self.live[line] += size
            self.peak[line] = max(self.peak[line], self.live[line])

    def _on_free(self, ptr, line, size):
        def callback(_):
            if self._refs.pop(ptr, None) is not None:
                self.live[line] -= size

        return callback

    def __enter__(self) -> "LiveForward":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
