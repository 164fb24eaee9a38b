"""Every metric key the callback logs, declared once: its name, unit, how ranks combine it and the chart it is drawn in.

The TensorBoard layout (:func:`tensorboard_layout`), the reduction across ranks (:func:`combines_by_sum`) and the
documentation's list (``docs/measurement.md``, checked against :data:`METRIC_KEYS` by a test) all come from this one
table. A key logged that the table lacks is a bug of the plugin: :func:`unregistered` finds it, and the logging
warns once per key with :class:`UnregisteredMetricKey` (an error in the project's own tests).

Keys are given without the user's ``prefix`` (``prefix="ac"`` logs ``ac/memory/activations_gib``); a per-block key
is a regular expression (``blocks/\\d+_kept_gib``), as TensorBoard's custom-scalars tags are.

How ranks combine: ``max`` (the rank closest to running out is the one that matters: every memory line, the step
time), ``sum`` (the job's throughput) or ``rank`` (this rank's own plan, added after the reduction: every rank runs
the same plan, agreed before the step).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["CHARTS", "METRIC_KEYS", "MetricKey", "UnregisteredMetricKey", "combines_by_sum", "find",
           "tensorboard_layout", "unregistered"]

COMBINE = ("max", "sum", "rank")


class UnregisteredMetricKey(UserWarning):
    """A key was logged that :data:`METRIC_KEYS` lacks (a bug of the plugin: please report it)."""


@dataclass(frozen=True)
class MetricKey:
    """One logged key.

    Attributes:
        name: the key without the prefix; a regular expression when ``pattern`` (one key per block).
        unit: what its value counts (``GiB``, ``tokens/s``, ``samples/s``, ``s``, ``blocks``, ``position``,
            ``samples``, ``tokens``, ``ratio``).
        combine: how ranks combine it: ``max``, ``sum`` or ``rank`` (see the module docstring).
        chart: ``(category, chart title)`` in the TensorBoard layout, or ``None`` (a scalar of its own).
        pattern: ``name`` is a regular expression.
    """

    name: str
    unit: str
    combine: str = "max"
    chart: Optional[Tuple[str, str]] = None
    pattern: bool = False

    def __post_init__(self) -> None:
        if self.combine not in COMBINE:
            raise ValueError(f"combine={self.combine!r}: choose one of {list(COMBINE)}.")

    @property
    def documented_as(self) -> str:
        """How the documentation writes it: a block's number as ``NN``."""
        return self.name.replace(r"\d+", "NN")


_LEDGER = ("Memory", "ledger (GiB)")
_PHASES = ("Phases", "peak per phase (GiB)")
_LEVEL = ("Checkpointing", "blocks and level")

CHARTS: Tuple[Tuple[str, str], ...] = (
    _LEDGER, ("Throughput", "tokens/s"), ("Throughput", "samples/s"), ("Throughput", "step time (s)"), _PHASES,
    _LEVEL, ("Checkpointing", "kept per block (GiB)"), ("Checkpointing", "replay peak per block (GiB)"),
)
"""The layout's charts in the order TensorBoard draws them (categories in their first chart's order)."""

METRIC_KEYS: Tuple[MetricKey, ...] = (
    *(MetricKey(f"memory/{line}_gib", "GiB", chart=_LEDGER) for line in
      ("peak_allocated", "peak_reserved", "activations", "autocast_copies", "params", "grads", "optimizer",
       "optimizer_master", "other", "cache")),
    MetricKey("memory/host_gib", "GiB"),
    MetricKey("throughput/tokens_per_sec", "tokens/s", "sum", ("Throughput", "tokens/s")),
    MetricKey("throughput/samples_per_sec", "samples/s", "sum", ("Throughput", "samples/s")),
    MetricKey("time/step_s", "s", chart=("Throughput", "step time (s)")),
    *(MetricKey(f"memory/peak_{phase}_gib", "GiB", chart=_PHASES) for phase in ("forward", "backward", "optimizer")),
    MetricKey("checkpointing/blocks", "blocks", chart=_LEVEL),
    MetricKey("checkpointing/level", "position", "rank", _LEVEL),
    MetricKey(r"blocks/\d+_kept_gib", "GiB", "rank", ("Checkpointing", "kept per block (GiB)"), pattern=True),
    MetricKey(r"blocks/\d+_replay_gib", "GiB", "rank", ("Checkpointing", "replay peak per block (GiB)"),
              pattern=True),
    MetricKey("shape/samples", "samples", "rank"),
    MetricKey("shape/length", "tokens", "rank"),
    *(MetricKey(f"shape/blocks_{mode}", "blocks", "rank") for mode in ("off", "selective", "recompute")),
    MetricKey("memory/prediction_error_ratio", "ratio", "rank"),
)
"""Every key the callback can log, charted ones in their chart's order."""


def _regex(key: MetricKey) -> str:
    return key.name if key.pattern else re.escape(key.name)


# a prefix is any path before the registered name: "ac/memory/activations_gib", "a/b/memory/activations_gib"
_MATCH = re.compile("(?:.+/)?(?:" + "|".join(f"(?P<k{i}>{_regex(k)})" for i, k in enumerate(METRIC_KEYS)) + ")")


@functools.lru_cache(maxsize=4096)
def find(key: str) -> Optional[MetricKey]:
    """The registry's entry for a logged ``key`` (with or without a prefix), or ``None``."""
    found = _MATCH.fullmatch(key)
    if found is None:
        return None
    return METRIC_KEYS[int(found.lastgroup[1:])]


def combines_by_sum(key: str) -> bool:
    """Whether ranks add ``key`` up (the throughput lines); every other key takes the largest rank's."""
    entry = find(key)
    return entry is not None and entry.combine == "sum"


def unregistered(keys: Iterable[str]) -> List[str]:
    """The ``keys`` :data:`METRIC_KEYS` lacks."""
    return [k for k in keys if find(k) is None]


def tensorboard_layout(prefix: str) -> Dict[str, Dict[str, List[object]]]:
    """The custom-scalars layout: each chart of :data:`CHARTS` a ``Multiline`` of its keys (with ``prefix``)."""
    root = f"{prefix}/" if prefix else ""
    layout: Dict[str, Dict[str, List[object]]] = {}
    for category, title in CHARTS:
        tags = [f"{root}{k.name}" for k in METRIC_KEYS if k.chart == (category, title)]
        layout.setdefault(category, {})[title] = ["Multiline", tags]
    return layout
