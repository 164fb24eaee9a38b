"""The ``ActivationCheckpointing`` callback: Lightning's hooks, translated into calls of the engine."""

from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_ckpt.core.policy import Policy
from lightning_ckpt.core.wrap import CheckpointPlan
from lightning_ckpt.decide.controller import Controller
from lightning_ckpt.lightning.autotoggle import AutoToggle
from lightning_ckpt.lightning.budgeting import BudgetFeature
from lightning_ckpt.lightning.conflicts import ENGINE_ATTR
from lightning_ckpt.lightning.engine import CheckpointingEngine
from lightning_ckpt.lightning.metrics import TENSORBOARD_LAYOUT
from lightning_ckpt.lightning.settings import Options, Settings

__all__ = ["TENSORBOARD_LAYOUT", "ActivationCheckpointing"]


class ActivationCheckpointing(Options, Callback):
    """Checkpoint the repeated Transformer blocks of the LightningModule during ``fit``, measure every step, decide.

    The blocks are patched in place (non-reentrant ``torch.utils.checkpoint``, RNG preserved): module paths,
    ``state_dict()`` keys and parameters never change, so checkpoints load with or without the callback. The
    ``*_ac`` strategies (``strategy="ddp_ac"``) put this same callback into the Trainer: both ways in are one
    product (:mod:`lightning_ckpt.lightning.engine`).

    What happens at which hook:

    - ``__init__``: every argument is validated; a bad value raises here.
    - ``setup(stage="fit")``: refuses a second owner (another instance of this callback, a ``*_ac`` strategy,
      Lightning FSDP's ``activation_checkpointing_policy``, DeepSpeed activation checkpointing) and arranges for
      the plan to be applied right before ``strategy.setup``.
    - right before ``strategy.setup`` (no callback hook exists there): the policy is applied. This is the first
      moment the final module tree exists (after ``LightningModule.setup`` and ``configure_model``) and the last
      one before the strategy wraps the model (DDP, or FSDP's auto-wrapping). With a ``ckpt_path``, Lightning
      has restored this callback's state just before (unless the strategy restores after setup, e.g. FSDP: then
      ``load_state_dict`` re-applies the saved plan at once), so the saved plan is in place before the first
      resumed step. When the configured policy differs from the saved one, the configured one wins, with a
      warning.
    - ``on_fit_start``: measurement starts (and the plan is applied if the strategy's ``setup`` was bypassed).
    - ``teardown`` / ``on_exception``: every hook and shim is removed.
    - validation, test, predict and the sanity check run the plain forward; nothing is recomputed.

    The plan stays on the model after ``fit`` (so ``fit`` again, or ``validate``, re-targets the same plan and
    nothing is wrapped twice); call :func:`lightning_ckpt.remove_checkpointing` to undo it.

    The arguments, each with its type, default and meaning, are those of
    :class:`~lightning_ckpt.lightning.settings.Options` (declared once there, for the callback and every ``*_ac``
    strategy).

    Attributes:
        plan: the :class:`~lightning_ckpt.core.wrap.CheckpointPlan` once applied (``None`` before ``fit``).
        controller: the auto-toggle :class:`~lightning_ckpt.decide.controller.Controller` (with
            ``auto_threshold``).
        last_metrics: the last measured step's logged figures (reduced across ranks).

    Logged metric keys (``measure=True``), once per *optimizer* step on the steps Lightning logs
    (``log_every_n_steps``; with gradient accumulation the figures cover all micro-batches of the step):

    - ``memory/peak_allocated_gib``, ``memory/peak_reserved_gib``: CUDA allocator peaks, reset every step (no
      device sync). On the CPU there is no allocator counter and these keys are not logged (no fake zeros); nor
      under CUDA graphs (``torch.compile(mode="reduce-overhead")``), whose memory pools make them meaningless: a
      one-time warning names the fix and the report says so (:mod:`lightning_ckpt.lightning.compiled`).
    - ``memory/params_gib``, ``memory/grads_gib``, ``memory/optimizer_gib`` (every tensor of the optimizer's
      state), ``memory/optimizer_master_gib`` (when master copies exist), ``memory/activations_gib`` (the
      step's activation peak including a block's replay transient; device independent, see
      :mod:`lightning_ckpt.measure.meter`), and on CUDA ``memory/other_gib`` and ``memory/cache_gib``
      (reserved − allocated).
    - ``throughput/tokens_per_sec``, ``throughput/samples_per_sec``, ``time/step_s``: tokens counted from the
      batch (``attention_mask`` non-padding when present, else the token tensor's size) or by ``tokens_fn``;
      time from the step's own start to its end (checkpoint saves, validation and the first batch's loading
      between steps excluded; a reference step's point is the next ordinary step's: docs/measurement.md): on CUDA
      the device's time between CUDA events, read on logging steps only (one wait there, none elsewhere).
    - ``checkpointing/blocks`` (blocks checkpointed this step) and ``checkpointing/level`` (the policy's
      position in the escalation ladder, with ``auto_threshold``).
    - The progress bar shows ``act_GiB`` and ``tok/s``. The figures are written to ``trainer.loggers`` directly
      (not through ``self.log``: no device tensor per value) and are in ``trainer.callback_metrics``.
    - Several processes: memory lines are the maximum over ranks, throughput the sum; only rank zero writes.
      With a ``TensorBoardLogger`` a custom-scalars layout puts the ledger lines in one "Memory" chart beside
      "Throughput" and "Checkpointing".

    Auto-toggle (``auto_threshold=...``): the controller reads the activation peak of every optimizer step
    (maximum over ranks, so every rank decides alike) and moves along ``ladder``: up as soon as the peak crosses
    the threshold, down after ``cooldown`` calm steps under ``release × threshold``, always between optimizer
    steps, by changing block modes in place. Its state is saved in checkpoints.

    Out of memory: the error that reaches you names the phase of the step (before forward, forward, backward,
    first or later optimizer step) with its likely cause and the last measured ledger; it is a
    ``torch.OutOfMemoryError`` raised from the original. With ``on_oom="escalate"`` the step is retried on the
    same batch one policy up the ladder until the ladder is exhausted.

    Budget (``policy="budget:18GiB"`` or ``"budget:0.5"`` of capacity): calibration steps (9 on the CPU, 13 on
    CUDA; see :class:`lightning_ckpt.decide.calibration.BudgetCalibration`) measure every block's bytes kept, replay
    transient and time in each mode, :func:`lightning_ckpt.decide.budget.plan_budget` picks, per block, ``off``,
    ``selective``, ``recompute`` or (CUDA) ``offload`` for the fastest plan whose predicted activation peak fits,
    the next step is measured against the prediction, and the plan is corrected once if it does not fit. The plan
    explains itself in ``callback.plan.summary()``, the report, and ``blocks/NN_kept_gib`` /
    ``blocks/NN_replay_gib``. **Per batch shape**: before each micro-batch's forward its shape's bucket (powers of
    two) gets a plan of its own, from the same solver on that shape's costs — priced on fake tensors of the model
    itself, carried into the device's units by the calibration — so a batch longer than any before it is planned
    before it runs and a shorter one pays no recompute it does not need; ``callback.shape_plans`` holds them, the
    report has a table, and ``shape/samples``, ``shape/length`` and ``memory/prediction_error_ratio`` are logged
    (:mod:`lightning_ckpt.lightning.shaped`). With the whole model under ``torch.compile`` a one-time warning points to
    ``compile_blocks=True`` (or compiling block by block yourself), or to the compiler's own
    ``activation_memory_budget``.

    Diagnosis: at the end of ``fit`` (and on :meth:`report`) rank zero prints the ledger table and the
    advice for its largest line, and writes ``lightning_ckpt_report.json`` beside the logs. Before the first step,
    and on every plan change, the plan is checked for replay hazards (``stateful``); with ``verify=True`` every
    checkpointed block of the first batch is run in its mode and plain, under the training step's precision, and
    compared (:func:`lightning_ckpt.decide.verify.verify_equivalence`).

    Known limitations:
        - Only ``fit`` applies the plan; ``validate``/``test``/``predict`` alone leave the model untouched.
        - Blocks created lazily inside the first ``forward`` are not found (build them in ``__init__``,
          ``setup`` or ``configure_model``).
        - A model already checkpointed by ``checkpoint_wrapper``, composable ``checkpoint`` or Hugging Face
          ``gradient_checkpointing_enable()`` is refused with an error instead of being checkpointed twice.
    """

    def _configure(self, settings: Settings) -> None:
        setattr(self, ENGINE_ATTR, CheckpointingEngine(settings, owner=type(self).__name__))

    # ------------------------------------------------------------------------------------------ what users read
    @property
    def _engine(self) -> CheckpointingEngine:
        return getattr(self, ENGINE_ATTR)

    @property
    def settings(self) -> Settings:
        """The validated arguments."""
        return self._engine.settings

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        return self._engine.plan

    @property
    def policy(self) -> Policy:
        """The configured starting policy."""
        return self._engine.policy

    @property
    def controller(self) -> Optional[Controller]:
        toggle = self._engine.feature(AutoToggle)
        return toggle.controller if toggle is not None else None

    @property
    def last_metrics(self) -> Dict[str, float]:
        return self._engine.last_metrics

    @property
    def last_result(self):
        return self._engine.last_result

    @property
    def calibration(self):
        budget = self._engine.feature(BudgetFeature)
        return budget.calibration if budget is not None else None

    @property
    def shape_plans(self) -> Dict[Any, Any]:
        """With ``budget:``: each batch-shape bucket's plan (:class:`~lightning_ckpt.decide.shape_plans.BucketPlan`:
        per-block modes, predicted and last measured activation peak, steps, step time, tokens/s), keyed by the
        bucket's :class:`~lightning_ckpt.decide.shapes.Shape`; empty otherwise."""
        budget = self._engine.feature(BudgetFeature)
        return dict(budget.shapes.planner.plans) if budget is not None and budget.shapes is not None else {}

    def report(self, trainer: Optional["pl.Trainer"] = None) -> str:
        """The ledger report of the last measured step; with ``trainer`` (call it on every rank under DDP) rank
        zero also writes it as JSON beside the logs."""
        return self._engine.report(trainer)

    # ------------------------------------------------------------------------------------------ hooks → engine
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._engine.setup(trainer, stage)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._engine.fit_start(trainer, pl_module)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.settings.zero_grad_before_forward:
            _zero_grad_before_forward(trainer, pl_module, batch_idx)
        self._engine.batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self._engine.before_backward()

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        self._engine.before_optimizer_step()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._engine.batch_end(trainer, pl_module)

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._engine.pause()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._engine.resume()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._engine.release(trainer)
        self._engine.annotate(exception)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._engine.fit_end(trainer)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._engine.release(trainer)

    def state_dict(self) -> Dict[str, Any]:
        return self._engine.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)

    def __repr__(self) -> str:
        auto = self._engine.settings.auto_threshold
        return f"{type(self).__name__}(policy={self.policy.spec!r}" + (
            f", auto_threshold={auto!r})" if auto is not None else ")")


def _zero_grad_before_forward(trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch_idx: int) -> None:
    """At the first micro-batch of a step (Lightning's own test: ``batch_idx % accumulate_grad_batches == 0``, where
    it zeroes them after ``training_step``) the previous step has finished: free its gradients now."""
    if not pl_module.automatic_optimization or batch_idx % trainer.accumulate_grad_batches:
        return
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)
