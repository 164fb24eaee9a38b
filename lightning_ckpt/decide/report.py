"""The end-of-fit ledger report: each line in the unit that fits, % of capacity, the dominant line, the seed's advice.

"The useful question is never 'which memory trick should we enable?' It is 'which line in the ledger is
crossing the capacity limit?'" — :func:`ledger_report` answers it from the measured ledger, and says whether
activation checkpointing is the right lever at all. Pure torch-free formatting; the callback prints it on rank
zero and writes the JSON beside the logs.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightning_ckpt.core.units import GiB, format_bytes, unit_for
from lightning_ckpt.measure.ledger import Ledger

__all__ = ["copies_advice", "ledger_report", "length_reading", "loglog_slope", "phase_advice", "report_text",
           "suggest_policy"]

_FRAGMENTATION_SHARE = 0.25  # reserved − allocated above this share of reserved reads as fragmentation
_COPIES_SHARE = 0.25  # autocast copies above this share of the activation line are worth a sentence


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) on log(x): 1 = proportional, 2 = grows with the square."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den


def length_reading(points: Sequence[Tuple[int, float]]) -> Optional[str]:
    """The seed's reading of activation bytes per sample against sequence length, when lengths varied.

    ``points``: (sequence length, activation bytes per sample) of measured steps; ``None`` with fewer than two
    distinct lengths.
    """
    k = loglog_slope([p[0] for p in points], [p[1] for p in points])
    if k is None:
        return None
    if k >= 1.5:
        return (f"Activation bytes per sample grow with the square of sequence length (log-log slope {k:.2f} over "
                f"lengths {sorted({p[0] for p in points})}): a materialized attention matrix; use a fused "
                "attention kernel (scaled_dot_product_attention / flash) before checkpointing more.")
    return (f"Activation bytes per sample grow about linearly with sequence length (log-log slope {k:.2f}): no "
            "attention matrix is materialized.")


def suggest_policy(current: str, ladder: Sequence[str], all_checkpointed: bool = False) -> str:
    """The next rung up from ``current``: the measured lever for activations.

    A policy off the ladder (a budget plan, explicit modes) moves to the ladder's top unless every block is
    already checkpointed; past the top come ``offload``, then a smaller micro-batch.
    """
    ladder = list(ladder)
    if current in ladder and ladder.index(current) + 1 < len(ladder):
        return ladder[ladder.index(current) + 1]
    if current not in ladder and not all_checkpointed:
        return ladder[-1]
    return "offload" if current != "offload" else "a smaller micro-batch with gradient accumulation"


def copies_advice(ledger: Ledger) -> Optional[str]:
    """What to do when autocast's weight copies are large next to the activations (``None`` when they are not)."""
    copies, act = ledger.autocast_copies or 0, ledger.activations or 0
    if not copies or copies < _COPIES_SHARE * act:
        return None
    share = f"{copies / act:.0%} of" if act else "more than"
    return (f"Autocast's low-precision copies of the weights peak at {format_bytes(copies)} ({share} the activation "
            "line): checkpointing cannot remove them. Training in bf16-true, or FSDP mixed precision with bf16 "
            f"parameters, makes no copies (saves up to {format_bytes(copies)}); with autocast's weight cache off "
            "(Lightning's bf16-mixed) only the copies saved for backward stay alive, and checkpointing does shrink "
            "those.")


def phase_advice(ledger: Ledger) -> Optional[str]:
    """The seed's advice for the phase in which the step peaks (``None`` without phase peaks).

    Optimizer phase: checkpointing will not help; backward: the replay transient or the gradients; forward: the
    activations.
    """
    phase = ledger.peak_phase
    if phase is None:
        return None
    peaks = ledger.phase_peaks or {}
    dominant = ledger.phase_dominant(phase)
    head = (f"The step peaks in the {phase} phase ({format_bytes(peaks[phase])}; "
            + ", ".join(f"{name} {format_bytes(v)}" for name, v in peaks.items() if name != phase)
            + f"), where the {dominant} line is the largest.")
    if phase == "optimizer":
        return (head + " Checkpointing will not help here: the model state and the update's temporaries peak after "
                "every activation is freed. Use a fused optimizer step (AdamW(fused=True) holds no parameter-sized "
                "temporaries, foreach=True holds one), a smaller optimizer state, sharding or offload.")
    if phase == "backward":
        return (head + " In backward, gradients build while activations are freed and each checkpointed region's "
                "replay adds its interior: use smaller regions (no 'group:K'), or shard or accumulate the "
                "gradients in a lower precision when the grads line leads.")
    if dominant in _STATE_REMEDY:  # the seed: "if the bottleneck is optimizer state, checkpointing is the wrong tool"
        return (head + f" Checkpointing lowers only the activations here, not the {dominant} line: "
                f"{_STATE_REMEDY[dominant]}.")
    return head + " In the forward the activations pile up: checkpointing (or a smaller micro-batch) is the lever."


_STATE_REMEDY = {
    "optimizer": "use an optimizer with a smaller state (8-bit, factored), parameter-efficient fine-tuning, sharding "
                 "or offload",
    "params": "load the weights in a lower precision (bf16, or 4-bit with adapters), or shard them",
    "grads": "train fewer parameters (adapters), keep gradients in a lower precision, or shard them",
}


def ledger_report(ledger: Ledger, policy: str, ladder: Sequence[str], history: Optional[Dict[str, Any]] = None,
                  all_checkpointed: bool = False, remedies: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A JSON-able report: lines (bytes and GiB), shares of capacity, the dominant line and the advice.

    ``remedies``: every remedy priced from this ledger
    (:func:`lightning_ckpt.forecast.measured.measured_remedies`): its keys (``remedies``, ``recommended``,
    ``recommended_any``, ``remedy``) join the report's, and its sentence (the line that crosses, or the largest,
    with the remedy to try first and its numbers) leads the advice.
    """
    lines = ledger.lines()
    cap = ledger.capacity
    dominant = ledger.dominant()
    advice: List[str] = [ledger.diagnosis()]
    if remedies:
        advice.insert(0, remedies["remedy"]["sentence"])
    if dominant == "activations":
        advice.append(f"The measurements suggest policy {suggest_policy(policy, ladder, all_checkpointed)!r} "
                      f"(currently {policy!r}).")
    if ledger.cache is not None and ledger.peak_reserved and ledger.cache > _FRAGMENTATION_SHARE * ledger.peak_reserved:
        advice.append(
            f"Reserved exceeds allocated by {format_bytes(ledger.cache)}: that is the allocator's cache and "
            "fragmentation, not live tensors; calling empty_cache() changes the display, not the workload."
        )
    for extra in (phase_advice(ledger), copies_advice(ledger)):
        if extra:
            advice.append(extra)
    quadratic = (history or {}).get("activations_vs_seq_len")
    if quadratic:
        advice.append(quadratic)
    if ledger.allocator_note is not None:  # CUDA graphs: the allocator's lines were left out of the ledger
        advice.append(f"Allocator lines not comparable, left out: {ledger.allocator_note}.")
    return {
        "lines": {name: {"bytes": int(v), "gib": v / GiB, "share_of_capacity": (v / cap) if cap else None}
                  for name, v in lines.items()},
        "optimizer_by_dtype": dict(ledger.optimizer_by_dtype),
        "master": ledger.master,
        "peak_allocated": ledger.peak_allocated,
        "peak_reserved": ledger.peak_reserved,
        "allocator_comparable": ledger.allocator_comparable,
        "capacity": cap,
        "dominant": dominant,
        "phases": {name: {"bytes": int(v), "gib": v / GiB, "share_of_capacity": (v / cap) if cap else None,
                          "dominant": ledger.phase_dominant(name)}
                   for name, v in (ledger.phase_peaks or {}).items()},
        "peak_phase": ledger.peak_phase,
        "policy": policy,
        "advice": advice,
        **(remedies or {}),
    }


def report_text(report: Dict[str, Any]) -> str:
    """The report as a table for the terminal, in one unit (the one that fits its largest line, named in the header).

    Reads the bytes of ``report`` (the JSON of :func:`ledger_report`, or that JSON loaded back from the file).
    """
    cap = report["capacity"]
    sizes = [line["bytes"] for line in report["lines"].values()]
    sizes += [phase["bytes"] for phase in (report.get("phases") or {}).values()]
    sizes += list(report["optimizer_by_dtype"].values()) + [report["master"] or 0]
    unit, scale = unit_for(max(sizes, default=0))
    share_head = f"{'% of capacity':>16}" if cap else ""
    rows = ["lightning_ckpt memory ledger (peak of the last measured step)", f"  {'line':<20}{unit:>10}" + share_head]
    for name, line in report["lines"].items():
        mark = "  <- dominant" if name == report["dominant"] else ""
        share = f"{line['share_of_capacity']:>16.1%}" if cap else ""
        rows.append(f"  {name:<20}{line['bytes'] / scale:>10.2f}{share}{mark}")
    for dtype, size in sorted(report["optimizer_by_dtype"].items()):
        rows.append(f"    {'optimizer ' + dtype:<18}{size / scale:>10.2f}")
    if report["master"]:
        rows.append(f"    {'master copies':<18}{report['master'] / scale:>10.2f}")
    if report.get("phases"):
        rows.append(f"  {'phase peak':<20}{unit:>10}" + share_head + "  largest line")
        for name, phase in report["phases"].items():
            mark = "  <- the step's peak" if name == report["peak_phase"] else ""
            share = f"{phase['share_of_capacity']:>16.1%}" if cap else ""
            rows.append(f"  {name:<20}{phase['bytes'] / scale:>10.2f}{share}  {phase['dominant']}{mark}")
    if cap:
        rows.append(f"  capacity {format_bytes(cap)}")
    rows.extend(_remedy_rows(report))
    rows.extend(f"  - {line}" for line in report["advice"])
    return "\n".join(rows)


_STATE = ("parameters", "gradients", "optimizer state", "master copy", "in flight")


def _remedy_rows(report: Dict[str, Any]) -> List[str]:
    """The run as it is and every remedy that lowers its peak, one line each (``plan --remedies`` has the costs)."""
    priced = report.get("remedies") or []
    if not priced:
        return []
    own = priced[0]
    shown = [own] + [r for r in priced[1:] if r["peak"] < own["peak"]]
    unit, scale = unit_for(max(r["peak"] for r in shown))
    marks = {report.get("recommended_any"): "  <- cheapest at all", report.get("recommended"): "  <- try first"}
    marks.pop(own["name"], None)
    out = [f"  remedies priced from this ledger ({unit} on one GPU; lower peaks than the run's):",
           f"  {'remedy':<50}{'state':>8}{'acts':>8}{'peak':>8}  verdict"]
    for r in shown:
        verdict = [{True: "fits", False: "does not fit", None: ""}[r["fits"]],
                   "changes the training" if r["changes_training"] else ""]
        verdict = ", ".join(v for v in verdict if v)
        name = f"{r['name']} (as it runs)" if r is own else r["name"]
        state = sum(r["lines"][k] for k in _STATE)
        out.append(f"  {name:<50}{state / scale:>8.2f}{r['lines']['activations'] / scale:>8.2f}"
                   f"{r['peak'] / scale:>8.2f}  {verdict}{marks.get(r['name'], '')}".rstrip())
    return out
