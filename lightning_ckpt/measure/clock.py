"""Where a step's time comes from: the host's clock, or CUDA events on the device's timeline. Pure torch.

A clock puts a *mark* at each step boundary and turns two marks into seconds with :meth:`elapsed`, cutting out
paused intervals (validation) given as pairs of marks.

- :class:`HostClock` (the CPU, and devices without timing events): ``time.perf_counter``. The host does the work,
  so the host's interval is the step's.
- :class:`EventClock` (CUDA): a mark records a ``torch.cuda.Event(enable_timing=True)`` on the device's current
  stream, an asynchronous enqueue (no host-device synchronization). The interval between two marks is the device
  time between finishing the work enqueued before each: the step's kernels, and the time the device waited for
  the host (data loading, a slow Python step), which a host ``perf_counter`` interval of one step cannot see on an
  asynchronous device (it measures how long the host took to *enqueue* the step). :meth:`~EventClock.elapsed`
  waits for the later mark (one ``event.synchronize()``), so callers read it only on steps whose figures are read;
  a step that is not read costs one event record.

A mark made while the stream is capturing a CUDA graph would be captured into the graph: :class:`EventClock` makes
none then (``None``), and an interval touching it has no time (``None``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, Tuple, Union

import torch

__all__ = ["EventClock", "HostClock", "clock_for"]


class HostClock:
    """Marks are ``time.perf_counter()`` readings."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: Optional[float], end: Optional[float],
                cut: Iterable[Tuple[Any, Any]] = ()) -> Optional[float]:
        """Seconds from ``start`` to ``end`` minus each ``(pause, resume)`` interval in ``cut``."""
        if start is None or end is None:
            return None
        return end - start - sum(r - p for p, r in cut)


class EventClock:
    """Marks are CUDA timing events recorded on the device's current stream (see the module docstring).

    Args:
        device: the CUDA device whose stream is marked.
        new_event: makes an unrecorded event (default ``torch.cuda.Event(enable_timing=True)``); a test passes a fake.
        stream: the stream to record on (default: the device's current stream, read at each mark).
        capturing: whether that stream is capturing a CUDA graph now (default
            ``torch.cuda.is_current_stream_capturing``, a host-side query).
    """

    def __init__(self, device: Union[torch.device, str], new_event: Optional[Callable[[], Any]] = None,
                 stream: Optional[Callable[[], Any]] = None, capturing: Optional[Callable[[], bool]] = None) -> None:
        self.device = torch.device(device)
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or (lambda: torch.cuda.current_stream(self.device))
        self._capturing = capturing or torch.cuda.is_current_stream_capturing

    def mark(self) -> Any:
        if self._capturing():
            return None
        event = self._new_event()
        event.record(self._stream())
        return event

    def elapsed(self, start: Any, end: Any, cut: Iterable[Tuple[Any, Any]] = ()) -> Optional[float]:
        """Seconds of device time from ``start`` to ``end`` minus the ``cut`` intervals; waits for ``end`` once
        (every mark before it on the stream is then complete too)."""
        cut = list(cut)
        if start is None or end is None or any(p is None or r is None for p, r in cut):
            return None
        end.synchronize()
        paused = sum(p.elapsed_time(r) for p, r in cut)
        return (start.elapsed_time(end) - paused) / 1e3


def clock_for(device: Union[torch.device, str]) -> Union[HostClock, EventClock]:
    """CUDA events on a CUDA device, the host's clock elsewhere (the CPU does its own work; other accelerators'
    events are not used yet, so their step times are host intervals)."""
    device = torch.device(device)
    return EventClock(device) if device.type == "cuda" else HostClock()
