"""A shape priced on fake tensors (:mod:`lightning_ckpt.decide.pricing`): the bytes a real step measures, nothing of
the model changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.decide.budget import predict_peak
from lightning_ckpt.decide.calibration import BudgetCalibration
from lightning_ckpt.decide.pricing import PricingError, fake_state, price_shape, price_shape_by_stages, trace_plans
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


def test_an_error_of_the_plugins_own_code_is_raised_not_taken_for_a_model_that_cannot_be_traced(monkeypatch):
    """A model that cannot run on fake tensors falls back (above); a bug of ours must not hide behind that fallback.
    A builtin in the plugin's place raises from the plugin's own line, as a bug would."""
    model, plan = _gpt()
    monkeypatch.setattr(StepMeter, "watch", int)  # int(model): TypeError in pricing.py's own frame
    with pytest.raises(TypeError, match="int"):
        price_shape(model, plan, _loss(model), _batch(16))
    assert plan.modes == ("off",) * 4


@pytest.mark.parametrize("where, raise_in, error, ours", [
    ("plugin/x.py", "here", ValueError, True),  # raised by our own line
    ("plugin/demos/gpt.py", "here", ValueError, False),  # the demos are models
    ("model.py", "here", TypeError, False),  # the user's model
    ("plugin/x.py", "torch", ValueError, False),  # torch refuses what it is given: the model's
    ("plugin/x.py", "torch", TypeError, True),  # a wrong call of ours into torch
])
def test_whose_error_is_read_from_the_frame_that_raised_it(tmp_path, monkeypatch, where, raise_in, error, ours):
    """Real files in a temporary tree stand for the plugin, its demos and torch (no frame names a file that does not
    exist: coverage reads every file a frame names)."""
    from lightning_ckpt.decide import pricing

    monkeypatch.setattr(pricing, "_PLUGIN_DIR", str(tmp_path / "plugin"))
    monkeypatch.setattr(pricing, "_DEMOS_DIR", str(tmp_path / "plugin" / "demos"))
    monkeypatch.setattr(pricing, "_TORCH_DIR", str(tmp_path / "torch"))
    sources = {"torch/functional.py": "def inside_torch(error):\n    raise error('refused')\n",
               where: "def step(error, inside_torch, here):\n    if here:\n        raise error('x')\n"
                      "    inside_torch(error)\n"}
    namespace = {}
    for name, source in sources.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        exec(compile(source, str(path), "exec"), namespace)
    with pytest.raises(error) as caught:
        namespace["step"](error, namespace["inside_torch"], raise_in == "here")
    assert pricing._raised_by_the_plugin(caught.value) is ours


@pytest.mark.parametrize("price, failing_call", [(price_shape_by_stages, 3), (price_shape, 1)])
def test_a_failed_pricing_leaves_no_hook_behind(price, failing_call):
    from lightning_ckpt.core import replay

    model, plan = _gpt()
    before = list(replay._REPLAY_HOOKS)
    hooks = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in plan.blocks]

    calls = []

    def fails_in_a_step(batch):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("boom")
        return _loss(model)(batch)

    with pytest.raises(PricingError, match="boom"):
        price(model, plan, fails_in_a_step, _batch(16))
    assert replay._REPLAY_HOOKS == before
    assert [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in plan.blocks] == hooks


def _llama():
    from lightning_ckpt.demos.hf import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(n_layer=4, n_embd=64, n_head=4, n_positions=128, vocab_size=96)
    return model, apply_policy(model, "none"), lambda b: model(input_ids=b["input_ids"], labels=b["labels"]).loss


def _hf_gpt2():
    from lightning_ckpt.demos.hf import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=4, n_embd=64, n_head=4, n_positions=128, vocab_size=96, dropout=0.0)
    return model, apply_policy(model, "none"), lambda b: model(input_ids=b["input_ids"], labels=b["labels"]).loss


def _t5():
    """An encoder-decoder whose encoder and decoder blocks are one class (``T5Block``), unlike: a decoder block has
    a cross-attention and runs at the target's length."""
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=96, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2,
                                   num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    model.train()
    def loss(b):  # a target of 8 tokens for a source of 32
        return model(input_ids=b["input_ids"], labels=b["labels"][:, :8].contiguous()).loss

    return model, apply_policy(model, "none"), loss


def _gpt_with_loss():
    model, plan = _gpt()
    return model, plan, _loss(model)


def test_a_shape_is_priced_with_one_whole_model_step():
    """The calibration's five whole-model stages cost 10-14 s for 24 Llama layers: one whole step, then one block
    alone per class and mode."""
    model, plan = _gpt()
    calls = []

    def counted(batch):
        calls.append(1)
        return _loss(model)(batch)

    price_shape(model, plan, counted, _batch(16))
    assert len(calls) == 1


@pytest.mark.parametrize("build", [_gpt_with_loss, _llama, _hf_gpt2, _t5], ids=["gpt", "hf-llama", "hf-gpt2", "t5"])
def test_the_fast_pricing_reads_the_bytes_of_the_stages(build):
    """Per block the bytes of the calibration's stages run on every block, and predictions never below the traced
    peak. The one difference: the Llama's rotary tables (made once, outside the blocks) are saved by whichever block
    first runs ``off``, which the plan decides: the stages count them in the first ``off`` block of each stage, the
    fast pricing in every block (the largest interior of the class), so that no plan is predicted short of them."""
    model, plan, loss = build()
    batch = _batch(32)
    slow = price_shape_by_stages(model, plan, loss, batch)
    fast = price_shape(model, plan, loss, batch)
    if build is _t5:  # blocks of several kinds: priced by the stages (not additive across kinds)
        assert fast == slow
        return
    for f, s in zip(fast.costs, slow.costs):
        assert {k: getattr(f, k) for k in FIELDS if k != "interior"} == {k: getattr(s, k) for k in FIELDS
                                                                          if k != "interior"}
    for f, s in zip(fast.costs, slow.costs):  # each block's interior measured alone: all it saves
        assert f.interior >= s.interior
    if build in (_gpt_with_loss, _hf_gpt2):  # alike blocks, nothing made outside them and saved inside
        assert [c.interior for c in fast.costs] == [c.interior for c in slow.costs]
        assert build is _gpt_with_loss or fast.base == slow.base  # the demo GPT's forward base is lower by one
        # block's input, its backward base higher: the stages' least residuals come from other plans
    if build is _llama:  # every block counts the rotary tables, and so do the bases, for a plan none saves them in
        assert all(f.interior == max(c.interior for c in slow.costs) for f in fast.costs)
        assert fast.base[0] - slow.base[0] == fast.base[1] - slow.base[1] > 0
    n = plan.num_blocks
    plans = [tuple(modes[(i + k) % 3] for i in range(n)) for k in range(3)
             for modes in (("off", "recompute", "selective"), ("selective", "off", "recompute"))]
    plans += [(mode,) * n for mode in ("off", "recompute", "selective")]
    traced = trace_plans(model, plan, loss, batch, plans)
    for modes, peak in zip(plans, traced):  # no plan predicted short of its trace
        assert peak <= predict_peak(fast.costs, modes, fast.base) <= round(peak * 1.06), modes
    for modes, peak in fast.traced.items():  # the whole-model step's peak is the plan's traced peak
        assert peak == trace_plans(model, plan, loss, batch, [modes])[0]
