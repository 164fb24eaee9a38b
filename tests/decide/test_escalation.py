"""Escalation is monotone: the next plan checkpoints at least as much on every block and more on one."""

from __future__ import annotations

import pytest
import torch
from _torch_features import needs_compiler_budget

from lightning_ckpt.core.policy import ModesPolicy, parse_policy
from lightning_ckpt.core.units import MiB
from lightning_ckpt.decide.escalation import HostRoom, block_strength, host_room, next_rung, offload_refusal

LADDER = ("none", "every:2", "all")


def _layout(policy, n=4):
    return parse_policy(policy).layout(n)


@pytest.mark.parametrize("current, expected", [
    ("none", "every:2"),
    ("every:2", "all"),
    ("all", None),  # the top: stop with the diagnosis
    ("selective", "all"),  # never down to none, even though none comes first on the ladder
    ("group:2", "all"),  # smaller regions: a smaller replay transient
    ("first:1", "every:2"),  # block 0 in both, every:2 adds block 2
    ("blocks:1,3", "all"),  # every:2 leaves block 1 off, so it does not dominate blocks:1,3
])
def test_next_rung_dominates_the_current_plan(current, expected):
    assert next_rung(_layout(current), LADDER, accelerator=False) == expected


def test_modes_plans_from_a_budget_or_stateful_skip_escalate_upward():
    skip = ModesPolicy(("off", "recompute", "recompute", "recompute")).layout(4)  # block 0 kept off (BatchNorm)
    assert next_rung(skip, LADDER, accelerator=False) == "all"  # none and every:2 do not dominate it
    assert next_rung(skip, ("none", "every:2"), accelerator=False) is None


def test_offload_counts_only_on_an_accelerator():
    assert block_strength(_layout("offload"), accelerator=True) == (4, 4, 4, 4)
    assert block_strength(_layout("offload"), accelerator=False) == (0, 0, 0, 0)
    assert next_rung(_layout("all"), ("none", "every:2", "all", "offload"), accelerator=True) == "offload"
    assert next_rung(_layout("all"), ("none", "every:2", "all", "offload"), accelerator=False) is None


def test_a_rung_that_does_not_fit_the_model_is_skipped():
    assert next_rung(_layout("none"), ("none", "blocks:7", "all"), accelerator=False) == "all"


@needs_compiler_budget
def test_the_compilers_budget_per_block_ranks_with_selective_or_recompute():
    budget = ModesPolicy(("compiler:0.5", "compiler:0", "off", "selective")).layout(4)
    assert block_strength(budget, accelerator=False) == (1, 3, 0, 1)
    assert next_rung(budget, LADDER, accelerator=False) == "all"  # every:2 leaves block 1 off, below compiler:0
    assert next_rung(ModesPolicy(("compiler:0",) * 4).layout(4), LADDER, accelerator=False) is None


# ------------------------------------------------------------------------------------------------ host memory


def test_offload_is_refused_when_the_node_cannot_hold_what_its_blocks_moved():
    room = HostRoom(available=3 * MiB, local_ranks=2, per_block={0: MiB, 1: MiB})  # 2 measured of 4 blocks
    assert room.moved(_layout("offload")) == 4 * MiB  # the unmeasured blocks move as the measured ones
    text = offload_refusal(_layout("offload"), room)
    assert text == ("offload refused; keep a recompute plan ('all'), a smaller micro-batch, or free host memory: its "
                    "blocks would hold 8.0 MiB of host memory on this node (4.0 MiB per rank × 2 ranks), measured in "
                    "an earlier offloaded step, and the host has 3.0 MiB available.")
    assert offload_refusal(ModesPolicy(("offload", "off", "off", "recompute")).layout(4), room) is None  # 2 MiB fits
    assert offload_refusal(_layout("all"), room) is None  # nothing offloaded
    assert offload_refusal(_layout("offload"), HostRoom(available=0)) is None  # nothing measured: not known


def test_the_ladder_skips_a_refused_offload_rung():
    ladder = ("none", "every:2", "all", "offload")
    small = HostRoom(available=MiB, per_block={i: MiB for i in range(4)})
    assert next_rung(_layout("all"), ladder, accelerator=True, room=small) is None
    assert next_rung(_layout("every:2"), ladder, accelerator=True, room=small) == "all"
    assert next_rung(_layout("all"), ladder, accelerator=True, room=HostRoom(available=8 * MiB,
                                                                           per_block={0: MiB})) == "offload"


def test_host_room_reads_the_plans_offload_state():
    from torch import nn

    from lightning_ckpt import apply_policy
    from lightning_ckpt.core.offload import Transfers, configure_offload

    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)))
    plan = apply_policy(model, "offload", "*")
    assert host_room(plan) is None  # never offloaded
    state = configure_offload(plan, transfers=Transfers(is_device=lambda t: True), host_memory=lambda: 5 * MiB,
                              local_ranks=3)
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    room = host_room(plan)
    assert room.local_ranks == 3 and room.per_block == state.per_block and set(room.per_block) == {0, 1}
    assert room.available == 5 * MiB + 3 * state.pinned_bytes  # the arenas the ranks hold are theirs to reuse
