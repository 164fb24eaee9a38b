"""The ``ActivationCheckpointing`` callback: the Callback door to the checkpointing engine."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt._engine import (
    ENGINE_ATTR,
    CheckpointingEngine,
    EngineDoor,
    remove_before_strategy_setup,
    run_before_strategy_setup,
)
from lightning_ckpt.blocks import BlockSelector
from lightning_ckpt.budget import BudgetCalibration
from lightning_ckpt.controller import DEFAULT_LADDER, Controller, resolve_threshold
from lightning_ckpt.meter import count_samples, device_capacity, sequence_length
from lightning_ckpt.monitor import StepMonitor, StepResult
from lightning_ckpt.oom import OutOfMemoryDiagnosis, PhaseTracker, diagnose, is_out_of_memory
from lightning_ckpt.policy import BudgetPolicy, Policy, parse_policy
from lightning_ckpt.report import ledger_report, length_reading, report_text
from lightning_ckpt.safety import STATEFUL_CHOICES, preflight
from lightning_ckpt.units import GiB, parse_size
from lightning_ckpt.verify import verify_equivalence
from lightning_ckpt.wrap import register_replay_hook

__all__ = ["TENSORBOARD_LAYOUT", "ActivationCheckpointing"]

_ON_OOM = ("raise", "escalate")
_OOM_SHIM = "_lightning_ckpt_oom_guard"
REPORT_FILE = "lightning_ckpt_report.json"


def _layout(prefix: str) -> Dict[str, Dict[str, List[Any]]]:
    root = f"{prefix}/" if prefix else ""
    memory = [f"{root}memory/{k}_gib" for k in
              ("peak_allocated", "peak_reserved", "activations", "params", "grads", "optimizer", "other", "cache")]
    return {
        "Memory": {"ledger (GiB)": ["Multiline", memory]},
        "Throughput": {"tokens/s": ["Multiline", [f"{root}throughput/tokens_per_sec"]],
                       "samples/s": ["Multiline", [f"{root}throughput/samples_per_sec"]],
                       "step time (s)": ["Multiline", [f"{root}time/step_s"]]},
        "Checkpointing": {"blocks and level": ["Multiline", [f"{root}checkpointing/blocks",
                                                             f"{root}checkpointing/level"]]},
    }


TENSORBOARD_LAYOUT = _layout("")
"""The custom-scalars layout written to TensorBoard: one "Memory" chart with every ledger line."""

class ActivationCheckpointing(EngineDoor, Callback):
    """Checkpoint the repeated Transformer blocks of the LightningModule during ``fit``.

    The blocks are patched in place (non-reentrant ``torch.utils.checkpoint``, RNG preserved): module paths,
    ``state_dict()`` keys and parameters never change, so checkpoints load with or without the callback.

    What happens at which hook:

    - ``__init__``: the policy, the selector and the options are validated; a bad value raises here.
    - ``setup(stage="fit")``: refuses a second owner (another instance of this callback, a ``*_ac``
      strategy, Lightning FSDP's ``activation_checkpointing_policy``, DeepSpeed activation checkpointing) and
      arranges for the plan to be applied right before ``strategy.setup``.
    - right before ``strategy.setup`` (no callback hook exists there): the policy is applied. This is the
      first moment the final module tree exists (after ``LightningModule.setup`` and ``configure_model``,
      which run after this callback's ``setup``) and the last one before the strategy wraps the model (DDP,
      or FSDP's auto-wrapping, which would hide the blocks inside FSDP units). With a ``ckpt_path``,
      Lightning has restored this callback's state just before (unless the strategy restores after setup),
      so the saved plan is re-applied here too.
    - ``load_state_dict``: if the plan exists already (strategies with ``restore_checkpoint_after_setup``,
      e.g. FSDP, restore after ``strategy.setup``), the saved plan is re-applied immediately; either way it is
      in place before the first resumed step. When the configured policy differs from the saved one, the
      configured one wins with a warning.
    - ``on_fit_start``: a safety net that applies the plan if the strategy's ``setup`` was bypassed.
    - ``teardown`` / ``on_exception``: the one-shot hook is removed if it never fired (a run that failed
      before ``strategy.setup``), so the strategy is left as it was.
    - validation, test, predict and the sanity check run the plain forward (the blocks are in ``eval()`` mode
      or grad is disabled); nothing is recomputed.

    The plan stays on the model after ``fit`` (so ``fit`` again, or ``validate``, re-targets the same plan and
    nothing is wrapped twice); call :func:`lightning_ckpt.remove_checkpointing` to undo it.

    Args:
        policy: which blocks to checkpoint and how: ``"all"``, ``"none"``, ``"every:N"``, ``"first:K"``,
            ``"blocks:0-5,9"``, ``"group:K"``, ``"group:sqrt"``, ``"selective"``, ``"selective:mm,sdpa"``,
            ``"offload"`` (or a :class:`~lightning_ckpt.policy.Policy`). ``None``: ``"all"``, or with
            ``auto_threshold`` the bottom rung of ``ladder``.
        blocks: which modules are the blocks: ``None`` detects them; otherwise a class name (``"GPT2Block"``),
            a path glob (``"model.layers.*"``), an ``nn.Module`` class, or a list of these.
        preserve_rng_state: replay dropout with the same random state (keep ``True`` when dropout is active).
        determinism_check: ``"default"`` checks that recomputed tensors match the originals' metadata;
            ``"none"`` skips the check.
        debug: add operator traces to checkpoint errors (slow).
        measure: log the ledger, throughput and checkpointing metrics.
        exact_every_n_steps: make every n-th measured step an exact (per-op, slow) calibration step; 0 never.
        tokens_fn: ``tokens_fn(batch) -> int`` to count tokens yourself.
        prefix: root for the metric names (``"ac"`` gives ``ac/memory/...``).
        auto_threshold: activation peak that triggers more checkpointing: a size (``"18GiB"``, ``"512MiB"``,
            bytes) or a fraction of capacity (``0.8``). ``None`` disables auto-toggling.
        capacity: device capacity (``"24GiB"``) when it cannot be read from the device (CPU) or when planning
            for another card.
        ladder: policy strings from least to most checkpointing (default ``["none", "every:2", "all"]``).
        release: a lower rung is taken when its predicted peak stays under ``release × auto_threshold``.
        cooldown: optimizer steps of calm before stepping down, and the minimum dwell after a switch.
        on_oom: ``"raise"`` (diagnose and re-raise) or ``"escalate"`` (retry the step one rung up).
        stateful: modules with running statistics in checkpointed blocks: ``"warn"``, ``"skip"`` (keep those
            blocks un-checkpointed) or ``"error"``.
        verify: compare one checkpointed and one plain step on the first batch before training.
        report: print and save the ledger report at the end of ``fit``.

    Attributes:
        plan: the :class:`~lightning_ckpt.wrap.CheckpointPlan` once applied (``None`` before ``fit``).

    Known limitations:
        - Only ``fit`` applies the plan; ``validate``/``test``/``predict`` alone leave the model untouched.
        - Blocks created lazily inside the first ``forward`` are not found (build them in ``__init__``,
          ``setup`` or ``configure_model``).
        - A model already checkpointed by ``checkpoint_wrapper``, composable ``checkpoint`` or Hugging Face
          ``gradient_checkpointing_enable()`` is refused with an error instead of being checkpointed twice.
        - ``budget:`` re-calibrates after a resume (two steps at about the ``every:2`` memory level); each rank
          calibrates on its own measurements.
        - The ``*_ac`` strategies apply a fixed policy only; measurement, auto-toggling and diagnosis are
          this callback's (use it with a plain strategy).

    Measurement (``measure=True``, the default), once per *optimizer* step (with gradient accumulation the
    figures cover all micro-batches of the step), on the steps Lightning logs (``log_every_n_steps``):

    - ``memory/peak_allocated_gib``, ``memory/peak_reserved_gib``: CUDA allocator peaks, reset every step (no
      device sync). On the CPU there is no allocator counter and these keys are not logged (no fake zeros).
    - ``memory/params_gib``, ``memory/grads_gib``, ``memory/optimizer_gib`` (every tensor of the optimizer's
      state), ``memory/optimizer_master_gib`` (when master copies exist), ``memory/activations_gib`` (the
      step's activation peak including a block's replay transient; device independent, see
      :mod:`lightning_ckpt.meter`), and on CUDA ``memory/other_gib`` and ``memory/cache_gib``
      (reserved − allocated).
    - ``throughput/tokens_per_sec``, ``throughput/samples_per_sec``, ``time/step_s``: tokens counted from the
      batch (``attention_mask`` non-padding when present, else the token tensor's size) or by ``tokens_fn``;
      time from the end of the previous optimizer step, validation excluded. (Lightning's ``Throughput``
      averages over a window of steps; these are per-step figures, so it is not used.)
    - ``checkpointing/blocks`` (blocks checkpointed this step) and ``checkpointing/level`` (rung of the
      escalation ladder, with ``auto_threshold``).
    - The progress bar shows ``act_GiB`` and ``tok/s``.
    - Several processes: memory lines are the maximum over ranks, throughput the sum (Lightning's
      ``sync_dist`` reduction); only rank zero writes. With a ``TensorBoardLogger`` a custom-scalars layout
      puts the ledger lines in one "Memory" chart beside "Throughput" and "Checkpointing".

    Auto-toggle (``auto_threshold=...``): a :class:`~lightning_ckpt.controller.Controller` reads the activation
    peak of every optimizer step (maximum over ranks, so every rank decides alike) and moves along ``ladder``
    (default ``none → every:2 → all``): up as soon as the peak crosses the threshold, down after ``cooldown``
    calm steps under ``release × threshold``. Switches happen between optimizer steps by changing block modes in
    place. Training starts at the bottom rung unless ``policy`` names a rung. Each switch is printed once on
    rank zero. The controller's state is saved in checkpoints.

    Out of memory: the error that reaches you names the phase of the step (before forward, forward, backward,
    first or later optimizer step) with the seed's suspect and the last measured ledger; it is a
    ``torch.OutOfMemoryError`` raised from the original. With ``on_oom="escalate"`` the step is retried on the
    same batch one rung up the ladder (no optimizer step is applied twice, no batch skipped) until the ladder
    is exhausted.

    Budget (``policy="budget:18GiB"`` or ``"budget:0.5"`` of capacity): two calibration steps measure every
    block's saved bytes and forward time, :func:`lightning_ckpt.budget.plan_budget` picks the per-block plan
    with the least replay time whose predicted activation peak fits, the next step's measurement is compared
    with the prediction, and the plan is corrected once if it does not fit. The plan and prediction vs
    measurement are printed on rank zero.

    Diagnosis: at the end of ``fit`` (and on :meth:`report`) rank zero prints the ledger table and the seed's
    advice, and writes ``lightning_ckpt_report.json`` beside the logs. Before the first step the plan is checked
    for replay hazards (``stateful``) and, with ``verify=True``, the first batch is run with and without
    checkpointing and compared (:func:`lightning_ckpt.verify.verify_equivalence`).
    """


    def __init__(
        self,
        policy: Optional[str] = None,
        blocks: BlockSelector = None,
        preserve_rng_state: bool = True,
        determinism_check: Literal["default", "none"] = "default",
        debug: bool = False,
        measure: bool = True,
        exact_every_n_steps: int = 0,
        tokens_fn: Optional[Callable[[Any], Any]] = None,
        prefix: str = "",
        auto_threshold: Optional[Union[str, int, float]] = None,
        capacity: Optional[Union[str, int]] = None,
        ladder: Optional[List[str]] = None,
        release: float = 0.8,
        cooldown: int = 20,
        on_oom: Literal["raise", "escalate"] = "raise",
        stateful: Literal["warn", "skip", "error"] = "warn",
        verify: bool = False,
        report: bool = True,
    ) -> None:
        self.ladder = tuple(ladder) if ladder is not None else DEFAULT_LADDER
        self._check_arguments(auto_threshold, capacity, on_oom, stateful, exact_every_n_steps, prefix)
        self.budget_policy = self._budget_policy(policy, auto_threshold, capacity)
        start = "every:2" if self.budget_policy is not None else self._starting_policy(policy, auto_threshold)
        engine = CheckpointingEngine(
            start, blocks, preserve_rng_state=preserve_rng_state, determinism_check=determinism_check,
            debug=debug, owner=type(self).__name__,
        )
        setattr(self, ENGINE_ATTR, engine)
        self.measure, self.exact_every_n_steps, self.tokens_fn, self.prefix = (
            measure, exact_every_n_steps, tokens_fn, prefix)
        self.auto_threshold = auto_threshold
        self.capacity = None if capacity is None else parse_size(capacity, name="capacity")
        self.release, self.cooldown, self.on_oom, self.stateful = release, cooldown, on_oom, stateful
        self.verify, self.make_report = verify, report
        self.controller: Optional[Controller] = None
        if auto_threshold is not None:  # validate release/cooldown/threshold now, before any training
            Controller(threshold=resolve_threshold(auto_threshold, self.capacity or 2**62), ladder=self.ladder,
                       release=release, cooldown=cooldown, level=self.ladder.index(engine.policy.spec))
        self.monitor: Optional[StepMonitor] = None
        self.calibration: Optional[BudgetCalibration] = None
        self.phase = PhaseTracker()
        self.last_metrics: Dict[str, float] = {}
        self.last_result: Optional[StepResult] = None
        self._pending_controller: Optional[Dict[str, Any]] = None
        self._verified = False
        self._warned_no_logger = False
        self._forward_hook = None
        self._replay_handle = None
        self._replaying: Optional[str] = None  # the region replayed last: named when its replay misbehaves
        self._by_length: Dict[int, float] = {}  # sequence length -> activation bytes per sample (report)
        self._batch_shape: Optional[tuple] = None

    # ------------------------------------------------------------------------------ argument validation
    def _check_arguments(self, auto_threshold, capacity, on_oom, stateful, exact_every_n_steps, prefix) -> None:
        if on_oom not in _ON_OOM:
            raise ValueError(f"on_oom={on_oom!r} is not valid; choose one of {list(_ON_OOM)}.")
        if stateful not in STATEFUL_CHOICES:
            raise ValueError(f"stateful={stateful!r} is not valid; choose one of {list(STATEFUL_CHOICES)}.")
        if isinstance(exact_every_n_steps, bool) or not isinstance(exact_every_n_steps, int) or exact_every_n_steps < 0:
            raise ValueError(f"exact_every_n_steps={exact_every_n_steps!r} must be an integer ≥ 0 (0 = never).")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix={prefix!r} must be a string such as 'ac' (or '' for none).")
        for rung in self.ladder:
            if parse_policy(rung).name == "budget":
                raise ValueError(f"ladder rung {rung!r}: a budget policy cannot be a rung; use fixed policies.")
        if len(set(self.ladder)) != len(self.ladder) or len(self.ladder) < 2:
            raise ValueError(f"ladder={list(self.ladder)!r} needs at least two different policies, e.g. "
                             "['none', 'every:2', 'all'].")
        if auto_threshold is not None:
            cap = None if capacity is None else parse_size(capacity, name="capacity")
            from lightning_ckpt.units import parse_size_or_fraction

            if isinstance(parse_size_or_fraction(auto_threshold, name="auto_threshold"), float) and cap is None \
                    and not torch.cuda.is_available():
                raise ValueError(
                    f"auto_threshold={auto_threshold!r} is a fraction of device capacity, but there is no CUDA "
                    "device to read it from. Pass capacity='24GiB' (the card you plan for) or an absolute "
                    "threshold such as auto_threshold='18GiB'."
                )

    @staticmethod
    def _budget_policy(policy, auto_threshold, capacity) -> Optional[BudgetPolicy]:
        parsed = None if policy is None else parse_policy(policy)
        if not isinstance(parsed, BudgetPolicy):
            return None
        if auto_threshold is not None:
            raise ValueError(f"policy={parsed.spec!r} chooses the plan itself; it cannot be combined with "
                             "auto_threshold. Use one of the two.")
        if isinstance(parsed.budget, float) and capacity is None and not torch.cuda.is_available():
            raise ValueError(f"policy={parsed.spec!r} is a fraction of device capacity, but there is no CUDA device "
                             "to read it from. Pass capacity='24GiB' or an absolute budget such as 'budget:18GiB'.")
        return parsed

    def _starting_policy(self, policy: Optional[str], auto_threshold) -> Union[str, Policy]:
        if auto_threshold is None:
            return "all" if policy is None else policy
        if policy is None:
            return self.ladder[0]
        spec = parse_policy(policy).spec
        if spec not in self.ladder:
            raise ValueError(
                f"policy={policy!r} is not a rung of ladder {list(self.ladder)}; with auto_threshold the policy "
                "names the starting rung. Leave policy unset to start at the bottom, or add it to the ladder."
            )
        return spec

    # ------------------------------------------------------------------------------------ set-up
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._engine.begin_run()
        self._engine.check_trainer(trainer)
        if stage == "fit":
            self._refuse_static_graph(trainer)
            run_before_strategy_setup(trainer.strategy, self._apply)
            _install_oom_guard(trainer.strategy, self)

    def _refuse_static_graph(self, trainer: "pl.Trainer") -> None:
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", None) or {}
        if self.auto_threshold is not None and kwargs.get("static_graph"):
            raise ValueError(
                "DDP static_graph=True with auto_threshold: static_graph records the autograd graph of the first "
                "iterations and assumes it never changes, but switching checkpointing on or off changes which "
                "tensors are saved and when gradients become ready. Drop static_graph=True, or drop "
                "auto_threshold and use a fixed policy."
            )

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.plan is None:
            self._apply(trainer)
        self._start_measuring(trainer, pl_module)

    def _apply(self, trainer: "pl.Trainer") -> None:
        plan = self._engine.apply(trainer.lightning_module)
        skipped = preflight(plan, self.stateful)
        if skipped:
            rank_zero_info(f"lightning_ckpt: kept {skipped} un-checkpointed (running statistics, stateful='skip').")
        if self.auto_threshold is not None:
            self._build_controller(trainer)
        rank_zero_info(plan.summary().splitlines()[0])

    def _build_controller(self, trainer: "pl.Trainer") -> None:
        capacity = self.capacity or device_capacity(trainer.strategy.root_device)
        threshold = resolve_threshold(self.auto_threshold, capacity)
        level = self.ladder.index(self._engine.policy.spec)
        self.controller = Controller(threshold=threshold, ladder=self.ladder, release=self.release,
                                     cooldown=self.cooldown, level=level)
        if self._pending_controller is not None:
            for note in self.controller.load_state_dict(self._pending_controller):
                rank_zero_warn(f"lightning_ckpt: {note}")
            self._pending_controller = None
            self.plan.retarget(self.controller.policy)

    def _start_measuring(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        device = trainer.strategy.root_device
        capacity = self.capacity or device_capacity(device)
        self.monitor = StepMonitor(device, tokens_fn=self.tokens_fn, capacity=capacity,
                                   exact_every_n_steps=self.exact_every_n_steps)
        self.monitor.watch(pl_module)
        if self._replay_handle is None:
            self._replay_handle = register_replay_hook(self._note_replay)
        if self.budget_policy is not None and self.plan is not None:
            budget = self.budget_policy.budget
            budget = int(budget * capacity) if isinstance(budget, float) else budget
            sync = torch.cuda.synchronize if device.type == "cuda" else None
            self.calibration = BudgetCalibration(self.plan, self.monitor.meter, budget, sync)
        if self.plan is not None and self.plan.blocks and self._forward_hook is None:
            self._forward_hook = self.plan.blocks[0].register_forward_pre_hook(lambda *_: self.phase.forward_start())
        if self.measure and not trainer.loggers and not self._warned_no_logger:
            self._warned_no_logger = True
            rank_zero_warn("lightning_ckpt: measure=True but the Trainer has no logger, so the memory curves "
                           "are not saved; pass a logger (e.g. TensorBoardLogger) or measure=False.")
        if self.measure and trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(_layout(self.prefix))

    # ------------------------------------------------------------------------------------ the step
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.verify and not self._verified:
            self._verify(pl_module, batch, batch_idx)
        self.phase.batch_start()
        if self.monitor is None:
            return
        if not self.monitor.in_step:
            self._batch_shape = (sequence_length(batch), count_samples(batch))
            if self.calibration is not None and not self.calibration.done:
                self.calibration.begin_step()
            self.monitor.begin_step(measure=self._measuring_this_step(trainer))
        self.monitor.add_batch(batch)

    def _note_replay(self, owner: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        members = getattr(owner, "members", None)
        self._replaying = f"{members[0].name}…{members[-1].name}" if members else owner.name
        return fn(*args, **kwargs)

    def _replay_error(self, err: CheckpointError) -> CheckpointError:
        return CheckpointError(
            f"lightning_ckpt: checkpointed block {self._replaying!r} computed something different when it was "
            "replayed in backward (determinism_check): a checkpointed region must be close to a pure function — "
            "no data-dependent shapes, no reads of mutable Python state, no randomness outside torch's RNG. "
            "Keep that block un-checkpointed (blocks= or policy='blocks:...'), make it pure, or see README "
            f"'Diagnosis' (replay safety). Original error: {err}"
        )

    def _measuring_this_step(self, trainer: "pl.Trainer") -> bool:
        wanted = self.measure and trainer._logger_connector.should_update_logs
        calibrating = self.calibration is not None and not self.calibration.done
        return bool(wanted or self.controller is not None or calibrating)

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self.phase.backward_start()

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        self.phase.optimizer_step_start()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate() or self.monitor is None or not self.monitor.in_step:
            return
        self.phase.optimizer_step_end()
        plan = self.plan
        result = self.monitor.end_step(pl_module, trainer.optimizers, plan.num_checkpointed if plan else 0)
        self.last_result = result
        if result.ledger is None:
            return
        self._note_length(result)
        metrics = result.metrics(self.prefix)
        metrics = self._reduce(trainer, metrics)
        if self.controller is not None:
            metrics[self._key("checkpointing/level")] = float(self.controller.level)
        self.last_metrics = metrics
        if self.measure and trainer._logger_connector.should_update_logs:
            self._log(pl_module, metrics)
        if self.controller is not None:
            self._decide(trainer, metrics)
        if self.calibration is not None and not self.calibration.done and result.ledger.activations is not None:
            self.calibration.end_step(result.ledger.activations)
            for message in self.calibration.messages:
                rank_zero_info(f"lightning_ckpt: {message}")
            self.calibration.messages.clear()

    def _note_length(self, result: StepResult) -> None:
        length, samples = self._batch_shape or (None, 0)
        if length and samples and result.ledger.activations:
            per_sample = result.ledger.activations / samples
            self._by_length[length] = max(self._by_length.get(length, 0.0), per_sample)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _reduce(self, trainer: "pl.Trainer", metrics: Dict[str, float]) -> Dict[str, float]:
        """Max over ranks for memory, sum for throughput: one collective each (Lightning's strategy.reduce)."""
        if trainer.world_size <= 1:
            return metrics
        keys = sorted(metrics)
        summed = [k for k in keys if "/throughput/" in f"/{k}"]
        maxed = [k for k in keys if k not in summed]
        device = trainer.strategy.root_device
        out = dict(metrics)
        for names, op in ((maxed, "max"), (summed, "sum")):
            if names:
                values = trainer.strategy.reduce(torch.tensor([metrics[k] for k in names], device=device,
                                                              dtype=torch.float64), reduce_op=op)
                out.update(zip(names, values.tolist()))
        return out

    def _log(self, pl_module: "pl.LightningModule", metrics: Dict[str, float]) -> None:
        # values are already reduced across ranks; Lightning writes them on rank zero only
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=True, prog_bar=False)
        act = metrics.get(self._key("memory/activations_gib"))
        bar = {"tok/s": metrics[self._key("throughput/tokens_per_sec")]}
        if act is not None:
            bar["act_GiB"] = act
        pl_module.log_dict(bar, on_step=True, on_epoch=False, logger=False, prog_bar=True)

    def _decide(self, trainer: "pl.Trainer", metrics: Dict[str, float]) -> None:
        reading = metrics.get(self._key("memory/activations_gib"))
        if reading is None:
            return
        decision = self.controller.observe(reading * GiB)
        if decision.changed:
            self.plan.retarget(decision.policy)
            rank_zero_info(f"lightning_ckpt: step {trainer.global_step}: {decision.reason} "
                           f"({self.plan.num_checkpointed}/{self.plan.num_blocks} blocks checkpointed)")

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.monitor is not None:
            self.monitor.pause()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.monitor is not None:  # only the validation run is cut out; the next batch's loading still counts
            self.monitor.resume()

    # ------------------------------------------------------------------------------------ out of memory
    def _guarded_step(self, original: Callable[..., Any], optimizer: Any, closure: Callable[[], Any],
                      *args: Any, **kwargs: Any) -> Any:
        """Run ``strategy.optimizer_step`` with a closure that retries on OOM (escalate) or diagnoses it."""

        def retrying_closure() -> Any:
            while True:
                try:
                    return closure()
                except CheckpointError as err:
                    raise self._replay_error(err) from err
                except Exception as err:  # noqa: BLE001 - only out-of-memory errors are handled
                    if not is_out_of_memory(err):
                        raise
                    if not self._escalate(optimizer, err):
                        raise self._diagnosis(err) from err

        try:
            return original(optimizer, retrying_closure, *args, **kwargs)
        except OutOfMemoryDiagnosis:
            raise
        except Exception as err:  # noqa: BLE001
            if is_out_of_memory(err):
                raise self._diagnosis(err) from err
            raise

    def _escalate(self, optimizer: Any, err: BaseException) -> bool:
        """Free what the failed step held and move one rung up; ``False`` when that is not possible."""
        plan = self.plan
        if self.on_oom != "escalate" or plan is None:
            return False
        current = plan.spec
        rungs = list(self.ladder)
        level = rungs.index(current) if current in rungs else -1
        if level + 1 >= len(rungs):
            return False
        optimizer.zero_grad(set_to_none=True)
        err.__traceback__ = None  # the traceback's frames hold the failed step's tensors
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        plan.retarget(rungs[level + 1])
        if self.controller is not None:
            self.controller.level = level + 1
            self.controller.since_switch = self.controller.calm_steps = 0
        self.phase.batch_start()
        rank_zero_info(f"lightning_ckpt: out of memory in the {self.phase.phase.replace('_', ' ')} phase; retrying "
                       f"the same batch with policy {rungs[level + 1]!r} ({plan.num_checkpointed}/"
                       f"{plan.num_blocks} blocks checkpointed)")
        return True

    def _diagnosis(self, err: BaseException) -> OutOfMemoryDiagnosis:
        lines = {k.split("memory/")[-1].removesuffix("_gib"): v for k, v in self.last_metrics.items()
                 if "memory/" in k}
        capacity = self.monitor.capacity if self.monitor is not None else self.capacity
        text = diagnose(self.phase.phase, lines, capacity)
        if self.on_oom == "escalate":
            text += f"\nThe escalation ladder {list(self.ladder)} is exhausted."
        return OutOfMemoryDiagnosis(f"{text}\nOriginal error: {err}", self.phase.phase)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._release(trainer)
        if is_out_of_memory(exception) and not isinstance(exception, OutOfMemoryDiagnosis):
            # out of the guarded closure (a gradient-accumulation micro-batch): attach the diagnosis as a note
            exception.add_note(str(self._diagnosis(exception)))

    # ------------------------------------------------------------------------------------ end of fit
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.make_report and self.last_result is not None and self.last_result.ledger is not None:
            text = self.report(trainer)  # every rank: trainer.log_dir is a collective under DDP
            if trainer.is_global_zero:
                print(text)

    def report(self, trainer: Optional["pl.Trainer"] = None) -> str:
        """The ledger report of the last measured step.

        With ``trainer`` (call it on every rank under DDP) rank zero also writes it as JSON beside the logs.
        """
        if self.last_result is None or self.last_result.ledger is None:
            return "lightning_ckpt: no step has been measured yet."
        plan = self.plan
        reading = length_reading(sorted(self._by_length.items()))
        data = ledger_report(self.last_result.ledger, plan.spec if plan else "none", self.ladder,
                             history={"activations_vs_seq_len": reading} if reading else None,
                             all_checkpointed=bool(plan and plan.num_checkpointed == plan.num_blocks))
        folder = (trainer.log_dir or trainer.default_root_dir) if trainer is not None else None
        if folder is not None and trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, REPORT_FILE), "w") as fh:
                json.dump(data, fh, indent=2)
        return report_text(data)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._release(trainer)

    def _release(self, trainer: "pl.Trainer") -> None:
        """Remove every hook and shim this callback installed (teardown, or a run that raised)."""
        remove_before_strategy_setup(trainer.strategy)
        _remove_oom_guard(trainer.strategy)
        for name in ("_forward_hook", "_replay_handle"):
            handle = getattr(self, name)
            if handle is not None:
                handle.remove()
                setattr(self, name, None)
        if self.monitor is not None:
            self.monitor.close()

    # ------------------------------------------------------------------------------------ verification
    def _verify(self, pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._verified = True
        if self.plan is None or not self.plan.num_checkpointed:
            return

        def loss_fn() -> torch.Tensor:
            out = pl_module.training_step(batch, batch_idx)
            return out["loss"] if isinstance(out, dict) else out

        report = verify_equivalence(pl_module, self.plan, loss_fn)
        rank_zero_info("lightning_ckpt verify: checkpointed and plain step agree\n" + report.table())

    # ------------------------------------------------------------------------------------ persistence
    def state_dict(self) -> Dict[str, Any]:
        state = self._engine.state_dict()
        if self.controller is not None:
            state = dict(state, controller=self.controller.state_dict())
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state = dict(state_dict)
        controller = state.pop("controller", None)
        if controller is not None and self.auto_threshold is not None:
            if self.controller is not None:  # restored after setup (e.g. FSDP)
                self.controller.load_state_dict(controller)
                self.plan.retarget(self.controller.policy)
            else:
                self._pending_controller = controller
        self._engine.load_state_dict(state)

    def __repr__(self) -> str:
        auto = f", auto_threshold={self.auto_threshold!r}" if self.auto_threshold is not None else ""
        return f"{type(self).__name__}(policy={self.policy.spec!r}{auto})"


def _install_oom_guard(strategy: Any, callback: ActivationCheckpointing) -> None:
    """Put the callback's out-of-memory handling around ``strategy.optimizer_step`` (removed at teardown)."""
    _remove_oom_guard(strategy)
    original = strategy.optimizer_step

    def optimizer_step(optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        return callback._guarded_step(original, optimizer, closure, *args, **kwargs)

    setattr(optimizer_step, _OOM_SHIM, True)
    strategy.optimizer_step = optimizer_step


def _remove_oom_guard(strategy: Any) -> None:
    if getattr(strategy.__dict__.get("optimizer_step"), _OOM_SHIM, False):
        del strategy.optimizer_step
