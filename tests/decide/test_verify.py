import pytest
import torch
from torch import nn

from lightning_ckpt import apply_policy
from lightning_ckpt.decide.verify import EquivalenceError, verify_equivalence
from lightning_ckpt.demos.gpt import GPT, GPTConfig


def test_passes_on_a_correct_model_and_leaves_no_trace():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(dropout=0.1))
    plan = apply_policy(model, "every:2")
    idx = torch.randint(0, 96, (2, 16))
    rng = torch.get_rng_state()
    report = verify_equivalence(model, plan, lambda: model(idx, idx)[1])
    assert report.ok and report.loss_plain == report.loss_checkpointed
    assert {g.group for g in report.groups} == {"transformer"}  # lm_head is tied to wte
    assert all(g.max_abs == 0.0 for g in report.groups)
    assert plan.modes == ("recompute", "off", "recompute", "off")
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class MutableBlock(nn.Module):
    """Reads a Python counter: the replay multiplies by a different number (same shapes, wrong gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.count = 0

    def forward(self, x):
        self.count += 1
        return torch.tanh(self.lin(x)) * self.count


def test_raises_on_a_block_that_reads_mutable_state():
    model = nn.Sequential(MutableBlock(), MutableBlock())
    plan = apply_policy(model, "all", blocks=MutableBlock)
    x = torch.randn(4, 8)
    with pytest.raises(EquivalenceError, match="not replay-safe") as err:
        verify_equivalence(model, plan, lambda: model(x).pow(2).sum())
    assert "beyond tolerance" in str(err.value)
    report = verify_equivalence(model, plan, lambda: model(x).pow(2).sum(), raise_on_mismatch=False)
    assert not report.ok and max(g.max_rel for g in report.groups) > 1e-3
