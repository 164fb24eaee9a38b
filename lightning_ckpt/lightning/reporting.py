"""The end-of-fit report of one run: :class:`RunReport`.

It keeps what the report reads of the fit's measured steps — the last one's result and Lightning's step of it, the
last reference step's peaks with their tensors named, the activation bytes per sample at each sequence length a plan
met — and at the end of ``fit`` writes ``lightning_ckpt_report.json`` and ``memory_timeline.png`` beside the logs
(rank zero) and returns the printed text: the ledger with its remedies priced from the measured step
(:mod:`lightning_ckpt.decide.report`), the sections of the features that decided on the plan, and the peak's
anatomy (:mod:`lightning_ckpt.decide.anatomy`). It is a :class:`~lightning_ckpt.lightning.feature.Feature`, the
first of the engine's list: it hears of each measured step (``after_step``) before the features that decide on it,
and prints the report at the end of ``fit`` (``report=True``). It reaches the run through its
:class:`~lightning_ckpt.lightning.port.PlanPort`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Dict, Optional

from lightning_ckpt.decide.anatomy import anatomy_text, model_anatomy
from lightning_ckpt.decide.budget import mode_mix
from lightning_ckpt.decide.report import ledger_report, length_reading, report_text
from lightning_ckpt.forecast.precision import parse_precision
from lightning_ckpt.lightning.feature import Feature, StepEnd, StepNeeds
from lightning_ckpt.lightning.metrics import log_step
from lightning_ckpt.lightning.port import PlanPort
from lightning_ckpt.lightning.recovery import measured_remedies_of
from lightning_ckpt.measure.timeline import draw_timelines, matplotlib_available

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.measure.monitor import StepResult

__all__ = ["REPORT_FILE", "TIMELINE_FILE", "RunReport"]

REPORT_FILE = "lightning_ckpt_report.json"
TIMELINE_FILE = "memory_timeline.png"


class RunReport(Feature):
    """What the report reads of the fit's measured steps, and the report itself (see the module docstring).

    Args:
        port: what it reaches of the run (the door's name titles the timeline).
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self.last_result: Optional["StepResult"] = None  # the last *measured* step's, this fit
        self.last_step: Optional[tuple] = None  # (Lightning's step, logged) of last_result
        self.last_attribution: Optional[Dict[str, Any]] = None  # the last reference step's peaks, named
        # per plan (modes): sequence length -> activation bytes per sample, for the reading of how they grow
        # (one plan's lengths only: with per-shape plans a longer batch runs a stronger plan)
        self.by_length: Dict[tuple, Dict[int, float]] = {}

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Each fit reports its own steps."""
        self.last_result = self.last_step = self.last_attribution = None

    def step_needs(self, trainer: "pl.Trainer") -> StepNeeds:
        """The fit's first step is measured, so that a fit shorter than ``log_every_n_steps`` has a report."""
        s = self.port.settings
        return StepNeeds(measure=s.measure and s.report and not self.measured)

    def after_step(self, step: StepEnd) -> None:
        self.note(step.trainer, step.result, step.shape, step.logging)

    def fit_end(self, trainer: "pl.Trainer") -> None:
        """``report=True``: print the report (every rank makes it: ``trainer.log_dir`` is a collective under DDP)."""
        if self.port.settings.report and self.measured:
            text = self.text(trainer)
            if trainer.is_global_zero:
                print(text)

    @property
    def measured(self) -> bool:
        """Whether a step of this fit was measured (the report has something to say)."""
        return self.last_result is not None and self.last_result.ledger is not None

    def note(self, trainer: "pl.Trainer", result: "StepResult", shape: Any, logged: bool) -> None:
        """A measured step ended: ``shape`` its batch's (:class:`~lightning_ckpt.decide.shapes.Shape`), ``logged``
        whether Lightning logs at it."""
        self.last_result, self.last_step = result, (log_step(trainer), logged)
        modes = self.port.plan.modes if self.port.plan is not None else ()
        if result.reading is not None and result.reading.attribution:  # a reference step: what its peaks held
            self.last_attribution = {"step": trainer.global_step, "shape": shape, "modes": modes,
                                     "attribution": result.reading.attribution, "timeline": result.reading.timeline}
        length, samples = self.port.batch_shape or (None, 0)
        if length and samples and result.ledger.activations:
            lengths = self.by_length.setdefault(modes, {})
            lengths[length] = max(lengths.get(length, 0.0), result.ledger.activations / samples)

    def text(self, trainer: Optional["pl.Trainer"]) -> str:
        """The ledger report of the last measured step; with ``trainer`` rank zero also writes it as JSON and draws
        the timeline."""
        if not self.measured:
            return "lightning_ckpt: no step has been measured yet."
        plan, port = self.port.plan, self.port
        widest = max(self.by_length.values(), key=len, default={})  # the plan seen at the most lengths
        reading = length_reading(sorted(widest.items()))
        data = ledger_report(self.last_result.ledger, plan.spec if plan else "none", port.settings.ladder,
                             history={"activations_vs_seq_len": reading} if reading else None,
                             all_checkpointed=bool(plan and plan.num_checkpointed == plan.num_blocks),
                             remedies=measured_remedies_of(port))
        features = port.features
        for feature in features:
            data.update(feature.report_section())
        if self.last_step is not None:  # the step the report reads: Lightning's (TensorBoard's) step of it
            data["step"], data["logged"] = self.last_step
        if self.last_attribution is not None:
            data["peak"] = self.peak_anatomy(trainer)
        folder = (trainer.log_dir or trainer.default_root_dir) if trainer is not None else None
        if folder is not None and trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, REPORT_FILE), "w") as fh:
                json.dump(data, fh, indent=2)
            self._draw_timeline(trainer, folder)
        text = report_text(data) + "".join(feature.report_text(data) for feature in features)
        return text + ("\n" + anatomy_text(data["peak"]) if "peak" in data else "")

    def _draw_timeline(self, trainer: "pl.Trainer", folder: str) -> None:
        """The last reference step's memory over its operations: ``memory_timeline.png`` beside the report and a
        TensorBoard image (when matplotlib is installed; :mod:`lightning_ckpt.measure.timeline`)."""
        timeline = (self.last_attribution or {}).get("timeline")
        if timeline is None or not matplotlib_available():
            return
        last = self.last_attribution
        timeline.label = (f"step {last['step']}, batch {last['shape']}, plan {mode_mix(last['modes'])}")
        figure = draw_timelines([timeline], os.path.join(folder, TIMELINE_FILE),
                                f"{self.port.owner}: memory over one reference step")
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("lightning_ckpt/memory_timeline", figure, global_step=last["step"])
        import matplotlib.pyplot as plt

        plt.close(figure)

    def peak_anatomy(self, trainer: Optional["pl.Trainer"] = None) -> Dict[str, Any]:
        """The last reference step's attribution as the report's ``peak`` section
        (:mod:`lightning_ckpt.decide.anatomy`): its tensors, the blocks in hidden-width tensors, the findings."""
        last, module = self.last_attribution, self.port.module
        shape = last["shape"]
        try:  # the autocast dtype of Lightning's mixed precisions
            autocast = parse_precision(str(trainer.precision)).autocast_dtype if trainer is not None else None
        except ValueError:  # a plugin the forecast does not know (transformer-engine): the parameters' dtype
            autocast = None
        data = model_anatomy(last["attribution"], module, shape.samples, shape.lengths[0] if shape.lengths else None,
                             self.port.plan.names, last["modes"], autocast)
        data.update(step=last["step"], shape=str(shape), modes=list(last["modes"]))
        return data
