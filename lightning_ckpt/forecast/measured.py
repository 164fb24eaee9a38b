"""Remedies priced from a training run's measured ledger: which line crosses the card and what fixes it, for the
end-of-fit report and the out-of-memory diagnosis.

``plan --remedies`` prices the remedies before a run, from numbers or a traced model. Here the same rows
(:func:`lightning_ckpt.forecast.remedies.remedies`) are priced from what a run measured: its parameters, gradients,
optimizer state and master copy as the ledger walked their storages, its activations and phase peaks as the meter
read them, under the run's own plan (:meth:`~lightning_ckpt.forecast.remedies.Job.from_ledger`). :func:`run_facts`
reads what the ledger does not say (element counts, the width, the optimizer's kind) from the model and its
optimizers; :func:`measured_remedies` returns the report's JSON section (``remedies``, ``recommended``,
``recommended_any``, as ``plan --remedies --json`` names them, and ``remedy``: the line and the sentence);
:func:`oom_sentence` says the same in one or two sentences for an out-of-memory error, the fix first (before any
step was measured, from the model state walked at the error with the optimizer's first state counted as it will be
allocated: :func:`state_to_come`).

The line read is the one that crosses the capacity (the largest line when the lines together pass it, else the
transient of the phase that peaks above it), with the two recommendations of ``plan``: the cheapest row that
fits without changing the training, and the cheapest that fits at all. When nothing crosses, or the capacity is not
known (a CPU run without ``capacity=``: then no row can be said to fit, ``fits`` and ``recommended`` are ``None``
and the rows are priced against the measured peak), it is the largest line, with the cheapest row that shrinks it
and lowers the peak.

Known limits: the width and one block's interior are read, not traced (the rows that use them — blocks gathered in
flight by sharding, LoRA's adapters, Adafactor's factored state, activation offload — follow the GPT-2 layout, as
``plan --params`` does); the run's own plan is the only checkpointing policy priced (its activations are the only
ones measured; ``plan --model`` prices the others); a sharded run's ledger is one rank's, priced as one GPU's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.forecast.numbers import PHASE_LINES
from lightning_ckpt.forecast.remedies import Job, Remedy, RunFacts, cost_text, recommend, remedies

__all__ = ["STATE_ORDER", "measured_remedies", "oom_sentence", "optimizer_kind", "run_facts", "state_to_come"]

STATE_ORDER = ("parameters", "gradients", "optimizer state", "master copy", "in flight", "activations")
"""The GPU's lines of a row, whose total is held against the capacity."""
_MODEL_STATE = STATE_ORDER[:5]


def optimizer_kind(optimizers: Iterable[Any]) -> str:
    """The optimizers' kind as ``plan --optimizer`` names it: the class name lower-cased (``"adamw"``,
    ``"adamw8bit"``), ``"momentum"`` for an SGD with momentum, several joined with ``+``; ``""`` for none."""
    kinds = set()
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # Lightning's LightningOptimizer wraps the optimizer
        name = type(opt).__name__.lower()
        if name == "sgd" and any(g.get("momentum", 0) for g in getattr(opt, "param_groups", ())):
            name = "momentum"
        kinds.add(name)
    return "+".join(sorted(kinds))


def state_to_come(optimizers: Iterable[Any]) -> int:
    """Bytes the optimizers have yet to allocate at their first ``step()``: for torch's Adam and AdamW two moments,
    for SGD with momentum one buffer, each like its parameter, for every trainable parameter without state yet
    (other optimizers: 0, not guessed)."""
    total = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        per = _lazy_moments(opt)
        state = getattr(opt, "state", {})
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                if per and p.requires_grad and not state.get(p):
                    local = getattr(p, "_local_tensor", p)
                    total += per * local.numel() * local.element_size()
    return total


def _lazy_moments(opt: Any) -> int:
    """State tensors like its parameter that ``opt`` allocates per parameter at its first step (torch's Adam and
    AdamW and their subclasses: two moments; SGD with momentum: one buffer; others: 0, not guessed)."""
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return 2
    if isinstance(opt, torch.optim.SGD):
        return int(any(g.get("momentum", 0) for g in opt.param_groups))
    return 0


def run_facts(model: nn.Module, optimizers: Iterable[Any], blocks: int, micro_batch: int, policy: str,
              recompute: float, zero_grad_before_forward: bool = False) -> RunFacts:
    """What :meth:`Job.from_ledger` needs beside the ledger, read from ``model`` and its ``optimizers`` (element
    counts of this process's parameters, a DTensor's local shard; the width is the dimension most frequent among
    the parameters' shapes: a transformer's hidden width) and given by the caller (the plan's ``blocks``, its
    name and the share it checkpoints, the largest micro-batch's samples)."""
    params = trainable = 0
    dims: Counter = Counter()
    dtypes: Counter = Counter()
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        n = local.numel()
        params += n
        trainable += n if p.requires_grad else 0
        dtypes[str(local.dtype).replace("torch.", "")] += n
        dims.update(d for d in p.shape if d > 1)
    width = dims.most_common(1)[0][0] if dims else 1
    return RunFacts(params=params, trainable=trainable, width=width, blocks=blocks, micro_batch=micro_batch,
                    policy=policy, recompute=recompute, optimizer=optimizer_kind(optimizers) or "none",
                    param_dtype=dtypes.most_common(1)[0][0] if dtypes else "float32",
                    zero_grad_before_forward=zero_grad_before_forward)


@dataclass(frozen=True)
class _Reading:
    line: str
    crosses: bool
    first: Optional[Remedy]
    second: Optional[Remedy]


def _crossing(own: Remedy, capacity: Optional[int]) -> Tuple[str, bool]:
    """The line that crosses ``capacity`` — the largest, when the lines together pass it (which of them is added
    last is an accident of order; the largest is the one whose remedy moves the most), else the transient of the
    phase that peaks above it — or the largest line when nothing crosses or the capacity is not known."""
    largest = max(STATE_ORDER, key=lambda name: own.lines[name])
    if capacity is None:
        return largest, False
    if sum(own.lines[name] for name in STATE_ORDER) > capacity:
        return largest, True
    if own.peak > capacity:
        return PHASE_LINES[max(own.phases, key=own.phases.get)], True
    return largest, False


def _cheapest(rows: List[Remedy]) -> Tuple[Optional[Remedy], Optional[Remedy]]:
    """The cheapest of ``rows`` that keeps the training, and the cheapest at all (``plan``'s order of price)."""
    keep = [r for r in rows if not r.changes_training]
    return (min(keep, key=Remedy.price_key) if keep else None, min(rows, key=Remedy.price_key) if rows else None)


def _read(rows: List[Remedy], capacity: Optional[int]) -> _Reading:
    own = rows[0]
    line, crosses = _crossing(own, capacity)
    if crosses:
        keep, any_ = recommend(rows)
    else:  # the rows that shrink the line and lower the peak (none may be over a known capacity)
        keep, any_ = _cheapest([r for r in rows[1:] if r.fits is not False and r.peak < own.peak
                                and (line not in own.lines or r.lines[line] < own.lines[line])])
    first = keep or any_
    return _Reading(line, crosses, first, any_ if any_ is not None and any_ is not first else None)


def _effect(row: Remedy, own: Remedy, line: str, capacity: Optional[int]) -> str:
    """``'<row> takes it from a to b and the peak to p: fits (cost; changes; how)'``."""
    peak = f"the peak to {format_bytes(row.peak)}" if capacity else \
        f"the peak from {format_bytes(own.peak)} to {format_bytes(row.peak)}"
    if line in own.lines:
        before, after = own.lines[line], row.lines[line]
        to = "0 B (on the host)" if not after and row.lines["host"] else format_bytes(after)
        text = f"{row.name} takes it from {format_bytes(before)} to {to} and {peak}"
    else:
        text = f"{row.name} takes {peak}"
    text += {True: ": fits", False: ": still does not fit", None: ""}[row.fits]
    notes = [cost_text(row)] if cost_text(row) != "nothing" else []
    notes += list(row.changes)
    notes += [row.how] if row.how else []
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _sentence(reading: _Reading, rows: List[Remedy], capacity: Optional[int]) -> str:
    """The report's words: the line that crosses (or the largest), the row to try first and the cheapest at all."""
    own, line, first, second = rows[0], reading.line, reading.first, reading.second
    state = line in _MODEL_STATE
    if reading.crosses:
        text = f"The {line} line crosses {format_bytes(capacity)}" + (": checkpointing cannot help." if state else ".")
        if first is None:
            lowest = min(rows, key=lambda r: r.peak)
            return text + (f" No remedy priced here fits: the lowest peak is {lowest.name}'s, "
                           f"{format_bytes(lowest.peak)}.")
        text += f" Try first: {_effect(first, own, line, capacity)}."
    elif capacity:
        text = (f"Nothing crosses {format_bytes(capacity)}: the step peaks at {format_bytes(own.peak)} "
                f"({own.peak / capacity:.0%}), and its largest line is {line} ({format_bytes(own.lines[line])}).")
        if first is not None:
            text += f" To shrink it: {_effect(first, own, line, capacity)}."
    else:
        text = (f"The device's capacity is not known here (pass capacity= to the callback), so no remedy can be said "
                f"to fit; the largest line is {line} ({format_bytes(own.lines[line])}), priced against the measured "
                f"peak of {format_bytes(own.peak)}.")
        if first is not None:
            text += f" To shrink it: {_effect(first, own, line, capacity)}."
    if second is not None:
        text += f" Cheapest if the training may change: {_effect(second, own, line, capacity)}."
    return text


def _price(ledger: Any, facts: RunFacts, capacity: Optional[int], lora_rank: int
           ) -> Tuple[List[Remedy], _Reading, Optional[int]]:
    job = Job.from_ledger(ledger, facts, capacity)
    rows = remedies(job, lora_rank)
    return rows, _read(rows, job.capacity), job.capacity


def measured_remedies(ledger: Any, facts: RunFacts, capacity: Optional[int] = None,
                      lora_rank: int = 16) -> Optional[Dict[str, Any]]:
    """The report's section for a measured ``ledger`` (:class:`~lightning_ckpt.measure.ledger.Ledger`): every
    remedy's row (``remedies``: ``name``, ``lines``, ``phases``, ``peak``, ``fits``, ``cost``,
    ``changes_training``, ``changes``, ``how``; the first is the run as it is), ``recommended`` and
    ``recommended_any`` (names, ``None`` when no row fits or the capacity is not known) and ``remedy``: the
    ``line`` read, whether it ``crosses``, its ``bytes``, the ``capacity``, the run's ``peak``, the rows named
    (``first``, ``second``) and the ``sentence``. ``None`` without parameters."""
    if facts.params <= 0:
        return None
    rows, reading, cap = _price(ledger, facts, capacity, lora_rank)
    keep, any_ = recommend(rows)
    own = rows[0]
    return {
        "remedies": [r.as_json() for r in rows],
        "recommended": keep and keep.name,
        "recommended_any": any_ and any_.name,
        "remedy": {"line": reading.line, "crosses": reading.crosses, "bytes": own.lines.get(reading.line),
                   "capacity": cap, "peak": own.peak, "first": reading.first and reading.first.name,
                   "second": reading.second and reading.second.name, "sentence": _sentence(reading, rows, cap)},
    }


def oom_sentence(ledger: Any, facts: RunFacts, capacity: Optional[int] = None, lora_rank: int = 16,
                 measured: bool = True) -> Optional[str]:
    """One or two sentences for an out-of-memory error, the fix first: the row to try (with where to switch it on)
    and what it does to the line that crosses in the last measured step's ``ledger`` (or to its largest line, when
    that step fit: then this step was larger). ``measured=False``: ``ledger`` is the model state walked at the error,
    before any step was measured (the optimizer's first state counted as it will be allocated, no activations).
    ``None`` when no row helps."""
    if facts.params <= 0:
        return None
    rows, reading, cap = _price(ledger, facts, capacity, lora_rank)
    own, row, line = rows[0], reading.first, reading.line
    if row is None:
        return None
    fix = f"{row.name} ({row.how})" if row.how else row.name
    after = row.lines.get(line)
    to = "0 B (on the host)" if after == 0 and row.lines["host"] else format_bytes(after or 0)
    change = (f"from {format_bytes(own.lines[line])} to {to} and the step's peak from "
              f"{format_bytes(own.peak)} to {format_bytes(row.peak)}") if after is not None else \
        f"the step's peak from {format_bytes(own.peak)} to {format_bytes(row.peak)}"
    changes = f" It changes the training: {'; '.join(row.changes)}." if row.changes else ""
    where = "the last measured step" if measured else "this run's model state (no step measured yet)"
    if reading.crosses:
        return (f"Try {fix} first: in {where} the {line} line crosses {format_bytes(cap)}, and it "
                f"takes that line {change}, which fits.{changes}")
    return f"To make room, try {fix}: it takes the largest line of {where}, {line}, {change}.{changes}"
