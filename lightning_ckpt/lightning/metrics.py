"""Where the measured figures go: reduced across ranks, logged through Lightning, drawn by TensorBoard.

Reduction: every rank measures its own step; the logged memory lines are the **maximum** over ranks (the rank
closest to running out is the one that matters) and the throughput lines the **sum** (the job's tokens/s), as
:data:`~lightning_ckpt.measure.metric_keys.METRIC_KEYS` says per key. Both
come from one ``all_gather`` of a small float64 vector on measured steps only (the metric names are the same on
every rank, so the vector lines up). On runs that agree between steps (a budget per shape, the auto-toggle, which
reads the reduced activation line every step it decides) it is gathered on the host, over the engine's gloo group
(:mod:`lightning_ckpt.lightning.ranks`): a step that decides without logging then never waits for the device.
Otherwise through the strategy: built on the host (in pinned memory on CUDA), moved with one non-blocking copy,
gathered, and copied back once, where the max and the sum are taken. ``torchmetrics``' ``MaxMetric`` /
``SumMetric`` would do the same with one collective per metric, so they are not used.

Logging: the figures are host floats, so they go straight to ``trainer.loggers`` on rank zero, at the step
Lightning's own ``self.log`` would use in ``on_train_batch_end`` (the same x-axis as ``train_loss``). ``self.log``
would make a device tensor per value (a host-to-device copy each on CUDA, and an ``.item()`` each when written) and
costs about 0.35 ms of host time per key. ``trainer.callback_metrics`` and ``trainer.logged_metrics`` get the same
figures as host tensors (as ``self.log`` left them, for ``ModelCheckpoint(monitor=...)`` or ``EarlyStopping``), and
the progress bar its two figures as floats. Those three dicts are Lightning's own, updated in place (its
``_logger_connector``'s; reading them through ``trainer.progress_bar_metrics`` would convert every metric logged
this step, a device read each).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch

from lightning_ckpt.measure.metric_keys import UnregisteredMetricKey, combines_by_sum, tensorboard_layout, unregistered

__all__ = ["INSTRUMENTED", "TENSORBOARD_LAYOUT", "block_metrics", "log_metrics", "log_step", "prefixed",
           "reduce_across_ranks", "tensorboard_layout"]

INSTRUMENTED = "_instrumented"
"""Reduced with a step's figures: whether a rank's step ran the per-op instrumentation (its time is not the run's)."""


def prefixed(prefix: str, name: str) -> str:
    """A metric's full key: the callback's ``prefix`` in front of ``name`` (``lightning_ckpt/memory/peak_gib``)."""
    return f"{prefix}/{name}" if prefix else name


def block_metrics(plan: Any, prefix: str) -> Dict[str, float]:
    """Per block of a budget plan (:class:`~lightning_ckpt.decide.budget.BudgetPlan`): the bytes it keeps for
    backward and the bytes live while its backward runs, in GiB, keyed ``blocks/07_kept_gib`` / ``_replay_gib``."""
    root = f"{prefix}/" if prefix else ""
    out: Dict[str, float] = {}
    for i, (chosen, _) in enumerate(plan.choices):
        out[f"{root}blocks/{i:02d}_kept_gib"] = chosen.kept / 2**30
        out[f"{root}blocks/{i:02d}_replay_gib"] = chosen.replay / 2**30
    return out


TENSORBOARD_LAYOUT = tensorboard_layout("")
"""The custom-scalars layout written to TensorBoard (no prefix): the ledger lines in one "Memory" chart (the master
copies, part of the optimizer line, drawn beside it) beside "Throughput", "Phases" (the peak of the forward, the
backward and the optimizer step) and "Checkpointing" (with a budget plan's bytes kept and replayed per block); from
:data:`~lightning_ckpt.measure.metric_keys.METRIC_KEYS`."""


def reduce_across_ranks(strategy: Any, metrics: Dict[str, float], group: Any = None) -> Dict[str, float]:
    """Max over ranks for memory (and everything else), sum for throughput: one collective.

    With ``group``, a gloo group (:class:`~lightning_ckpt.lightning.ranks.HostGroup`), the vector is gathered on the
    host: no device copy, no wait for the device. Without one, through the strategy: the vector is made on the host,
    pinned when the device is CUDA, and moved with a non-blocking copy (a pageable one would wait for the device
    first); the gathered figures come back in one device-to-host copy, the one wait of the reduction.
    """
    if getattr(strategy, "world_size", 1) <= 1:
        return metrics
    keys = sorted(metrics)
    if group is not None:
        import torch.distributed as dist

        local = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        rows = torch.stack(gathered).tolist()
    else:
        device = torch.device(strategy.root_device)
        host = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, pin_memory=device.type == "cuda")
        local = host.to(device, non_blocking=True)  # the CPU (gloo): the same tensor
        rows = strategy.all_gather(local).to("cpu").reshape(-1, len(keys)).tolist()
    return {k: (sum(row[i] for row in rows) if combines_by_sum(k) else max(row[i] for row in rows))
            for i, k in enumerate(keys)}


def log_step(trainer: Any) -> int:
    """The step ``self.log`` in ``on_train_batch_end`` is written at: the optimizer steps before this one."""
    stepped = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
    return int(stepped) if stepped is not None else max(int(trainer.global_step) - 1, 0)


def _lightning_dict(trainer: Any, name: str) -> Dict[str, Any]:
    """One of the logger connector's own metric dicts (``callback``, ``logged``, ``progress_bar``), in place."""
    found = getattr(getattr(trainer, "_logger_connector", None), f"_{name}_metrics", None)
    return found if isinstance(found, dict) else {}


def log_metrics(trainer: Any, metrics: Dict[str, float], prefix: str, step: Optional[int] = None) -> None:
    """Write already-reduced figures (see the module docstring): the loggers on rank zero, Lightning's
    ``callback_metrics`` / ``logged_metrics`` as host tensors, and two figures on the progress bar. ``step``: the
    logger's step (default :func:`log_step`, this step's; an earlier one for a reference step's time)."""
    root = f"{prefix}/" if prefix else ""
    values = {k: float(v) for k, v in metrics.items()}
    for key in unregistered(values):
        warnings.warn(f"lightning_ckpt logged {key!r}, a metric key its registry lacks: please report this bug "
                      "(the figure is logged all the same).", UnregisteredMetricKey, stacklevel=2)
    if trainer.is_global_zero and trainer.loggers:
        step = log_step(trainer) if step is None else step
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
    as_tensors = {k: torch.tensor(v) for k, v in values.items()}  # host tensors: no device copy
    _lightning_dict(trainer, "callback").update(as_tensors)
    _lightning_dict(trainer, "logged").update(as_tensors)
    bar = {}
    if f"{root}throughput/tokens_per_sec" in values:
        bar["tok/s"] = values[f"{root}throughput/tokens_per_sec"]
    if f"{root}memory/activations_gib" in values:
        bar["act_GiB"] = values[f"{root}memory/activations_gib"]
    _lightning_dict(trainer, "progress_bar").update(bar)
