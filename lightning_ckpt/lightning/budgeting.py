"""``budget:`` in a Trainer: the calibration, the plans per batch shape, and what the run held against the budget.

The engine (:mod:`lightning_ckpt.lightning.engine`) starts one :class:`BudgetFeature` at each fit start when the
policy is a budget, and calls it at its hooks: before each micro-batch (the calibration's stage, or the batch's
bucket plan), at each optimizer step's end (its figures, the calibration's next stage), in the end-of-fit report,
in the checkpoint, at teardown. The feature reaches the run through its
:class:`~lightning_ckpt.lightning.port.PlanPort` only: it sets the blocks' modes through the port's safety check,
never the engine's bookkeeping.

- **The calibration** (:class:`~lightning_ckpt.decide.calibration.BudgetCalibration`) measures every block's
  bytes and time on the fit's first steps and chooses the plan; with the compiler's budget per block where each
  block is compiled as its own graph (and the torch has it).
- **The plans per batch shape** (:class:`~lightning_ckpt.lightning.shaped.ShapeSteps`), unless ``per_shape=False``
  or the blocks are one whole-model compiled graph (one plan: the budget's figures are eager ones there, and a
  warning says by how much such a graph can exceed them).
- **What the run held**: the highest activation peak a step read, calibration included, against the budget; a
  warning when no plan meets the budget, naming the smallest one that would; a warning when the fit ended before
  the calibration chose.
- **A resumed fit** goes on where the checkpoint's calibration and plans stopped (a warning, and a new
  calibration, when they do not fit the run).

Logged (with the engine's figures, on measured steps): ``blocks/<i>_kept_gib`` and ``blocks/<i>_replay_gib`` per
block of the chosen plan, and the per-shape figures of :mod:`lightning_ckpt.lightning.shaped`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence

import torch

from lightning_ckpt.core.policy import COMPILER_MODE, compiler_budget_unavailable
from lightning_ckpt.core.units import GiB, format_bytes
from lightning_ckpt.decide.budget import mode_mix
from lightning_ckpt.decide.calibration import COMPILER_FRACTIONS, BudgetCalibration
from lightning_ckpt.lightning.compiled import blocks_in_one_compiled_graph, compiled_block_caller, room_for_plans
from lightning_ckpt.lightning.feature import NOTHING, Feature, StepEnd, StepNeeds
from lightning_ckpt.lightning.metrics import block_metrics
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.lightning.shaped import ShapeSteps

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.measure.monitor import StepResult

__all__ = ["WHOLE_MODEL_COMPILE_BUDGET", "BudgetFeature"]


WHOLE_MODEL_COMPILE_BUDGET = (
    "lightning_ckpt: policy {spec!r} with the whole model under torch.compile: the plan is verified on eager "
    "reference steps, and one compiled graph around every block holds more activation memory than eager at the same "
    "plan (measured for 'all': +3 % to +24 % on the demo GPT, +26 % on a Hugging Face Llama; docs/compile-precision.md"
    "), so the budget can be exceeded by that much. Pass compile_blocks=True (or compile block by "
    "block yourself: block.compile()) to keep the budget's figures true and let it choose the compiler's budget per "
    "block, or leave the choice to the compiler: policy='none' and "
    "torch._functorch.config.activation_memory_budget = <fraction>, lowered until the run fits.")


class BudgetFeature(Feature):
    """A ``budget:`` policy's run in one fit (see the module docstring).

    Args:
        port: what the feature reaches of the run.
        meter: the step monitor's memory meter, which the calibration reads the blocks' bytes with.
        trainer: the Trainer at fit start.
        pl_module: the LightningModule being fitted.
    """

    state_key = "budget"
    made_at = "fit"

    @classmethod
    def wanted(cls, settings: Any) -> bool:
        return settings.budget is not None

    @classmethod
    def make(cls, port: PlanPort, trainer: "Optional[pl.Trainer]" = None,
             pl_module: "Optional[pl.LightningModule]" = None) -> "BudgetFeature":
        return cls(port, port.meter, trainer, pl_module)

    def __init__(self, port: PlanPort, meter: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.port = port
        settings, plan, device = port.settings, port.plan, trainer.strategy.root_device
        budget = settings.budget.budget
        self.budget = int(budget * port.capacity) if isinstance(budget, float) else budget
        self.worst: Optional[int] = None  # the highest activation peak a step read, calibration included
        self.shapes: Optional[ShapeSteps] = None
        self._restore_dynamo: Optional[Callable[[], None]] = None  # puts dynamo's recompile limit back
        self._warned_infeasible = False
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        # offload is a mode only where host memory is not the device's own memory
        modes = ("recompute", "selective", "offload") if device.type == "cuda" else ("recompute", "selective")
        caller = compiled_block_caller(pl_module, plan.blocks)
        one_graph = blocks_in_one_compiled_graph(pl_module, plan.blocks)
        # the compiler's budget is one per graph: a block's own only when it is compiled as its own graph
        # (and only with a torch that has it: the fractions are not offered on older releases)
        fractions = COMPILER_FRACTIONS if caller is not None and not one_graph and compiler_budget_unavailable() \
            is None else ()
        self.calibration = BudgetCalibration(plan, meter, self.budget, sync, apply=port.set_modes, modes=modes,
                                             block_caller=caller, compiler_fractions=fractions)
        if not one_graph and settings.per_shape:  # one whole-model graph: one plan (lightning/shaped.py)
            self._start_shapes(trainer, (*modes, *[COMPILER_MODE] * bool(fractions)),
                               len(modes) + 1 + len(fractions) if caller is not None else 0)
        if one_graph:
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(WHOLE_MODEL_COMPILE_BUDGET.format(spec=settings.start.spec))

    def _start_shapes(self, trainer: "pl.Trainer", modes: tuple, compiled_plans: int) -> None:
        """The plans per batch shape; dynamo's recompile limit raised to hold ``compiled_plans`` plans per block."""
        self.shapes = ShapeSteps(self.port, self.calibration, self.budget, modes)
        self.shapes.setup(trainer)
        self.calibration.predict = self.shapes.traced_at_calibration  # no stage predicted over the budget
        raised = room_for_plans(compiled_plans) if compiled_plans else None
        if raised:
            self._restore_dynamo = raised[1]
            self.port.info(raised[0])

    @property
    def calibrating(self) -> bool:
        """The calibration has not chosen and verified its plan yet."""
        return not self.calibration.done

    def retries_out_of_memory(self) -> bool:
        """A calibration step that runs out of memory is retried under a stronger plan: it is no stage."""
        return self.calibrating

    def escalated(self, failed: str, now: str) -> str:
        """A calibration step ran out of memory: the calibration takes back what its stage measured."""
        if not self.calibrating:
            return ""
        self.calibration.out_of_memory()
        return "a budget calibration step: recorded as not fitting, not as a stage"

    def step_needs(self, trainer: "pl.Trainer") -> StepNeeds:
        """A calibration step is measured with compiled code run eagerly (the blocks' hooks read each block)."""
        return StepNeeds(measure=True, eager=True) if self.calibrating else NOTHING

    def exact_reading(self) -> Any:
        """What the step monitor reads exactly on a calibration step (``None`` once the calibration is done)."""
        return self.calibration.exact_step if self.calibrating else None

    # ------------------------------------------------------------------------------------------ the step
    def before_micro_batch(self, trainer: "pl.Trainer", batch: Any, first: bool) -> None:
        """The bucket's plan (the calibration's stage on its own bucket); without plans per shape, the stage."""
        if self.shapes is not None:
            self.shapes.before_micro_batch(trainer, batch, first=first)
        elif first and (self.calibrating or self.calibration.pending):
            self.calibration.begin_step()

    def compiled_savings(self, modes: Sequence[str]) -> int:
        """What the ``compiler:<f>`` blocks of ``modes`` save at the step's shape (the calibration's own figure at
        its shape)."""
        savings = self.shapes.compiled_savings(modes) if self.shapes is not None else None
        return self.calibration.compiled_savings(modes) if savings is None else savings

    def read_step(self, result: "StepResult") -> "StepResult":
        """The step's figures with the ``compiler:<f>`` blocks' measured savings (at the step's shape, under per-shape
        plans) taken off the activation line. Its figure is counted eagerly (the plan's reference step, or that figure
        reused: the compiled step's saved tensors would miss the recompute inside those blocks' backward), where those
        blocks run ``off``."""
        savings = self.compiled_savings(self.port.plan.modes)
        if not savings or result.ledger.activations is None or not getattr(result.reading, "eager_figure", False):
            return result
        return dataclasses.replace(result, ledger=result.ledger.with_activations(result.ledger.activations - savings))

    def after_unmeasured_step(self, key: Callable[[str], str]) -> None:
        """A step that was not measured still counts in its bucket."""
        if self.shapes is not None:
            self.shapes.after_step(None, None, None, {}, key)

    def after_step(self, step: StepEnd) -> None:
        """A measured step ended: its figures join the step's metrics (the chosen plan per block, the bucket's), and
        the calibration takes its reading and moves to its next stage."""
        calibration, result, metrics, key = self.calibration, step.result, step.metrics, step.key
        if calibration.chosen is not None:  # this rank's plan: not reduced
            metrics.update(block_metrics(calibration.chosen, self.port.settings.prefix))
        if self.shapes is not None:
            reading = metrics.get(key("memory/activations_gib"))
            self.shapes.after_step(None if reading is None else round(reading * GiB),
                                   None if result.instrumented else result.step_s,
                                   metrics.get(key("throughput/tokens_per_sec")), metrics, key)
        activations = result.ledger.activations
        if activations is not None:  # the budget's worst step
            self.worst = max(self.worst or 0, activations)
        if self.calibrating and activations is not None:
            calibration.end_step(activations)
            for message in calibration.messages:
                self.port.info(message)
            calibration.messages.clear()
            self._warn_if_infeasible()
        # done at a step's end, or settled when its verifying step ran out of memory: the planner's reference now
        if self.shapes is not None and calibration.done and self.shapes.planner.reference is None:
            self.shapes.calibration_done()

    def _warn_if_infeasible(self) -> None:
        """A budget no plan meets is a warning (rank zero, once) naming the smallest feasible budget."""
        chosen = self.calibration.chosen
        if chosen is None or chosen.fits or self._warned_infeasible:
            return
        self._warned_infeasible = True
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"lightning_ckpt: raise the budget to at least {format_bytes(chosen.smallest_budget)} (or "
                       f"shorten the sequence or the micro-batch): no plan meets {self.port.settings.budget.spec!r}, "
                       "so the run uses the plan with the lowest predicted activation peak, "
                       f"{format_bytes(chosen.predicted_peak)}.")

    # ------------------------------------------------------------------------------------------ the end
    def fit_end(self, trainer: "pl.Trainer") -> None:
        """A fit that ended before the calibration chose: a warning saying how many steps it needs."""
        calibration = self.calibration
        if calibration.calibrating and trainer.is_global_zero:
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(
                f"lightning_ckpt: train at least {len(calibration.stages) + 1} steps for "
                f"{self.port.settings.budget.spec!r} to choose its plan, or pass a fixed policy: the run ended after "
                f"{calibration.stage} of its "
                f"{len(calibration.stages)} calibration steps, on a calibration plan ({self.port.plan.spec!r}).")

    def report_section(self) -> Dict[str, Any]:
        """The report's ``budget_plan`` (the chosen plan, per block), ``budget`` (what the run held) and
        ``shape_plans`` (per bucket) sections, each where it has something to say."""
        data: Dict[str, Any] = {}
        calibration, chosen = self.calibration, self.calibration.chosen
        if chosen is not None:
            data["budget_plan"] = {
                "budget": chosen.budget, "predicted_peak": chosen.predicted_peak, "measured": calibration.measured,
                "smallest_budget": chosen.smallest_budget, "added_s": chosen.recompute_s,
                "blocks": [{"mode": c.mode, "kept": c.kept, "saves": off.kept - c.kept, "replay": c.replay,
                            "seconds": c.seconds} for c, off in chosen.choices]}
        data["budget"] = self.figures()
        if self.shapes is not None and self.shapes.planner.plans:
            data["shape_plans"] = self.shapes.report()
        return data

    def figures(self) -> Dict[str, Any]:
        """What the budget held over the run: the highest activation peak a step read (calibration included) and
        its share of the budget, the calibration's length in steps, the longest length found, the pricing time."""
        calibration, shapes = self.calibration, self.shapes
        longest = shapes.longest if shapes is not None else None
        return {"worst_step": self.worst,
                "worst_step_ratio": None if self.worst is None else self.worst / calibration.budget,
                "calibration_steps": len(calibration.stages) + calibration.verifications,
                "longest": None if longest is None else str(longest),
                "pricing_s": shapes.pricing_s if shapes is not None else 0.0}

    def report_text(self, data: Dict[str, Any]) -> str:
        """The report's lines on the chosen plan per block, what the budget held, and the plans per batch shape with
        the allocator's advice."""
        chosen = self.calibration.chosen
        text = f"\n  per block, as the budget chose:\n{chosen.summary()}" if chosen else ""
        text += "\n" + _budget_line(data["budget"])
        if "shape_plans" not in data:
            return text
        text += "\n  per batch shape (micro-batch x length, buckets of powers of two):\n" + self.shapes.planner.table()
        cache = data["shape_plans"].get("cache")
        return text + (f"\n  - {cache['advice']}" if cache and cache["advice"] else "")

    # ------------------------------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        """The calibration, the worst step, the plans per shape: a resumed fit goes on without calibrating again."""
        return {"calibration": self.calibration.state_dict(), "worst": self.worst,
                "shapes": self.shapes.state_dict() if self.shapes is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A checkpoint's calibration and per-shape plans (a warning, and a new calibration, when they do not fit)."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        try:
            self.calibration.load_state_dict(state["calibration"])
            if self.shapes is not None and state.get("shapes"):
                self.shapes.load_state_dict(state["shapes"])
        except (KeyError, ValueError, TypeError, IndexError) as err:
            rank_zero_warn(f"lightning_ckpt: the budget measures its plans again: the checkpoint's budget state does "
                           f"not fit this run ({type(err).__name__}: {err}).")
            return
        self.worst = state.get("worst")
        calibration = self.calibration
        where = ("its plan " + mode_mix(calibration.chosen.modes) if calibration.done and calibration.chosen
                 else f"calibration step {calibration.stage + 1} of {len(calibration.stages)}")
        self.port.info(f"budget resumed from the checkpoint at {where}")

    def close(self) -> None:
        """The run ends: no hook of the calibration or the plans per shape stays; dynamo's limit as the user had it."""
        self.calibration.close()  # a run that ends while calibrating leaves no hook behind
        if self.shapes is not None:
            self.shapes.close()
        if self._restore_dynamo is not None:
            self._restore_dynamo()
            self._restore_dynamo = None


def _budget_line(figures: Dict[str, Any]) -> str:
    """The report's line on what the budget held: its worst step against it, the calibration, the longest length."""
    worst = figures.get("worst_step")
    parts = [f"worst step {format_bytes(worst)} ({figures['worst_step_ratio']:.0%} of the budget, the calibration's "
             "steps included)" if worst is not None else "no step measured",
             f"calibration {figures['calibration_steps']} steps"]
    if figures.get("longest"):
        parts.append(f"longest batch it holds {figures['longest']}")
    parts.append(f"{figures['pricing_s']:.1f} s pricing shapes on fake tensors")
    return "  budget: " + "; ".join(parts)
