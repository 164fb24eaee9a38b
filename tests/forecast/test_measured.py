"""Remedies priced from a measured ledger (hand-made ledgers at the seed's example): the line that crosses, the rows
of ``plan --remedies`` and the two recommendations, the run's own phases kept, and no verdict without a capacity."""

from __future__ import annotations

import json

import pytest
from torch import nn

from lightning_ckpt.forecast.measured import measured_remedies, oom_sentence, optimizer_kind, run_facts
from lightning_ckpt.forecast.remedies import Job, RunFacts
from lightning_ckpt.measure.ledger import Ledger

GiB = 2**30
P = 1_300_000_000  # the seed's example: bf16 weights and gradients, Adam's fp32 moments, an fp32 master copy
STATE = 2 * P + 2 * P + 8 * P + 4 * P  # 19.4 GiB
ACT = 2 * GiB
ROW_KEYS = {"name", "lines", "phases", "peak", "fits", "cost", "changes_training", "changes", "how"}


def _seed_ledger(capacity=16 * GiB) -> Ledger:
    return Ledger(params=2 * P, grads=2 * P, optimizer=12 * P, master=4 * P, activations=ACT, capacity=capacity,
                  phase_peaks={"forward": STATE + ACT + 5 * 2**20, "backward": STATE + ACT, "optimizer": STATE})


FACTS = RunFacts(params=P, trainable=P, width=2048, blocks=24, micro_batch=2, policy="none", optimizer="adamw",
                 param_dtype="bfloat16")


def _row(section, name):
    return next(r for r in section["remedies"] if r["name"] == name)


def test_the_optimizer_line_crosses_and_an_8_bit_state_fits():
    section = measured_remedies(_seed_ledger(), FACTS)
    json.dumps(section)
    reading = section["remedy"]
    assert reading["line"] == "optimizer state" and reading["crosses"] and reading["capacity"] == 16 * GiB
    assert reading["sentence"].startswith("The optimizer state line crosses 16.00 GiB: checkpointing cannot help. "
                                          "Try first: optimizer-state offload takes it from 9.69 GiB to 0 B")
    eight = _row(section, "8-bit optimizer state")
    assert eight["fits"] and eight["changes_training"]
    assert round(eight["lines"]["optimizer state"] / GiB, 2) == 2.46 and round(eight["peak"] / GiB, 2) == 14.15
    own = section["remedies"][0]
    assert own["name"] == "none" and own["fits"] is False and own["lines"]["master copy"] == 4 * P
    assert section["recommended"] == "optimizer-state offload" and section["recommended_any"] is not None
    assert all(ROW_KEYS <= set(r) for r in section["remedies"])  # the rows of plan --remedies --json


def test_the_runs_own_row_keeps_its_measured_phases():
    job = Job.from_ledger(_seed_ledger(), FACTS)
    own = measured_remedies(_seed_ledger(), FACTS)["remedies"][0]
    assert own["phases"] == _seed_ledger().phase_peaks
    assert job.optimizer == 8 * P and job.master_bytes == 4 and job.param_bytes == 2 and job.grad_bytes == 2


def test_a_first_steps_forward_without_gradients_is_priced_as_the_steps_after_it():
    peaks = {"forward": STATE - 2 * P + ACT, "backward": STATE + ACT, "optimizer": STATE}  # no gradients yet
    ledger = Ledger(params=2 * P, grads=2 * P, optimizer=12 * P, master=4 * P, activations=ACT, phase_peaks=peaks)
    own = measured_remedies(ledger, FACTS)["remedies"][0]
    assert own["phases"]["forward"] == STATE + ACT


def test_without_a_capacity_no_row_fits_and_the_largest_line_is_priced_against_the_measured_peak():
    section = measured_remedies(_seed_ledger(capacity=None), FACTS)
    assert all(r["fits"] is None for r in section["remedies"])
    assert section["recommended"] is None and section["recommended_any"] is None
    reading = section["remedy"]
    assert reading["line"] == "optimizer state" and not reading["crosses"]
    assert "capacity is not known" in reading["sentence"] and "and the peak from 21.3" in reading["sentence"]
    # the sharding rows use the fewest GPUs (nothing to fit: 8 GPUs would change the effective batch)
    assert {r["layout"]["world_size"] for r in section["remedies"]
            if r["layout"]["strategy"] in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3")} == {2}


def test_nothing_crossing_names_the_largest_line_and_what_shrinks_it():
    reading = measured_remedies(_seed_ledger(capacity=80 * GiB), FACTS)["remedy"]
    assert not reading["crosses"] and reading["sentence"].startswith(
        "Nothing crosses 80.00 GiB: the step peaks at 21.38 GiB (27%), and its largest line is optimizer state")


def test_activations_that_cross_are_named_without_the_checkpointing_cannot_help():
    ledger = Ledger(params=GiB, grads=GiB, optimizer=2 * GiB, activations=12 * GiB, capacity=16 * GiB,
                    phase_peaks={"forward": 17 * GiB, "backward": 16 * GiB, "optimizer": 4 * GiB})
    facts = RunFacts(params=2**28, trainable=2**28, width=1024, blocks=16, micro_batch=8, optimizer="adamw")
    reading = measured_remedies(ledger, facts)["remedy"]
    assert reading["line"] == "activations" and reading["sentence"].startswith(
        "The activations line crosses 16.00 GiB. Try first:")


def test_the_oom_sentence_gives_the_fix_first():
    text = oom_sentence(_seed_ledger(), FACTS)
    assert text.startswith("Try optimizer-state offload (Trainer(strategy='deepspeed_stage_2_offload')")
    assert "the optimizer state line crosses 16.00 GiB" in text and "to 0 B (on the host)" in text
    assert text.count(". ") <= 1  # one or two sentences
    room = oom_sentence(_seed_ledger(capacity=80 * GiB), FACTS)
    assert room.startswith("To make room, try optimizer-state offload")


def test_a_compressed_state_gets_no_8_bit_row():
    facts = RunFacts(params=P, trainable=P, width=2048, blocks=24, micro_batch=2, optimizer="adamw8bit")
    ledger = Ledger(params=2 * P, grads=2 * P, optimizer=round(2.03 * P), activations=ACT, capacity=16 * GiB)
    names = {r["name"] for r in measured_remedies(ledger, facts)["remedies"]}
    assert "8-bit optimizer state" not in names and "4-bit optimizer state" not in names


@pytest.mark.parametrize("make, kind", [
    (lambda p: __import__("torch").optim.AdamW(p), "adamw"),
    (lambda p: __import__("torch").optim.SGD(p, lr=0.1, momentum=0.9), "momentum"),
    (lambda p: __import__("torch").optim.SGD(p, lr=0.1), "sgd"),
])
def test_run_facts_read_the_model_and_its_optimizer(make, kind):
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 64), nn.Linear(64, 16), nn.LayerNorm(16))
    model[0].weight.requires_grad_(False)
    facts = run_facts(model, [make(model.parameters())], blocks=1, micro_batch=4, policy="none", recompute=0.0)
    assert facts.params == sum(p.numel() for p in model.parameters())
    assert facts.trainable == facts.params - 160 and facts.width == 16 and facts.optimizer == kind
    assert optimizer_kind([]) == ""


def test_the_state_an_optimizer_has_yet_to_allocate():
    import torch

    from lightning_ckpt.forecast.measured import state_to_come

    model = nn.Linear(8, 8)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    adam = torch.optim.Adam(model.parameters())
    assert state_to_come([adam]) == 2 * weights
    model(torch.randn(2, 8)).sum().backward()
    adam.step()
    assert state_to_come([adam]) == 0  # allocated: the walk counts it
    assert state_to_come([torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]) == weights
    assert state_to_come([torch.optim.SGD(model.parameters(), lr=0.1)]) == 0
