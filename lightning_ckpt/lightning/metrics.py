"""Where the measured figures go: reduced across ranks, logged through Lightning, drawn by TensorBoard.

Reduction: every rank measures its own step; the logged memory lines are the **maximum** over ranks (the rank
closest to running out is the one that matters) and the throughput lines the **sum** (the job's tokens/s). Both
come from one ``all_gather`` of a small float64 vector on measured steps only (the metric names are the same on
every rank, so the vector lines up). ``torchmetrics``' ``MaxMetric``/``SumMetric`` would do the same with one
collective per metric, so they are not used.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["TENSORBOARD_LAYOUT", "block_metrics", "log_metrics", "reduce_across_ranks", "tensorboard_layout"]


def tensorboard_layout(prefix: str) -> Dict[str, Dict[str, List[Any]]]:
    """The custom-scalars layout: the ledger lines in one "Memory" chart beside "Throughput", "Phases" (the peak of
    the forward, the backward and the optimizer step) and "Checkpointing" (with a budget plan's bytes kept and
    replayed per block)."""
    root = f"{prefix}/" if prefix else ""
    memory = [f"{root}memory/{k}_gib" for k in
              ("peak_allocated", "peak_reserved", "activations", "autocast_copies", "params", "grads", "optimizer",
               "other", "cache")]
    return {
        "Memory": {"ledger (GiB)": ["Multiline", memory]},
        "Throughput": {"tokens/s": ["Multiline", [f"{root}throughput/tokens_per_sec"]],
                       "samples/s": ["Multiline", [f"{root}throughput/samples_per_sec"]],
                       "step time (s)": ["Multiline", [f"{root}time/step_s"]]},
        "Phases": {"peak per phase (GiB)": ["Multiline", [f"{root}memory/peak_{phase}_gib"
                                                          for phase in ("forward", "backward", "optimizer")]]},
        "Checkpointing": {"blocks and level": ["Multiline", [f"{root}checkpointing/blocks",
                                                             f"{root}checkpointing/level"]],
                          # tags are regular expressions: one line per block of a budget plan
                          "kept per block (GiB)": ["Multiline", [rf"{root}blocks/\d+_kept_gib"]],
                          "replay peak per block (GiB)": ["Multiline", [rf"{root}blocks/\d+_replay_gib"]]},
    }


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
"""The custom-scalars layout written to TensorBoard (no prefix)."""


def is_throughput(key: str) -> bool:
    return "/throughput/" in f"/{key}"


def reduce_across_ranks(strategy: Any, metrics: Dict[str, float]) -> Dict[str, float]:
    """Max over ranks for memory (and everything else), sum for throughput: one collective."""
    if getattr(strategy, "world_size", 1) <= 1:
        return metrics
    keys = sorted(metrics)
    local = torch.tensor([metrics[k] for k in keys], device=strategy.root_device, dtype=torch.float64)
    gathered = strategy.all_gather(local).reshape(-1, len(keys))
    summed, maxed = gathered.sum(0).tolist(), gathered.max(0).values.tolist()
    return {k: (summed[i] if is_throughput(k) else maxed[i]) for i, k in enumerate(keys)}


def log_metrics(pl_module: Any, metrics: Dict[str, float], prefix: str) -> None:
    """Log already-reduced figures (Lightning writes on rank zero only) and show two on the progress bar."""
    root = f"{prefix}/" if prefix else ""
    pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=True, prog_bar=False)
    bar = {"tok/s": metrics[f"{root}throughput/tokens_per_sec"]}
    act = metrics.get(f"{root}memory/activations_gib")
    if act is not None:
        bar["act_GiB"] = act
    pl_module.log_dict(bar, on_step=True, on_epoch=False, logger=False, prog_bar=True)
