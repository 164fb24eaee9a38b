"""The measured steps in the Trainer's loggers: :class:`LoggedCurves`, the feature a run with ``measure=True`` has.

It asks for the logging steps to be measured (Lightning's ``log_every_n_steps``: their figures agreed across ranks,
their time and tokens read), gives TensorBoard its chart layout at fit start (rank zero) and warns once when no logger
keeps the curves, and writes each logged step's figures once every feature has added its own
(:meth:`~lightning_ckpt.lightning.feature.Feature.figures_ready`, through
:func:`~lightning_ckpt.lightning.metrics.log_metrics`).

A logged step that ran the per-op instrumentation (an exact reference step, or one run eagerly for a calibration:
3-4x slow) cannot give the run's time and throughput: those are owed. The next steps are timed until an ordinary one
ends on every rank, and its time and throughput are logged at each owed step's place (the ranks agree on it in one
collective, so every rank settles at the same step). It reaches the run through its
:class:`~lightning_ckpt.lightning.port.PlanPort`.

Logged keys (each under the callback's ``prefix``): the step's ledger and time (see
:meth:`~lightning_ckpt.measure.monitor.StepResult.metrics`) and what the features add (see
:mod:`lightning_ckpt.lightning.metrics` for the whole list).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from lightning_ckpt.lightning.feature import Feature, StepEnd, StepNeeds
from lightning_ckpt.lightning.metrics import (
    INSTRUMENTED,
    log_metrics,
    log_step,
    prefixed,
    reduce_across_ranks,
    tensorboard_layout,
)
from lightning_ckpt.lightning.port import PlanPort

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_ckpt.lightning.settings import Settings
    from lightning_ckpt.measure.monitor import StepResult

__all__ = ["LoggedCurves"]


class LoggedCurves(Feature):
    """The measured figures in the Trainer's loggers (see the module docstring).

    Args:
        port: what it reaches of the run.
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self._owed: List[int] = []  # Lightning's steps of logged steps whose time and throughput are owed
        self._warned_no_logger = False

    @classmethod
    def wanted(cls, settings: "Settings") -> bool:
        return settings.measure

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Warn once when nothing will keep the curves; give TensorBoard its layout (rank zero)."""
        self._owed = []
        if not trainer.loggers and not self._warned_no_logger:
            self._warned_no_logger = True
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn("lightning_ckpt: measure=True but the Trainer has no logger, so the memory curves are not "
                           "saved; pass a logger (e.g. TensorBoardLogger) or measure=False.")
        if trainer.is_global_zero:
            from lightning.pytorch.loggers import TensorBoardLogger

            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(tensorboard_layout(self.port.settings.prefix))

    def step_needs(self, trainer: "pl.Trainer") -> StepNeeds:
        """A logging step is measured and logged; while a logged step's time is owed, every step is timed."""
        # settings.measure read again: a run may swap its settings (benchmarks/overhead.py measures every other step)
        logging = bool(self.port.settings.measure and trainer._logger_connector.should_update_logs)
        return StepNeeds(measure=logging, log=logging, timed=bool(self._owed))

    def step_ended(self, trainer: "pl.Trainer", result: "StepResult") -> None:
        """The time and throughput of the logged steps waiting for them, from this step when it is an ordinary one on
        every rank: logged at each of those steps. Every rank gets here at the same steps (the owed steps were agreed
        by the reduction)."""
        if not self._owed:
            return
        prefix = self.port.settings.prefix
        figures = {prefixed(prefix, "throughput/samples_per_sec"): 0.0, prefixed(prefix, "time/step_s"): 0.0}
        figures.update(result.throughput(prefix))
        figures[INSTRUMENTED] = float(result.instrumented or result.step_s is None)
        figures = reduce_across_ranks(trainer.strategy, figures, group=self.port.ranks.group)
        if figures.pop(INSTRUMENTED):  # this step ran it too: the next ordinary one times them all
            return
        for step in self._owed:
            log_metrics(trainer, figures, prefix, step=step)
        self.port.last_metrics.update(figures)  # the last measured step's figures, as the callback shows them
        self._owed = []

    def figures_ready(self, step: StepEnd) -> None:
        """A logging step's figures go to the loggers; a logged step that could not time itself is owed its time."""
        if not step.logging:
            return
        if step.time_owed:
            self._owed.append(log_step(step.trainer))
        log_metrics(step.trainer, step.metrics, self.port.settings.prefix)
