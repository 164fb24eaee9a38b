"""A budget's plan per batch shape, chosen before each step runs: :class:`ShapePlanner`. Pure torch, no Lightning.

``budget:`` calibrates its per-block costs on real steps of one batch shape, the *reference* (the first batch's; its
stages run only on batches of exactly that shape). Every bucket (:mod:`lightning_ckpt.decide.shapes`) gets a plan of
its own, chosen before its forward from the same exact solver (:func:`~lightning_ckpt.decide.budget.plan_budget`) on
costs for the bucket's upper corner, which holds for every batch in the bucket:

**The memory model.** Each bucket is priced once on fake tensors (:func:`~lightning_ckpt.decide.pricing.price_shape`:
the model's own bytes per block at that shape, quadratic terms such as a materialised attention matrix included,
since they are traced, not assumed). The fake bytes are carried into the device's units by the reference bucket:
every byte figure is ``measured(reference) × fake(bucket) / fake(reference)``, per block and per quantity (on the CPU
the ratio is 1: the fake trace is the meter's own count), the bases likewise. Each plan the solver picks is then
traced itself at that shape, and its traced peak (carried the same way) is its prediction: the peak model is an
approximation, the trace is not. Times scale with the block's bytes
kept un-checkpointed (its work grows as its activations do), from the times the calibration measured. Before the
calibration has measured anything (a batch of another bucket arrives during it), the fake bytes price the plan and
the bytes a mode recomputes stand in for its time.

**Each step checks its prediction.** A measured step reports ``measured / predicted − 1``
(``memory/prediction_error_ratio``) for its own shape: inside a bucket every byte figure is fitted per sample as
``a·T + b·T²`` in the tokens per sample through the bucket's corner and the corner below it (both priced), so a
quadratic term found at two lengths carries to a third. A reading at the bucket's own shape becomes the plan's peak
there; a reading above the prediction at another shape raises the bucket's predictions by the difference; a plan then
predicted over the budget is chosen again for the bucket's next step (a prediction never stays below a reading).

**Few plans.** One plan per bucket, reused whenever the bucket comes back; buckets are powers of two, so a run from
64 to 4096 tokens has at most 7 (under ``torch.compile``, dynamo's ``recompile_limit`` is 8).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_ckpt.core.policy import compiler_modes
from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.decide.budget import (
    BlockCost,
    BudgetPlan,
    mode_mix,
    plan_budget,
    plan_seconds,
    predict_peak,
    run_eagerly,
    smallest_budget,
)
from lightning_ckpt.decide.choose import BUDGET_MARGIN, TIME_TIE, choose_checked
from lightning_ckpt.decide.pricing import ShapeCosts
from lightning_ckpt.decide.shapes import Shape, bucket_of

__all__ = ["BucketPlan", "ShapePlanner"]

_BYTES = ("interior", "boundary", "selective_kept", "recompute_replay", "selective_replay")


@dataclass
class BucketPlan:
    """One bucket's plan and what it did (``callback.shape_plans[bucket]``).

    Attributes:
        bucket: the bucket's shape (its upper corner).
        modes: the per-block modes chosen for it.
        predicted_peak: the activation peak the model predicts for the bucket's shape under ``modes`` (bytes).
        fits: whether ``predicted_peak`` is within the budget.
        smallest_budget: the smallest budget any plan meets at this shape (bytes).
        source: what priced it: ``"calibration"`` (the reference bucket: measured), ``"fake"`` (fake tensors
            carried into the device's units by the reference), ``"fake only"`` (before the calibration ended).
        steps: steps (micro-batches) run in the bucket.
        measured_peak: the last measured activation peak of a step of the bucket (bytes), when one was measured.
        error: ``measured_peak / predicted_peak − 1`` of that step.
        step_s: the last measured step time of the bucket (seconds).
        tokens_per_sec: the last measured throughput of the bucket.
    """

    bucket: Shape
    modes: Tuple[str, ...]
    predicted_peak: int
    fits: bool
    smallest_budget: int
    source: str
    steps: int = 0
    measured_peak: Optional[int] = None
    error: Optional[float] = None
    step_s: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    stale: bool = False

    def as_dict(self) -> Dict[str, object]:
        """JSON-ready (the report's ``shape_plans``)."""
        out = dataclasses.asdict(self)
        out.pop("stale")
        out["bucket"] = str(self.bucket)
        out["modes"] = list(self.modes)
        return out


class ShapePlanner:
    """Per-bucket plans for one budget (see the module docstring).

    Args:
        budget: the activation budget in bytes.
        modes: the solver's modes (``"off"`` and those the calibration prices).
        price: ``price(bucket) -> ShapeCosts``: the bucket's bytes on fake tensors (called once per bucket).
        trace: ``trace(bucket, plans) -> peaks``: the activation peak of each plan (per-block modes) traced on fake
            tensors at the bucket's shape; given, every plan chosen for a bucket is traced before it is used, and
            its traced peak is its prediction.
    """

    def __init__(self, budget: int, modes: Sequence[str], price: Callable[[Shape], ShapeCosts],
                 trace: Optional[Callable[[Shape, Sequence[Tuple[str, ...]]], List[int]]] = None,
                 margin: float = BUDGET_MARGIN) -> None:
        self.budget, self.margin = budget, margin
        self.modes = tuple(dict.fromkeys(("off", *modes)))
        self._price, self._trace = price, trace
        self._priced: Dict[Shape, ShapeCosts] = {}
        self._raise: Dict[Shape, int] = {}  # bytes a bucket's predictions were raised by, after a measured step
        self._exact: Dict[Shape, Dict[Tuple[str, ...], int]] = {}  # peaks measured at a bucket's own shape
        self._unit = 1.0  # device bytes per traced (fake) byte: the reference's measured plan over its trace
        self._unit_from: Optional[Tuple[Tuple[str, ...], int]] = None  # (plan, measured peak) not yet traced
        self.reference: Optional[Shape] = None
        self._measured: Optional[ShapeCosts] = None  # the calibration's costs (real times) and bases
        self.plans: Dict[Shape, BucketPlan] = {}
        self._steps_before: Dict[Shape, int] = {}  # steps counted in buckets whose plans the reference dropped

    # -- the memory model
    def set_reference(self, shape: Shape, costs: Sequence[BlockCost], base: Tuple[int, int],
                      chosen: Optional[BudgetPlan] = None, measured: Optional[Dict[Tuple[str, ...], int]] = None,
                      measured_peak: Optional[int] = None) -> None:
        """The calibration is over: the exact shape it ran at, its measured costs and bases, the peaks of the plans
        it ran (``measured``), its plan (``chosen``) and that plan's measured peak (``measured_peak``). The plan is
        the plan of the calibration's exact shape (a key of :attr:`plans` like a bucket, and its bucket's too when the
        shape is the bucket's upper corner): corrected here, like any bucket's, when a step reads above it."""
        bucket = shape
        self.reference, self._measured = shape, ShapeCosts(tuple(costs), tuple(base))
        exact = dict(measured or {})
        self._unit, self._unit_from = 1.0, None
        if chosen is not None and measured_peak is not None:
            exact[tuple(chosen.modes)] = measured_peak
            self._unit_from = (tuple(chosen.modes), measured_peak)  # traced when another bucket needs it
        self._exact = {bucket: exact}
        self._raise.pop(bucket, None)
        steps = {b: p.steps for b, p in self.plans.items()}
        self.plans = {}  # earlier plans were priced without the calibration's measurements
        self._steps_before = steps
        if chosen is not None:  # the calibration's shape has its plan here, like every bucket: one source of truth
            peak = exact.get(tuple(chosen.modes), chosen.predicted_peak)
            self.plans[bucket] = BucketPlan(bucket, tuple(chosen.modes), peak, peak <= self.target,
                                            chosen.smallest_budget, "calibration", steps=steps.get(bucket, 0))

    def unit(self) -> float:
        """Device bytes per traced byte: the reference plan's measured peak over its trace at the reference shape
        (1 on the CPU, where the trace is the meter's own count; traced on first use). Both eager: a trace runs
        ``compiler:<f>`` blocks ``off``, so their savings are added back to the measured (compiled) peak."""
        if self._unit_from is not None:
            modes, measured = self._unit_from
            self._unit_from = None
            fake = self.traced(self.reference, modes)  # eager: the measured peak before compiled savings
            self._unit = (measured + self.compiled_savings(self.reference, modes)) / fake if fake else 1.0
        return self._unit

    def priced(self, bucket: Shape) -> ShapeCosts:
        """The bucket's fake bytes (priced on first use)."""
        if bucket not in self._priced:
            self._priced[bucket] = self._price(bucket)
        return self._priced[bucket]

    def traced(self, bucket: Shape, modes: Tuple[str, ...]) -> Optional[int]:
        """The plan's traced activation peak at the bucket's shape (fake bytes), traced on first use."""
        traced = self.priced(bucket).traced
        if modes not in traced and self._trace is not None:
            traced[modes] = self._trace(bucket, [modes])[0]
        return traced.get(modes)

    def costs(self, bucket: Shape, raised: bool = True) -> Tuple[List[BlockCost], Tuple[int, int], str]:
        """The bucket's costs in the device's units, its bases (``raised`` by what measured steps read above its
        predictions), and what priced them."""
        raised = self._raise.get(bucket, 0) if raised else 0
        if self._measured is not None and bucket == self.reference:
            costs, base, source = list(self._measured.costs), self._measured.base, "calibration"
        elif self._measured is not None:
            fake, ref = self.priced(bucket), self.priced(self.reference)
            costs = [_carried(m, r, f) for m, r, f in zip(self._measured.costs, ref.costs, fake.costs)]
            base = tuple(_scaled(m, r, f) for m, r, f in zip(self._measured.base, ref.base, fake.base))
            source = "fake"
        else:
            fake = self.priced(bucket)
            costs, base, source = [_time_from_bytes(c) for c in fake.costs], fake.base, "fake only"
        return costs, (base[0] + raised, base[1] + raised), source

    def known(self, bucket: Shape) -> Dict[Tuple[str, ...], int]:
        """Peaks known for plans at the bucket's own shape, in device bytes: traced ones carried by the reference's
        unit (less the compiled blocks' savings: a trace runs them eagerly), measured ones as measured; both raised
        like every prediction of the bucket (a reading above the prediction at another shape of the bucket)."""
        raised = self._raise.get(bucket, 0)
        if bucket == self.reference and self._measured is not None:
            out = {}
        else:
            unit = self.unit()  # a trace runs compiled blocks eagerly, as ``off``: their savings come off
            out = {modes: round(peak * unit) - self.compiled_savings(bucket, modes)
                   for modes, peak in self.priced(bucket).traced.items()}
        out.update(self._exact.get(bucket, {}))
        return {modes: peak + raised for modes, peak in out.items()}

    def predict(self, bucket: Shape, modes: Sequence[str], shape: Optional[Shape] = None,
                measured: bool = True) -> int:
        """The activation peak predicted under ``modes`` for a batch of ``shape`` in ``bucket`` (default: the
        bucket's own shape, its upper corner), in bytes. Within a bucket the corner's prediction is scaled by the
        fitted model's ratio between the two shapes (:meth:`model_peak`). ``measured=False``: from the blocks'
        costs alone, not from a peak this plan measured at the corner."""
        modes = tuple(modes)
        corner = self.known(bucket).get(modes) if measured else None
        if corner is None:
            costs, base, _ = self.costs(bucket)
            corner = predict_peak(costs, modes, base)
        if shape is None or shape == bucket:
            return corner
        model = self.model_peak(bucket, modes, bucket)
        return round(corner * self.model_peak(bucket, modes, shape) / model) if model else corner

    def compiled_savings(self, bucket: Shape, modes: Sequence[str], shape: Optional[Shape] = None) -> int:
        """Bytes the ``compiler:<f>`` blocks of ``modes`` save at ``shape`` (in ``bucket``) against the same plan run
        eagerly, where they are ``off``: what to take off an eager reference step's figure of that shape (0 without
        them). The calibration's savings are its shape's; a longer batch's compiled blocks save more."""
        if not compiler_modes(modes):
            return 0
        # from the costs alone: a corner's measured peak is itself corrected by these savings
        saved = (self.predict(bucket, run_eagerly(modes), shape, measured=False)
                 - self.predict(bucket, modes, shape, measured=False))
        return max(saved, 0)

    def model_peak(self, bucket: Shape, modes: Sequence[str], shape: Shape) -> int:
        """The peak model's prediction for ``shape`` (inside ``bucket``): every byte figure fitted per sample as
        ``a·T + b·T²`` in the tokens per sample ``T`` through the bucket's corner and the corner below it (both
        priced), so that a quadratic term found at two lengths carries to a third; samples scale linearly."""
        upper_costs, upper_base, _ = self.costs(bucket, raised=False)
        lower = _lower_corner(bucket)
        per = shape.tokens / shape.samples if shape.samples else 0
        t2 = bucket.tokens / bucket.samples
        if lower is None:
            points = None
        else:
            lower_costs, lower_base, _ = self.costs(lower, raised=False)
            points = (lower.tokens / lower.samples, lower_costs, lower_base)

        def fit(v2: Optional[int], v1: Optional[int], t1: Optional[float]) -> Optional[int]:
            if v2 is None:
                return None
            y2 = v2 / bucket.samples / t2
            if v1 is None or t1 is None:
                return round(shape.samples * per * y2)  # one point: through zero, linear
            y1 = v1 / lower_samples / t1
            b = (y2 - y1) / (t2 - t1)
            a = y2 - b * t2
            return max(0, round(shape.samples * per * (a + b * per)))

        lower_samples = lower.samples if lower is not None else bucket.samples
        t1, lower_costs, lower_base = points if points is not None else (None, [None] * len(upper_costs), (None, None))
        costs = []
        for up, low in zip(upper_costs, lower_costs):
            fields = {name: fit(getattr(up, name), getattr(low, name) if low is not None else None, t1)
                      for name in _BYTES}
            costs.append(dataclasses.replace(up, **fields))
        base = tuple(fit(u, lb, t1) or 0 for u, lb in zip(upper_base, lower_base))
        return predict_peak(costs, modes, base)

    def smallest_budget(self, bucket: Shape) -> int:
        """The smallest activation budget any plan of the solver's modes meets at ``bucket``'s shape (bytes)."""
        costs, base, _ = self.costs(bucket)
        return smallest_budget(costs, base, self.modes)

    def lowest_plan(self, bucket: Shape) -> BudgetPlan:
        """The plan with the lowest predicted activation peak at ``bucket``'s shape."""
        costs, base, _ = self.costs(bucket)
        return plan_budget(costs, 0, base=base, modes=self.modes)

    def longest(self, first: Shape, target: int, limit: Optional[int] = None,
                checks: int = 4) -> Tuple[Optional[Shape], Optional[BudgetPlan]]:
        """The longest single-length shape of ``first``'s micro-batch that some plan holds within ``target`` bytes.

        The plan with the lowest peak at ``first``'s bucket is traced on fake tensors at twice that length; its peak
        fitted as ``T·(a + b·T)`` through the two lengths (a quadratic term — a materialised attention matrix — is
        seen) gives the longest length, where it is traced again, and the length is moved down until it holds (at
        most ``checks`` traces, each one step on fake tensors). Returns the shape and that plan with its peak there;
        ``(None, plan)`` when not even ``first``'s bucket is held (the plan: its lowest); ``(None, None)`` for shapes
        of other than one length."""
        if len(first.lengths) != 1:
            return None, None
        bucket = bucket_of(first)
        lowest = self.lowest_plan(bucket)
        if lowest.predicted_peak > target:
            return None, lowest
        short, top = bucket.lengths[0], limit or 1 << 22
        if top <= short:
            return Shape(first.samples, (top,)), lowest

        def peak_at(length: int) -> int:
            shape = Shape(first.samples, (length,))
            traced = self._trace(shape, [tuple(lowest.modes)])[0] if self._trace is not None else None
            return self.model_peak(bucket, lowest.modes, shape) if traced is None else round(traced * self.unit())

        long = min(2 * short, top)
        y1, y2 = lowest.predicted_peak / short, peak_at(long) / long  # bytes per token at the two lengths
        b = max((y2 - y1) / (long - short), 0.0)
        a = y1 - b * short
        # the largest T with T·(a + b·T) <= target
        length = target / a if b == 0 else (-a + math.sqrt(a * a + 4 * b * target)) / (2 * b)
        length = max(short, min(top, int(length)))
        for _ in range(checks):
            if length <= short:
                return bucket, lowest
            peak = peak_at(length)
            if peak <= target:
                return Shape(first.samples, (length,)), dataclasses.replace(lowest, predicted_peak=peak,
                                                                            budget=target)
            # the activations grow at least linearly in the length: scale it down by the overshoot, and a bit more
            length = max(short, int(length * target / peak * 0.98))
        return bucket, lowest

    # -- plans
    def plan(self, bucket: Shape) -> BucketPlan:
        """The bucket's plan: the solver's choice on the bucket's costs, each choice traced (with ``trace``) before
        it is kept, its traced peak its prediction; chosen on first use, and again after a measured step read above
        its prediction."""
        old = self.plans.get(bucket)
        if old is not None and not old.stale:
            return old
        costs, base, source = self.costs(bucket)
        chosen, peak = self._choose(bucket, costs, base)
        new = BucketPlan(bucket, tuple(chosen.modes), peak, peak <= self.target,
                         math.ceil(chosen.smallest_budget / (1 - self.margin)), source,
                         steps=self._steps_before.pop(bucket, 0))
        if old is not None:  # chosen again: what the bucket did stays
            new.steps, new.measured_peak, new.error = old.steps, old.measured_peak, old.error
            new.step_s, new.tokens_per_sec = old.step_s, old.tokens_per_sec
        self.plans[bucket] = new
        return new

    @property
    def target(self) -> int:
        """What a plan's predicted peak must be within: the budget less its margin (bytes)."""
        return int(self.budget * (1 - self.margin))

    def _choose(self, bucket: Shape, costs: List[BlockCost], base: Tuple[int, int]) -> Tuple[BudgetPlan, int]:
        """The one choose-check routine (:func:`~lightning_ckpt.decide.choose.choose_checked`): choose, trace the
        choice, choose again while its trace reads over the target, settled on a plan whose peak is known (traced,
        or measured here); its give-up rule otherwise. A plan that cannot be traced keeps the model's figure."""

        def choose(known: Dict[Tuple[str, ...], int]) -> Tuple[str, ...]:
            return tuple(plan_budget(costs, self.target, base=base, modes=self.modes, measured=known,
                                     tie=TIME_TIE).modes)

        def check(modes: Tuple[str, ...]) -> Optional[int]:
            traced = self.traced(bucket, modes) if self._trace is not None else None
            if traced is None:
                return None
            # in device bytes, as known() carries a trace (the reference's own traces included)
            return round(traced * self.unit()) - self.compiled_savings(bucket, modes) + self._raise.get(bucket, 0)

        def seconds(modes: Tuple[str, ...]) -> float:
            return plan_seconds(costs, modes)

        known = self.known(bucket)
        modes, peak = choose_checked(choose, check, self.target, seconds, checked=known)
        if peak is not None:
            known[modes] = peak
        chosen = plan_budget(costs, self.target, base=base, modes=self.modes, measured=known or None, tie=TIME_TIE)
        if chosen.modes != modes:  # the give-up rule's plan: taken as it is
            chosen = dataclasses.replace(chosen, modes=modes, predicted_peak=peak, fits=peak <= self.target,
                                         recompute_s=seconds(modes))
        return chosen, chosen.predicted_peak if peak is None else peak

    def observe(self, bucket: Shape, modes: Sequence[str], measured: Optional[int], step_s: Optional[float] = None,
                tokens_per_sec: Optional[float] = None, shape: Optional[Shape] = None) -> Optional[float]:
        """A step of ``bucket`` (a batch of ``shape``, default the bucket's own) ran under ``modes``: count it, and
        with a measured activation peak check the prediction for that shape (returns ``measured / predicted − 1``;
        ``None`` without a figure). At the bucket's own shape the reading becomes the plan's known peak there; a
        reading above the prediction at another shape raises the bucket's predictions by the difference. Either way
        a plan now predicted over the budget is marked ``stale``: :meth:`plan` chooses it again on the bucket's next
        step."""
        plan = self.plans.get(bucket)
        if plan is None:
            return None
        plan.steps += 1
        if step_s is not None:
            plan.step_s, plan.tokens_per_sec = step_s, tokens_per_sec
        if measured is None:
            return None
        modes, shape = tuple(modes), shape or bucket
        predicted = self.predict(bucket, modes, shape)
        error = measured / predicted - 1 if predicted else None
        plan.measured_peak, plan.error = measured, error
        if shape == bucket:
            self._exact.setdefault(bucket, {})[modes] = measured
        elif measured > predicted:
            scale = self.predict(bucket, modes) / predicted if predicted else 1.0
            self._raise[bucket] = self._raise.get(bucket, 0) + round((measured - predicted) * scale)
        if modes == plan.modes:
            plan.predicted_peak = self.predict(bucket, modes)
            plan.fits = plan.predicted_peak <= self.target
            plan.stale = not plan.fits  # chosen again before the bucket's next step
        return error

    # -- resume
    def state_dict(self) -> Dict[str, object]:
        """The buckets' plans and what their steps read (primitives); the fake prices are made again on demand."""
        def shape(b: Shape) -> List[int]:
            return [b.samples, *b.lengths]

        return {"unit": self._unit,
                "exact": [[shape(b), [[list(m), v] for m, v in peaks.items()]] for b, peaks in self._exact.items()],
                "raise": [[shape(b), v] for b, v in self._raise.items()],
                "plans": [dict(p.as_dict(), bucket=shape(b), stale=p.stale) for b, p in self.plans.items()]}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """After :meth:`set_reference` with the restored calibration: the saved buckets' plans and readings."""
        def shape(values: Sequence[int]) -> Shape:
            return Shape(values[0], tuple(values[1:]))

        if self._unit_from is None:  # measured already: no trace needed to know it again
            self._unit = float(state["unit"])
        else:
            self._unit, self._unit_from = float(state["unit"]), None
        for bucket, peaks in state["exact"]:
            self._exact.setdefault(shape(bucket), {}).update({tuple(m): v for m, v in peaks})
        self._raise.update({shape(b): v for b, v in state["raise"]})
        for saved in state["plans"]:
            fields = dict(saved, bucket=shape(saved["bucket"]), modes=tuple(saved["modes"]))
            self.plans[fields["bucket"]] = BucketPlan(**fields)

    def table(self) -> str:
        """The buckets as a table for the terminal (the end-of-fit report)."""
        rows = [f"  {'bucket':<14}{'steps':>6}  {'plan':<32}{'predicted':>11}{'measured':>11}{'error':>8}"
                f"{'tokens/s':>10}"]
        for bucket in sorted(self.plans):
            p = self.plans[bucket]
            measured = format_bytes(p.measured_peak) if p.measured_peak is not None else "-"
            error = f"{p.error:+.1%}" if p.error is not None else "-"
            tps = f"{p.tokens_per_sec:,.0f}" if p.tokens_per_sec else "-"
            rows.append(f"  {str(bucket):<14}{p.steps:>6}  {mode_mix(p.modes):<32}"
                        f"{format_bytes(p.predicted_peak):>11}{measured:>11}{error:>8}{tps:>10}")
        return "\n".join(rows)


def _lower_corner(bucket: Shape) -> Optional[Shape]:
    """The corner of the bucket below ``bucket`` along its lengths (``None`` at the smallest)."""
    from lightning_ckpt.decide.shapes import MIN_LENGTH

    if not bucket.lengths or all(n <= MIN_LENGTH for n in bucket.lengths):
        return None
    return Shape(bucket.samples, tuple(max(MIN_LENGTH, n // 2) for n in bucket.lengths))


def _scaled(measured: Optional[int], reference: Optional[int], fake: Optional[int]) -> Optional[int]:
    """``measured × fake / reference``: a byte figure of the reference shape carried to another shape by the fake
    ratio (the fake figure itself where the reference has none to scale)."""
    if measured is None or fake is None:
        return measured if fake is None else fake
    if not reference:
        return fake
    return round(measured * fake / reference)


def _carried(measured: BlockCost, reference: BlockCost, fake: BlockCost) -> BlockCost:
    """A block's measured costs at the reference shape carried to the fake's shape (module docstring)."""
    fields = {name: _scaled(getattr(measured, name), getattr(reference, name), getattr(fake, name))
              for name in _BYTES}
    work = fake.interior / reference.interior if reference.interior else 1.0
    times = {name: None if getattr(measured, name) is None else getattr(measured, name) * work
             for name in ("recompute_s", "selective_s", "offload_s")}
    compiler = tuple((mode, round(kept * work), seconds * work) for mode, kept, seconds in measured.compiler)
    return dataclasses.replace(measured, **fields, **times, compiler=compiler)


def _time_from_bytes(cost: BlockCost) -> BlockCost:
    """Fake bytes only (no time measured yet): a mode's time stands in as the bytes it recomputes."""
    recompute = float(cost.recompute_replay if cost.recompute_replay is not None else cost.interior)
    selective = None
    if cost.selective_kept is not None:
        selective = max(recompute - (cost.selective_kept - cost.boundary), 0.0)
    return dataclasses.replace(cost, recompute_s=recompute, selective_s=selective, offload_s=None)
