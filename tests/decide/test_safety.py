import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_ckpt import apply_policy
from lightning_ckpt.decide.safety import ReplaySafetyError, buffer_versions, changed_buffers, preflight


class ConvBlock(nn.Module):
    def __init__(self, c=4, dropout=0.0):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm1d(c)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


class ConvStack(nn.Module):
    def __init__(self, n=3, dropout=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock(dropout=dropout) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4, 16)).pow(2).mean().backward()
        opt.step()


def test_batchnorm_in_checkpointed_blocks_warns_naming_the_modules():
    model = ConvStack()
    plan = apply_policy(model, "every:2")
    with pytest.warns(UserWarning, match=r"\['blocks.0.bn', 'blocks.2.bn'\]") as record:
        assert preflight(plan) == []
    assert "stateful='skip'" in str(record[0].message)
    assert plan.modes == ("recompute", "off", "recompute")


def test_batchnorm_running_stats_drift_without_the_opt_out_and_match_with_it():
    torch.manual_seed(0)
    reference = ConvStack()
    drifting, fixed = copy.deepcopy(reference), copy.deepcopy(reference)
    apply_policy(drifting, "all")
    plan = apply_policy(fixed, "all")
    assert preflight(plan, stateful="skip") == ["blocks.0", "blocks.1", "blocks.2"]
    assert plan.modes == ("off", "off", "off")
    for m in (reference, drifting, fixed):
        _train(m)
    ref_stats = reference.blocks[1].bn.running_mean
    assert torch.equal(fixed.blocks[1].bn.running_mean, ref_stats)
    assert not torch.equal(drifting.blocks[1].bn.running_mean, ref_stats)
    assert drifting.blocks[1].bn.num_batches_tracked.item() == 6  # updated twice per step


def test_stateful_error_and_bad_choice():
    plan = apply_policy(ConvStack(), "all")
    with pytest.raises(ReplaySafetyError, match="stateful='skip'"):
        preflight(plan, stateful="error")
    with pytest.raises(ValueError, match=r"choose one of \['warn', 'skip', 'error'\]"):
        preflight(plan, stateful="ignore")


def test_dropout_without_rng_preservation_is_refused():
    plan = apply_policy(ConvStack(dropout=0.1), "all", preserve_rng_state=False)
    with pytest.raises(ReplaySafetyError, match="preserve_rng_state=False with active dropout"):
        preflight(plan)
    ok = apply_policy(ConvStack(dropout=0.0), "all", preserve_rng_state=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preflight(ok)  # no dropout: allowed


def test_changed_buffers_catches_any_in_place_update():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += 1
            return self.lin(x)

    model = nn.Sequential(Counter(), Counter(), Counter())
    plan = apply_policy(model, "first:2", blocks=Counter)
    before = buffer_versions(plan)
    assert set(before) == {"0.seen", "1.seen"}
    model(torch.randn(2, 4)).sum().backward()
    assert changed_buffers(plan, before) == ["0.seen", "1.seen"]
