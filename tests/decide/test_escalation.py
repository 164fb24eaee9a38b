"""Escalation is monotone: the next plan checkpoints at least as much on every block and more on one."""

from __future__ import annotations

import pytest

from lightning_ckpt.core.policy import ModesPolicy, parse_policy
from lightning_ckpt.decide.escalation import block_strength, next_rung

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


def test_the_compilers_budget_per_block_ranks_with_selective_or_recompute():
    budget = ModesPolicy(("compiler:0.5", "compiler:0", "off", "selective")).layout(4)
    assert block_strength(budget, accelerator=False) == (1, 3, 0, 1)
    assert next_rung(budget, LADDER, accelerator=False) == "all"  # every:2 leaves block 1 off, below compiler:0
    assert next_rung(ModesPolicy(("compiler:0",) * 4).layout(4), LADDER, accelerator=False) is None
