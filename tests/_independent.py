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
