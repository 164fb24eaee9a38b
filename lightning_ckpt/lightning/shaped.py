"""``budget:`` per batch shape at the Lightning edge: the plan for each micro-batch, chosen before its forward.

The engine (:mod:`lightning_ckpt.lightning.engine`) owns one :class:`ShapeSteps` when the policy is a budget. Before
every micro-batch's forward (``on_train_batch_start``) it reads the batch's bucket
(:mod:`lightning_ckpt.decide.shapes`), agrees on it across ranks, and sets that bucket's plan
(:class:`~lightning_ckpt.decide.shape_plans.ShapePlanner`), through the port's one way of changing modes. Modes
change between one micro-batch's backward and the next forward, so each micro-batch of an accumulation window may
have its own plan.

- **The calibration's shape.** The budget's calibration (:class:`~lightning_ckpt.decide.calibration.BudgetCalibration`)
  runs its stages on batches of the first batch's exact shape (its per-block bytes are that shape's), and a batch of
  exactly that shape runs the calibration's own plan, measured and verified (its modes may include the compiler's
  budgets, ``compiler:<f>``, which the per-bucket plans also carry). Every stage is predicted before it runs from
  its plan traced on fake tensors at that shape (:meth:`ShapeSteps.traced_at_calibration`), so none runs above the
  budget. A micro-batch of another shape during it runs under its bucket's own plan, priced on fake tensors,
  unmeasured; the stage's blocks are measured on the calibration shape's micro-batches (a step with none of them is
  no stage). With lengths that never repeat, pad to a multiple (a collator's ``pad_to_multiple_of=64``) so that the
  calibration's shape comes back.
- **Before the first step**, with ``max_shape``, a budget no plan meets there raises, naming the smallest feasible
  budget. Without it, the longest length the budget holds at the first batch's micro-batch is found on fake tensors
  (:meth:`~lightning_ckpt.decide.shape_plans.ShapePlanner.longest`), said, and caps the buckets; the model's
  maximum positions (``config.max_position_embeddings``, ``n_positions``, ``block_size``) only cap them too, never
  refuse. A longer batch runs the lowest plan with a warning, or stops before its forward when that plan is
  predicted past the device's memory.
- **Several processes**: the shape is the maximum over ranks, dimension by dimension (one all-reduce of a few
  integers on a CPU process group, no device sync), and each new plan is rank zero's (one broadcast when a bucket is
  planned), so every rank runs the same plan in the same step.
- **A model that cannot be traced on fake tensors** (a step that reads parameter values, FSDP's sharded parameters):
  a warning says so once, and a bucket's bytes are the calibration's scaled by its token ratio, squared above the
  calibration's shape (an attention matrix grows with the square of the length; never an optimistic guess).

Logged (with the engine's figures, on measured steps): ``shape/samples``, ``shape/length`` (the bucket's first
length), ``shape/blocks_off``, ``shape/blocks_selective``, ``shape/blocks_recompute`` (the step's plan as a mix; each
new bucket plan is also written to TensorBoard as text, ``lightning_ckpt/shape_plans``),
``memory/prediction_error_ratio`` (measured / predicted activation peak − 1, on measured steps of a
planned bucket). On CUDA the allocator's cache (``memory/cache_gib``) is followed over the run: varying shapes
fragment the caching allocator, and a cache that grew by more than 5 % of capacity (at least 256 MiB) is reported
with the fix (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from lightning_ckpt.core.units import GiB, format_bytes
from lightning_ckpt.decide.anatomy import config_int
from lightning_ckpt.decide.budget import BlockCost
from lightning_ckpt.decide.pricing import PricingError, ShapeCosts, price_shape, trace_plans
from lightning_ckpt.decide.shape_plans import BucketPlan, ShapePlanner
from lightning_ckpt.decide.shapes import Shape, ambiguous_length, bucket_of, resize_batch, shape_of
from lightning_ckpt.lightning.port import PlanPort

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.decide.calibration import BudgetCalibration

__all__ = ["ShapeSteps", "model_max_length"]

CACHE_GROWTH = 0.05  # of capacity: a cache that grew by more than this over the run is reported as fragmentation
RULE = "buckets: each dimension rounded up to a power of two, lengths at least 8, capped by max_shape"

_MAX_POSITION_NAMES = ("max_position_embeddings", "n_positions", "block_size", "max_seq_len", "max_len",
                       "seq_length", "n_ctx")


_UNREAD = object()


def model_max_length(model: torch.nn.Module) -> Optional[int]:
    """The longest sequence the model takes, read from its (or a submodule's) config or attributes; ``None`` when
    it says nothing."""
    return config_int(model, _MAX_POSITION_NAMES)


@contextlib.contextmanager
def _silenced_logging(module: Any) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing for the duration (a priced step's loss is a fake tensor)."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    raise PricingError("training_step returned no loss tensor (manual optimization?)")


class ShapeReader:
    """What both per-shape doors share: a batch's shape agreed across ranks, a real batch to resize, and a step on
    fake tensors at any shape (the module's own ``training_step``, ``self.log`` silenced, under the precision's
    context)."""

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        # per number of lengths (an encoder-decoder's batches may read as one or two): this rank's longest batch and
        # its shape, resized to price a shape
        self._sources: Dict[int, Tuple[Any, Shape]] = {}
        self._warned_ambiguous = False

    def read(self, trainer: "pl.Trainer", batch: Any, agree: bool = True) -> Tuple[Shape, Shape]:
        """The batch's shape on this rank and the step's (with ``agree``, the maximum over the ranks: one all-reduce
        under several processes); keeps this rank's longest batch to resize."""
        shape_fn = self.port.settings.shape_fn
        local = shape_of(batch, shape_fn)
        if shape_fn is None and not self._warned_ambiguous and ambiguous_length(batch):
            self._warned_ambiguous = True
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(f"lightning_ckpt: pass shape_fn (e.g. shape_fn=lambda batch: batch[0].shape[:2]) to say "
                           f"which dimension of your batch is its length: it has no token ids, so its float tensor "
                           f"{ambiguous_length(batch)} is read as [samples, length, features], length "
                           f"{local.lengths[0] if local.lengths else None}.")
        arity = len(local.lengths)
        if arity not in self._sources or local.tokens > self._sources[arity][1].tokens:
            self._sources[arity] = (batch, local)  # repetition fills the rest when it is resized
        return local, self._agree(trainer, local) if agree else local

    def _fake_args(self, shape: Shape) -> tuple:
        """What a step on fake tensors at ``shape`` runs: the module, its plan, the loss, a batch of that shape, and
        the precision's context."""
        module = self.port.module
        source_of = self._sources.get(len(shape.lengths))
        if source_of is None:
            raise PricingError(f"no batch with {len(shape.lengths)} length(s) seen yet to make one of shape {shape}")
        batch, source = source_of

        def loss_fn(b: Any) -> torch.Tensor:
            with _silenced_logging(module):
                return _loss_of(module.training_step(b, 0))

        return (module, self.port.plan, loss_fn, resize_batch(batch, source, shape),
                module.trainer.strategy.precision_plugin.train_step_context)

    def trace(self, shape: Shape, plans) -> List[int]:
        """The activation peak of each plan (modes or a policy) at ``shape``, traced on fake tensors."""
        module, plan, loss_fn, batch, context = self._fake_args(shape)
        return trace_plans(module, plan, loss_fn, batch, plans, context=context)

    # -- ranks
    def _agree(self, trainer: "pl.Trainer", shape: Shape) -> Shape:
        """The largest shape over the ranks (each dimension's maximum), so every rank plans the same step alike."""
        if trainer.world_size <= 1:
            return shape
        import torch.distributed as dist

        dims = torch.tensor([shape.samples, *shape.lengths], dtype=torch.int64)
        dist.all_reduce(dims, op=dist.ReduceOp.MAX, group=self.port.ranks.group)
        values = [int(v) for v in dims.tolist()]
        return Shape(values[0], tuple(values[1:]))

    def _broadcast(self, modes: Tuple[str, ...]) -> Tuple[str, ...]:
        import torch.distributed as dist

        box = [list(modes)]
        dist.broadcast_object_list(box, src=0, group=self.port.ranks.group)
        return tuple(box[0])

    def setup(self, trainer: "pl.Trainer") -> None:
        """Before the first step, on every rank at once: the CPU process group the agreement uses."""
        self.port.ranks.setup(trainer)

    def close(self) -> None:
        self._sources = {}


class ShapeSteps(ShapeReader):
    """The per-shape plans of one run (see the module docstring).

    Args:
        port: what it may reach of the run (:class:`~lightning_ckpt.lightning.port.PlanPort`).
        calibration: the run's :class:`~lightning_ckpt.decide.calibration.BudgetCalibration`.
        budget: the activation budget in bytes.
        modes: the modes the plan may mix with ``off``.
    """

    def __init__(self, port: PlanPort, calibration: BudgetCalibration, budget: int, modes: Tuple[str, ...]) -> None:
        super().__init__(port)
        self.calibration = calibration
        self.budget = budget
        self.modes = tuple(m for m in modes if m != "offload")  # offload moves bytes off the device: not priced
        self.planner = ShapePlanner(budget, self.modes, self._price, self._trace)
        self.bucket: Optional[Shape] = None  # the bucket of the micro-batch in flight
        self.calibration_shape: Optional[Shape] = None  # the exact shape the calibration's stages run at
        self._discarded = False  # a micro-batch of another shape ran in the step in flight (calibrating)
        self._stage_begun = False  # the calibration's step began in the step in flight
        self._step_buckets: set = set()
        self._step_shapes: set = set()
        self._checked = False
        self._max_length: Any = _UNREAD
        self._fallback: Optional[str] = None  # why pricing on fake tensors failed
        self.errors: Dict[Shape, float] = {}
        self.longest: Optional[Shape] = None  # the longest shape the budget holds (no max_shape): found before step 1
        self.pricing_s = 0.0  # seconds spent pricing shapes on fake tensors
        self.cache: List[float] = []  # memory/cache_gib of the measured steps, in bytes

    # ------------------------------------------------------------------------------------------ pricing
    def _price(self, bucket: Shape) -> ShapeCosts:
        if self._fallback is None:
            try:
                return self._price_fake(bucket)
            except PricingError as err:
                self._fallback = str(err)
                from lightning.pytorch.utilities.rank_zero import rank_zero_warn

                rank_zero_warn(f"lightning_ckpt: per-shape plans price a bucket from the calibration scaled by its "
                               f"tokens (squared above its shape) instead of tracing it: {err}")
        return self._price_scaled(bucket)

    def traced_at_calibration(self, modes: Sequence[str]) -> Optional[int]:
        """The activation peak of ``modes`` traced on fake tensors at the calibration's exact shape (fake bytes), so
        that no calibration stage runs that is predicted over the budget; ``None`` when the model cannot be traced."""
        if self.calibration_shape is None or self._fallback is not None:
            return None
        try:
            return self.planner.traced(self.calibration_shape, tuple(modes))
        except PricingError:
            return None

    def _price_fake(self, bucket: Shape) -> ShapeCosts:
        module, plan, loss_fn, batch, context = self._fake_args(bucket)
        start = time.perf_counter()
        try:
            return price_shape(module, plan, loss_fn, batch, self.modes, context=context)
        finally:
            self.pricing_s += time.perf_counter() - start

    def _trace(self, bucket: Shape, plans) -> list:
        """The traced peak of each plan at ``bucket``'s shape (without fake tracing: the scaled model's)."""
        if self._fallback is not None:
            return [self.planner.predict(bucket, modes) for modes in plans]
        start = time.perf_counter()
        try:
            return self.trace(bucket, plans)
        except PricingError:
            return [self.planner.predict(bucket, modes) for modes in plans]
        finally:
            self.pricing_s += time.perf_counter() - start

    def _price_scaled(self, bucket: Shape) -> ShapeCosts:
        """No fake trace: the calibration's bytes times the token ratio, squared above its shape (pessimistic)."""
        measured = self.calibration
        if measured is None or not measured.done or self.calibration_shape is None:
            raise PricingError(self._fallback or "nothing measured yet")
        ratio = bucket.tokens / self.calibration_shape.tokens
        lengths = max((a / b for a, b in zip(bucket.lengths, self.calibration_shape.lengths)), default=1.0)
        factor = ratio * max(lengths, 1.0) if ratio > 1 else ratio

        def scaled(cost: BlockCost) -> BlockCost:
            import dataclasses

            fields = {name: None if getattr(cost, name) is None else math.ceil(getattr(cost, name) * factor)
                      for name in ("interior", "boundary", "selective_kept", "recompute_replay", "selective_replay")}
            return dataclasses.replace(cost, **fields)

        base = measured.base
        return ShapeCosts(tuple(scaled(c) for c in measured.costs()),
                          (math.ceil(base[0] * factor), math.ceil(base[1] * factor)))

    # ------------------------------------------------------------------------------------------ the micro-batch
    def before_micro_batch(self, trainer: "pl.Trainer", batch: Any, first: bool) -> None:
        """Set the plan of this micro-batch's bucket (``first``: the first micro-batch of an optimizer step)."""
        _, shape = self.read(trainer, batch)  # the step's shape: the largest over the ranks
        bucket = bucket_of(shape, self._cap(shape))
        if first:
            self._step_buckets, self._step_shapes = set(), set()
        self._step_buckets.add(bucket)
        self._step_shapes.add(shape)
        self.bucket = bucket
        if not self._checked:
            self._checked = True
            self._check_longest(trainer, shape, bucket)
        calibration = self.calibration
        if self.calibration_shape is None:
            self.calibration_shape = shape
        if not calibration.done:
            self._calibration_micro_batch(trainer, shape, bucket, first)
            return
        if shape == self.calibration_shape and shape in self.planner.plans:  # its own plan, checked like a bucket's
            self._apply(self._plan(trainer, shape))
            return
        self._apply(self._plan(trainer, bucket))

    def _calibration_micro_batch(self, trainer: "pl.Trainer", shape: Shape, bucket: Shape, first: bool) -> None:
        """While calibrating: a micro-batch of the calibration's shape runs the stage's plan (the chosen plan on the
        verifying step) and is measured; one of another shape runs its bucket's plan, unmeasured, and makes the
        step mixed (the stage's blocks are still measured on its own micro-batches, so accumulation windows of
        mixed lengths calibrate too). A step with no micro-batch of the calibration's shape is no stage."""
        calibration = self.calibration
        if first:
            self._stage_begun = self._discarded = False
        if shape == self.calibration_shape:
            if not self._stage_begun:
                self._stage_begun = True
                calibration.begin_step()
                if self._discarded:  # an earlier micro-batch of this step had another shape
                    calibration.other_shape()
            elif not calibration.failed:  # a micro-batch of another shape ran in between: the stage's plan again
                expected = calibration.stage_modes or (calibration.chosen.modes if calibration.chosen else None)
                if expected is not None and self.port.plan.modes != tuple(expected):
                    self.port.set_modes(tuple(expected))
            calibration.measuring = not calibration.failed
            return
        if self._stage_begun:
            calibration.other_shape()
        elif not self._discarded:
            calibration.discard_step()  # nothing of the stage ran yet: its step begins with its own shape's batch
        self._discarded = True
        self._apply(self._plan(trainer, bucket))

    def _cap(self, shape: Shape) -> Optional[Shape]:
        cap = self.port.settings.shape_cap
        if cap is None:
            length = self._model_max_length()
            if self.longest is not None and len(shape.lengths) == 1 and shape.samples <= self.longest.samples:
                length = min(length or self.longest.lengths[0], self.longest.lengths[0])
            cap = Shape(bucket_of(Shape(shape.samples)).samples, (length,) * len(shape.lengths)) if length else None
        return cap if cap is not None and len(cap.lengths) == len(shape.lengths) else None

    def _model_max_length(self) -> Optional[int]:
        """The model's maximum positions, read from its modules once (every step asks)."""
        if self._max_length is _UNREAD:
            module = self.port.module
            self._max_length = model_max_length(module) if module is not None else None
        return self._max_length

    def _check_longest(self, trainer: "pl.Trainer", shape: Shape, bucket: Shape) -> None:
        """Before the first step (module docstring): an explicit ``max_shape`` no plan meets fails now; without one,
        the longest length the budget holds at this micro-batch is found on fake tensors and reported, and becomes
        the bucket cap (a batch up to it runs a plan made for its own length, not the next power of two's)."""
        explicit = self.port.settings.shape_cap
        target = self.calibration.target if self.calibration is not None else self.budget
        if explicit is not None:
            if len(explicit.lengths) != len(shape.lengths) or not explicit.covers(bucket):
                return
            floor = self._smallest(explicit)
            if floor is not None and floor > target:
                raise ValueError(
                    f"lightning_ckpt: raise the budget to at least {format_bytes(self._with_margin(floor))}, pass a "
                    f"shorter max_shape (the longest batch your data has) or a smaller micro-batch: policy "
                    f"{self.port.settings.budget.spec!r} cannot be met at max_shape={str(explicit)!r} "
                    f"(micro-batch x length), where the smallest feasible activation budget is "
                    f"{format_bytes(self._with_margin(floor))}.")
            return
        start = time.perf_counter()
        try:
            longest, plan = self.planner.longest(shape, target, self._model_max_length())
        except PricingError:
            return
        self.longest = longest
        if longest is not None and plan is not None:
            self.port.info(f"budget {format_bytes(self.budget)} holds micro-batch {longest.samples} up to "
                             f"{longest.lengths[0]:,} tokens ({_mix(plan.modes)}, predicted activation peak "
                             f"{format_bytes(plan.predicted_peak)}); found on fake tensors in "
                             f"{time.perf_counter() - start:.1f} s")

    def _with_margin(self, floor: int) -> int:
        """The budget that holds a plan of ``floor`` bytes with the margin left free."""
        margin = self.calibration.margin if self.calibration is not None else 0.0
        return math.ceil(floor / (1 - margin))

    def _smallest(self, bucket: Shape) -> Optional[int]:
        try:
            return self.planner.smallest_budget(bucket)
        except PricingError:
            return None

    def _plan(self, trainer: "pl.Trainer", bucket: Shape) -> BucketPlan:
        """The bucket's plan; rank zero's under several processes."""
        old = self.planner.plans.get(bucket)
        new = old is None or old.stale
        try:
            plan = self.planner.plan(bucket)
        except PricingError:  # nothing to price it with yet: every block recomputed
            plan = BucketPlan(bucket, ("recompute",) * self.port.plan.num_blocks, 0, False, 0, "unpriced")
            self.planner.plans[bucket] = plan
        if new and trainer.world_size > 1:
            plan.modes = self._broadcast(plan.modes)
        if new and not plan.fits and plan.source != "unpriced":
            self._refuse_over_capacity(bucket, plan)
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(f"lightning_ckpt: raise the budget to at least {format_bytes(plan.smallest_budget)}, or "
                           f"shorten batches of shape {bucket} (micro-batch x length): no plan meets "
                           f"{self.port.settings.budget.spec!r} there, so they run under the plan with the lowest "
                           f"predicted activation peak, {format_bytes(plan.predicted_peak)}.")
        if new:
            self._write_text(trainer, bucket, plan)
            again = "" if old is None else (f" (chosen again: a step read {format_bytes(old.measured_peak or 0)}, its "
                                            "plan is now predicted over the budget)")
            self.port.info(f"bucket {bucket}: {_describe(plan)}{again}")
        return plan

    def _refuse_over_capacity(self, bucket: Shape, plan: BucketPlan) -> None:
        """A batch no plan fits, whose lowest plan is predicted past the device's memory with the model's state
        (parameters, gradients, optimizer state of the last measured step): it stops here, before its forward."""
        capacity, ledger = self.port.capacity, self.port.last_ledger
        if capacity is None or ledger is None:
            return
        state = ledger.params + ledger.grads + ledger.optimizer + ledger.master
        if state + plan.predicted_peak <= capacity:
            return
        raise RuntimeError(
            f"lightning_ckpt: shorten batches of shape {bucket} (micro-batch x length) to at most "
            f"{self.longest or 'the longest length the budget holds'}, lower the micro-batch, or train on a device "
            f"with more memory: with every block checkpointed as much as it can be, such a batch is predicted at "
            f"{format_bytes(plan.predicted_peak)} of activations over {format_bytes(state)} of model state, past the "
            f"device's {format_bytes(capacity)}; it was stopped before its forward.")

    @staticmethod
    def _write_text(trainer: "pl.Trainer", bucket: Shape, plan: BucketPlan) -> None:
        """A new bucket plan, per block, as TensorBoard text (rank zero)."""
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        text = f"bucket {bucket}: " + ", ".join(f"{i}: {m}" for i, m in enumerate(plan.modes)) + (
            f" (predicted activation peak {format_bytes(plan.predicted_peak)})")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("lightning_ckpt/shape_plans", text, global_step=trainer.global_step)

    def _apply(self, plan: BucketPlan) -> None:
        self._apply_modes(plan.modes, plan.bucket, f"predicted activation peak {format_bytes(plan.predicted_peak)}")

    def _apply_modes(self, modes: Tuple[str, ...], bucket: Shape, why: str) -> None:
        if self.port.plan.modes != modes:
            self.port.set_modes(modes)
        self.port.plan.context = (f"planned per batch shape ({RULE}): bucket {bucket}, {why}, budget "
                                    f"{format_bytes(self.budget)}")

    # ------------------------------------------------------------------------------------------ the step's end
    def calibration_done(self) -> None:
        """The calibration chose and verified its plan: it becomes the reference of the memory model."""
        calibration = self.calibration
        self.planner.set_reference(self.calibration_shape, calibration.costs(), calibration.base,
                                   calibration.chosen, measured=dict(calibration.measured_plans),
                                   measured_peak=calibration.measured)

    def compiled_savings(self, modes: Sequence[str]) -> Optional[int]:
        """What the ``compiler:<f>`` blocks of ``modes`` save at the step's shape (its largest bucket's corner when
        micro-batches of several shapes ran): ``None`` before the calibration is done, when its own apply."""
        if not self.calibration.done or not self._step_buckets or self.planner.reference is None:
            return None
        bucket = max(self._step_buckets, key=lambda b: b.tokens)
        shape = next(iter(self._step_shapes)) if len(self._step_shapes) == 1 else None
        return self.planner.compiled_savings(bucket, modes, shape)

    def after_step(self, activations: Optional[int], step_s: Optional[float], tokens_per_sec: Optional[float],
                   metrics: Dict[str, float], key) -> None:
        """A step ended: count it in its bucket and, measured, check the bucket's prediction."""
        calibration = self.calibration
        bucket = max(self._step_buckets, key=lambda b: b.tokens) if self._step_buckets else None
        if bucket is None or not calibration.done:
            return
        # micro-batches of several shapes: the figure is the step's, not one shape's
        mixed = len(self._step_shapes) > 1
        shape = next(iter(self._step_shapes)) if self._step_shapes else None
        if not mixed and shape == self.calibration_shape and shape in self.planner.plans:
            bucket = shape  # the calibration's own shape: its plan is checked where it is kept
        error = self.planner.observe(bucket, self.port.plan.modes, None if mixed else activations, step_s,
                                     tokens_per_sec, shape=None if mixed else shape)
        metrics[key("shape/samples")] = float(bucket.samples)
        if bucket.lengths:
            metrics[key("shape/length")] = float(bucket.lengths[0])
        modes = self.port.plan.modes
        for mode in ("off", "selective", "recompute"):  # the step's plan, as a mix
            metrics[key(f"shape/blocks_{mode}")] = float(modes.count(mode))
        if error is not None:
            self.errors[bucket] = error
            metrics[key("memory/prediction_error_ratio")] = error
        cache = metrics.get(key("memory/cache_gib"))
        if cache is not None:  # CUDA: the allocator's cache at the step's peak, step after step
            self.cache.append(cache * GiB)

    def state_dict(self) -> Dict[str, Any]:
        """The calibration's shape, the longest shape found, and the buckets' plans (primitives)."""
        def shape(value: Optional[Shape]) -> Optional[List[int]]:
            return None if value is None else [value.samples, *value.lengths]

        return {"calibration_shape": shape(self.calibration_shape), "longest": shape(self.longest),
                "pricing_s": self.pricing_s, "planner": self.planner.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """After the calibration's own state: its reference again, then the saved buckets' plans."""
        def shape(values: Optional[Sequence[int]]) -> Optional[Shape]:
            return None if values is None else Shape(values[0], tuple(values[1:]))

        self.calibration_shape, self.longest = shape(state["calibration_shape"]), shape(state["longest"])
        self.pricing_s = float(state.get("pricing_s", 0.0))
        self._checked = self.calibration_shape is not None  # the longest length was found (and said) already
        if self.calibration.done and self.calibration_shape is not None:
            self.calibration_done()
            self.planner.load_state_dict(state["planner"])

    def cache_report(self) -> Optional[Dict[str, Any]]:
        """How the allocator's cache (reserved − allocated at a step's peak, CUDA) went over the run's varying
        shapes, with advice when it grew (fragmentation): ``None`` without readings."""
        if not self.cache:
            return None
        first, top = self.cache[0], max(self.cache)
        capacity = self.port.capacity
        grew = top - first > max(CACHE_GROWTH * (capacity or 0), 256 * 2**20)
        advice = (f"The allocator's cache grew from {format_bytes(first)} to {format_bytes(top)} while batch shapes "
                  "varied: that is fragmentation, memory reserved but not usable for the next shape. Set "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the run starts.") if grew else None
        return {"first": int(first), "max": int(top), "last": int(self.cache[-1]), "readings": len(self.cache),
                "advice": advice}

    def report(self) -> Dict[str, Any]:
        """The ``shape_plans`` of the report JSON: the bucket rule and, per bucket, its plan and what it did."""
        return {"rule": RULE,
                "calibration_shape": str(self.calibration_shape) if self.calibration_shape else None,
                "fallback": self._fallback,
                "buckets": {str(b): p.as_dict() for b, p in sorted(self.planner.plans.items())},
                "cache": self.cache_report()}


def _mix(modes: Sequence[str]) -> str:
    from lightning_ckpt.decide.budget import mode_mix

    if all(m == "recompute" for m in modes):
        return "every block recomputed"
    return mode_mix(modes)


def _describe(plan: BucketPlan) -> str:
    from lightning_ckpt.decide.budget import mode_mix

    fits = "fits" if plan.fits else f"does NOT fit (smallest feasible {format_bytes(plan.smallest_budget)})"
    return (f"{mode_mix(plan.modes)}, predicted activation peak {format_bytes(plan.predicted_peak)} ({plan.source}; "
            f"{fits})")

