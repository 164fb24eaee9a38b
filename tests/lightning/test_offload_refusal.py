"""The engine refuses a plan change to ``offload`` when the node's host memory cannot hold what the blocks moved in
an earlier offloaded step; an out-of-memory escalation then moves on (here: stops, the ladder exhausted)."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt import apply_policy
from lightning_ckpt.core.offload import Transfers, configure_offload
from lightning_ckpt.core.units import KiB
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.lightning.engine import CheckpointingEngine
from lightning_ckpt.lightning.recovery import StepGuard
from lightning_ckpt.lightning.settings import Settings


def _engine(available):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    engine = CheckpointingEngine(Settings(policy="all", on_oom="escalate", ladder=("none", "every:2", "all",
                                                                                   "offload")))
    engine.plan = apply_policy(model, "offload")
    engine.module, engine.on_accelerator = model, True  # offload counts as stronger only on an accelerator
    state = configure_offload(engine.plan, transfers=Transfers(is_device=lambda t: True),
                              host_memory=lambda: 1 << 40, local_ranks=2)
    idx = torch.randint(0, 96, (2, 16))
    model(idx, idx)[1].backward()  # one measured offloaded step: 516 KiB per rank, 1.0 MiB for the node
    engine.plan.retarget("all")  # its arena goes back
    state.host_memory = lambda: available  # then the host fills up
    return engine, state


def test_escalation_to_offload_is_refused_with_both_figures():
    engine, state = _engine(available=1024 * KiB)  # 1.0 MiB free, the node needs 1032 KiB
    moved = sum(state.per_block.values())
    assert 2 * moved > 1024 * KiB
    with pytest.warns(RuntimeWarning, match=r"offload refused; keep a recompute plan") as caught:
        assert engine.feature(StepGuard)._escalate(RuntimeError("CUDA out of memory (injected)")) is False
    text = str(caught[0].message)
    assert "(516.0 KiB per rank × 2 ranks)" in text and "the host has 1.0 MiB available" in text
    assert engine.plan.spec == "all"  # unchanged


def test_escalation_to_offload_goes_ahead_when_the_node_can_hold_it():
    engine, _ = _engine(available=64 * 1024 * KiB)
    engine.info = lambda message: None  # no Trainer for rank_zero_info here
    assert engine.feature(StepGuard)._escalate(RuntimeError("CUDA out of memory (injected)")) is True
    assert engine.plan.spec == "offload"
