"""A shape priced on fake tensors (:mod:`lightning_ckpt.decide.pricing`): the bytes a real step measures, nothing of
the model changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.decide.budget import BudgetCalibration
from lightning_ckpt.decide.pricing import PricingError, fake_state, price_shape
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.measure.meter import StepMeter

FIELDS = ("interior", "boundary", "selective_kept", "recompute_replay", "selective_replay")


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(dropout=0.0))
    model.train()
    return model, apply_policy(model, "none")


def _batch(length, samples=2):
    ids = torch.randint(0, 96, (samples, length))
    return {"input_ids": ids, "labels": ids}


def _loss(model):
    return lambda b: model(b["input_ids"], b["labels"])[1]


def _real_costs(model, plan, batch):
    """The same stages as the pricing, on real tensors."""
    meter = StepMeter("cpu").watch(model)

    def step(exact):
        with meter.step(exact=exact) as box:
            _loss(model)(batch).backward()
        model.zero_grad(set_to_none=True)
        return box.reading.activations

    calibration = BudgetCalibration(plan, meter, 0, times=False, choose=False)
    calibration.run(step)
    calibration.close()
    plan.set_modes(["off"] * plan.num_blocks)
    return calibration.costs()


@pytest.mark.parametrize("length", [16, 64])
def test_fake_pricing_reads_the_bytes_of_a_real_step_per_block(length):
    model, plan = _gpt()
    batch = _batch(length)
    fake = price_shape(model, plan, _loss(model), batch)
    real = _real_costs(model, plan, batch)
    for f, r in zip(fake.costs, real):
        assert {k: getattr(f, k) for k in FIELDS} == {k: getattr(r, k) for k in FIELDS}
    assert fake.interior == sum(c.interior for c in real) > 0


def test_pricing_changes_nothing_of_the_model_and_its_plan():
    model, plan = _gpt()
    plan.set_modes(["recompute", "off", "selective", "off"])
    plan.annotate(["a", "b", "c", "d"])
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    buffers = {name: b for name, b in model.named_buffers()}
    price_shape(model, plan, _loss(model), _batch(32))
    assert plan.modes == ("recompute", "off", "selective", "off") and "a" in plan.summary()
    assert all(p is params[name] and torch.equal(p, values[name]) and p.grad is None
               for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay tied


class LazyCache(nn.Module):
    """Builds a tensor attribute on its first forward (as some rotary embeddings do)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if getattr(self, "table", None) is None or self.table.shape[0] < x.shape[1]:
            self.table = torch.ones(x.shape[1], 8, device=x.device) * self.lin.weight[0, 0]
        return self.lin(x) * self.table[: x.shape[1]]


def test_a_tensor_the_step_caches_on_a_module_is_put_back_and_never_left_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    model = nn.Sequential(LazyCache(), LazyCache())
    model[0].table = torch.zeros(2, 8)  # a real cache from an earlier step, replaced by a longer one when priced
    with fake_state(model, FakeTensorMode(allow_non_fake_inputs=True)) as params:
        assert all(is_fake(p) for p in params)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model(torch.randn(1, 4, 8))
        assert is_fake(model[0].table) and is_fake(model[1].table)
    assert not is_fake(model[0].table) and model[0].table.shape == (2, 8)  # put back
    assert not hasattr(model[1], "table")  # made by the priced step: removed
    model(torch.randn(1, 4, 8)).sum().backward()  # the real model still trains


def test_a_step_that_cannot_run_on_fake_tensors_is_a_pricing_error_and_changes_nothing():
    model, plan = _gpt()

    def reads_a_weight(batch):
        if model.lm_head.weight.sum().item() > 1e9:  # a value of a parameter: no fake tensor has one
            return None
        return _loss(model)(batch)

    with pytest.raises(PricingError, match="DataDependent"):
        price_shape(model, plan, reads_a_weight, _batch(16))
    assert plan.modes == ("off",) * 4 and all(p.grad is None for p in model.parameters())
    _loss(model)(_batch(16)).backward()


def test_a_failed_pricing_leaves_no_hook_behind():
    from lightning_ckpt.core import replay

    model, plan = _gpt()
    before = list(replay._REPLAY_HOOKS)
    hooks = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in plan.blocks]

    calls = []

    def fails_in_the_third_step(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return _loss(model)(batch)

    with pytest.raises(PricingError, match="boom"):
        price_shape(model, plan, fails_in_the_third_step, _batch(16))
    assert replay._REPLAY_HOOKS == before
    assert [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in plan.blocks] == hooks
