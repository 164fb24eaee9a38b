"""verify_equivalence: every checkpointed unit against itself plain, in the run's autocast, within the
checkpointed step's memory; no trace left; tight in float32, bf16-aware in bf16."""

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ckpt import apply_policy
from lightning_ckpt.core.replay import register_replay_hook
from lightning_ckpt.decide.verify import EquivalenceError, verify_equivalence
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.measure.tracker import LiveBytes


def test_passes_on_a_correct_model_and_leaves_no_trace():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(dropout=0.1))
    plan = apply_policy(model, "every:2")
    idx = torch.randint(0, 96, (2, 16))
    rng = torch.get_rng_state()
    report = verify_equivalence(model, plan, lambda: model(idx, idx)[1])
    assert report.ok
    assert [b.block for b in report.blocks] == ["transformer.h.0", "transformer.h.2"]  # the checkpointed ones
    assert all(b.max_abs == 0.0 and b.compared > 0 for b in report.blocks)  # bitwise in float32 on the CPU
    assert plan.modes == ("recompute", "off", "recompute", "off") and plan.spec == "every:2"
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert "'every:2'" in report.table() and "no autocast" in report.table()


class NormBlock(nn.Module):
    """Updates running statistics (buffers) and draws dropout: both must be as they were after verify."""

    def __init__(self, d=8):
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(self.bn(self.lin(x)))


def test_gradients_buffers_and_rng_are_left_exactly_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(NormBlock(), NormBlock(), NormBlock())
    plan = apply_policy(model, "all", blocks=NormBlock)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(16, 8)
    rng = torch.get_rng_state()
    report = verify_equivalence(model, plan, lambda: model(x).sum())
    assert report.ok and len(report.blocks) == 3
    for n, p in model.named_parameters():
        assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("policy, rows, mode, replays", [
    ("all", ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"], "recompute", 4),
    ("selective", ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"], "selective", 4),
    ("offload", ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"], "offload", 0),
    ("group:2", ["transformer.h.0…transformer.h.1", "transformer.h.2…transformer.h.3"], "group", 2),
])
def test_each_unit_runs_in_its_planned_mode_against_off(policy, rows, mode, replays):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(dropout=0.1))
    plan = apply_policy(model, policy)
    layout = plan.layout
    idx = torch.randint(0, 96, (2, 16))
    seen = []

    def hook(owner, fn, args, kwargs):
        seen.append(getattr(owner, "members", [owner])[0].name)
        return fn(*args, **kwargs)

    with register_replay_hook(hook):
        report = verify_equivalence(model, plan, lambda: model(idx, idx)[1])
    assert report.ok and [b.block for b in report.blocks] == rows and {b.mode for b in report.blocks} == {mode}
    assert all(b.max_abs == 0.0 for b in report.blocks)
    # one replay per unit: the planned run replays (a group region once, as one unit), the plain run does not
    assert len(seen) == replays
    assert plan.layout is layout  # the plan verified is the plan left: not re-installed, notes kept


class MutableBlock(nn.Module):
    """Reads a Python counter: the replay multiplies by a different number (same shapes, wrong gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.count = 0

    def forward(self, x):
        self.count += 1
        return torch.tanh(self.lin(x)) * self.count


@pytest.mark.parametrize("policy", ["all", "group:2"])
def test_raises_on_a_block_that_reads_mutable_state(policy):
    model = nn.Sequential(MutableBlock(), MutableBlock())
    plan = apply_policy(model, policy, blocks=MutableBlock)
    x = torch.randn(4, 8)
    with pytest.raises(EquivalenceError, match="not replay-safe") as err:
        verify_equivalence(model, plan, lambda: model(x).pow(2).sum())
    assert "beyond tolerance" in str(err.value)
    report = verify_equivalence(model, plan, lambda: model(x).pow(2).sum(), raise_on_mismatch=False)
    assert not report.ok and max(b.max_rel for b in report.blocks) > 1e-3


class AutocastOnlyMutableBlock(MutableBlock):
    """Non-replay-safe only under autocast (a bug of the regime being trained): the counter moves only there."""

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            self.count += 1
        return torch.tanh(self.lin(x)) * (1 + self.count)


def test_raises_under_autocast_on_a_block_unsafe_only_under_autocast():
    model = nn.Sequential(AutocastOnlyMutableBlock(), AutocastOnlyMutableBlock())
    plan = apply_policy(model, "all", blocks=AutocastOnlyMutableBlock)
    x = torch.randn(4, 8)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().pow(2).sum()

    with pytest.raises(EquivalenceError, match="not replay-safe") as err:
        verify_equivalence(model, plan, step, precision="bf16-mixed")
    assert "precision 'bf16-mixed', autocast cpu bfloat16" in str(err.value)


class ReorderedSumBlock(nn.Module):
    """The same function every call, its matmul summed in another order on every second call: what a backend gives
    when it replays a bf16 kernel with a different reduction (differences within bf16 rounding)."""

    def __init__(self, d=64):
        super().__init__()
        self.lin, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        d = x.shape[-1]
        order = torch.arange(d, device=x.device)
        if not self.calls % 2:  # the same ops and saved tensors, other partial sums
            order = torch.randperm(d, generator=torch.Generator().manual_seed(self.calls), device=x.device)
        a, b = order[: d // 2], order[d // 2:]
        w = self.lin.weight
        h = x.index_select(-1, a) @ w.index_select(1, a).t() + x.index_select(-1, b) @ w.index_select(1, b).t()
        return x + self.out(torch.nn.functional.gelu(h + self.lin.bias))


def _reordered_model():
    torch.manual_seed(0)
    model = nn.Sequential(*(ReorderedSumBlock() for _ in range(3)))
    return model, apply_policy(model, "all", blocks=ReorderedSumBlock), torch.randn(32, 64)


def test_no_false_error_in_bf16_for_a_replay_within_bf16_rounding():
    model, plan, x = _reordered_model()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().pow(2).mean()

    report = verify_equivalence(model, plan, step)
    assert report.ok, report.table()
    assert max(b.max_abs for b in report.blocks) > 0  # the replay really differed (in bf16 rounding only)
    assert "autocast cpu bfloat16" in report.regime and report.tolerance[0][0] == "bfloat16"


class BF16OnReplayBlock(ReorderedSumBlock):
    """In a float32 run, every second call rounds its matmul to bf16: a replay that a float32 check must see."""

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if not self.calls % 2:
            h = h.bfloat16().float()
        return x + self.out(torch.nn.functional.gelu(h))


def test_float32_stays_tight():
    model, plan, x = _reordered_model()  # a reordered float32 sum: within float32 rounding
    assert verify_equivalence(model, plan, lambda: model(x).pow(2).mean()).ok
    torch.manual_seed(0)
    model = nn.Sequential(*(BF16OnReplayBlock() for _ in range(3)))
    plan = apply_policy(model, "all", blocks=BF16OnReplayBlock)
    with pytest.raises(EquivalenceError, match="float32 rtol 1.3e-06"):
        verify_equivalence(model, plan, lambda: model(x).pow(2).mean())


class InteriorBlock(nn.Module):
    """A block whose interior (4 x wider than its boundary) dominates the activations."""

    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 16 * d), nn.Linear(16 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


def test_needs_no_more_memory_than_the_checkpointed_step():
    """Exact live bytes on the CPU: the checkpointed step keeps one interior at a time, a plain step all four; the
    old check ran a plain step (and kept two gradient copies), so its peak was the plain step's and more."""
    torch.manual_seed(0)
    model = nn.Sequential(*(InteriorBlock() for _ in range(4)))
    plan = apply_policy(model, "all", blocks=InteriorBlock)
    x = torch.randn(256, 32)
    device = torch.device("cpu")
    state = [*model.parameters(), x]

    def peak(fn):
        tracker = LiveBytes(device)
        tracker.adopt(state)
        with tracker:
            fn()
        for p in model.parameters():
            p.grad = None
        return tracker.total_peak

    checkpointed = peak(lambda: model(x).pow(2).mean().backward())
    with plan.plain(range(4)):
        plain = peak(lambda: model(x).pow(2).mean().backward())
    interior = 256 * 16 * 32 * 4
    assert plain - checkpointed >= 2 * interior  # the model is one where checkpointing matters
    verify = peak(lambda: verify_equivalence(model, plan, lambda: model(x).pow(2).mean()))
    assert verify <= checkpointed


class CountingInteriorBlock(InteriorBlock):
    """Records, at each call, how many interiors of other calls are still alive (storage weak references)."""

    alive: list = []
    seen: list = []

    def forward(self, x):
        live = [r for r in CountingInteriorBlock.alive if not r.expired()]
        CountingInteriorBlock.seen.append(len(live))
        h = self.up(x)
        CountingInteriorBlock.alive[:] = [*live, StorageWeakRef(h.untyped_storage())]
        return x + self.down(nn.functional.gelu(h))


@pytest.mark.parametrize("policy, most", [("all", 0), ("group:2", 1)])
def test_never_holds_more_than_one_unit_interior(policy, most):
    torch.manual_seed(0)
    model = nn.Sequential(*(CountingInteriorBlock() for _ in range(4)))
    plan = apply_policy(model, policy, blocks=CountingInteriorBlock)
    x = torch.randn(8, 32)
    CountingInteriorBlock.alive, CountingInteriorBlock.seen = [], []
    verify_equivalence(model, plan, lambda: model(x).pow(2).mean())
    assert CountingInteriorBlock.seen and max(CountingInteriorBlock.seen) == most  # a plain step: 3


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MutableBlock() for _ in range(2))

    def forward(self, x):
        h = self.blocks[0](x)
        x.mul_(2)  # the first block's input changes after its call: its recompute could never replay it
        return self.blocks[1](h)


def test_an_input_changed_in_place_after_the_call_is_a_mismatch_not_a_wrong_verdict():
    model = Parent()
    for block in model.blocks:
        block.forward = lambda x, lin=block.lin: torch.tanh(lin(x))  # replay-safe otherwise
    plan = apply_policy(model, "all", blocks=MutableBlock)
    report = verify_equivalence(model, plan, lambda: model(torch.randn(4, 8)).sum(), raise_on_mismatch=False)
    assert not report.ok and "modified in place" in report.blocks[0].worst and report.blocks[1].within_tolerance


def test_a_checkpointed_block_the_forward_never_calls_is_listed():
    torch.manual_seed(0)
    model = nn.Sequential(InteriorBlock(), InteriorBlock())
    plan = apply_policy(model, "all", blocks=InteriorBlock)
    x = torch.randn(4, 32)
    report = verify_equivalence(model, plan, lambda: model[0](x).sum())
    assert [b.block for b in report.blocks] == ["0"] and report.not_called == ("1",)
    assert "not called on this batch" in report.table()


class ShapeShifter(nn.Module):
    """Draws a data-dependent shape from mutable state: torch's determinism check refuses the replay."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        rows = x[: x.shape[0] - (self.calls % 2)]
        return x + torch.tanh(self.lin(rows)).mean(0, keepdim=True)


def test_a_replay_refused_by_torch_is_an_equivalence_error_naming_the_block():
    model = nn.Sequential(MutableBlock(), ShapeShifter())
    model[0].forward = lambda x, lin=model[0].lin: torch.tanh(lin(x))
    plan = apply_policy(model, "blocks:1", blocks=[MutableBlock, ShapeShifter])
    with pytest.raises(EquivalenceError, match=r"(?s)not replay-safe.*\n1 +recompute .*its replay failed: "):
        verify_equivalence(model, plan, lambda: model(torch.randn(4, 8)).sum())
