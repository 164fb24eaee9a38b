"""``group:K`` regions (lightning_ckpt/core/regions.py): gradients equal to the plain model whatever the parent does
between the blocks of a region; a region never spans two stacks; removal leaves no hook behind."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_ckpt import apply_policy, remove_checkpointing

GROUPS = ["group:2", "group:4", "group:sqrt"]


class Block(nn.Module):
    def __init__(self, width=8, p=0.2):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.p = p

    def forward(self, x):
        return F.dropout(torch.tanh(self.fc(x)), self.p, self.training)


class Parent(nn.Module):
    """A stack of 4 blocks; ``between(i, x)`` is what the parent does after block ``i``."""

    def __init__(self, between=None, n=4, width=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.between = between

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.between is not None:
                x = self.between(self, i, x)
        return x


def _grads(model, x, seed=0, passes=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = sum(model(x * (k + 1)).pow(2).sum() for k in range(passes))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(model, policy, x, passes=1):
    reference = copy.deepcopy(model)
    expected = _grads(reference, x, passes=passes)
    apply_policy(model, policy)
    got = _grads(model, x, passes=passes)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), (policy, name, (got[name] - expected[name]).abs().max())


def _dropout(parent, i, x):
    return F.dropout(x, 0.3, parent.training)


def _layerdrop(parent, i, x):
    torch.rand([])  # Hugging Face's LayerDrop draws between layers
    return x


def _in_place(parent, i, x):
    return x.mul_(0.5)


def _parameter_free(parent, i, x):
    # the block's output dies here: without a reference held, Python may give its id() to the new tensor
    x = torch.tanh(x)
    return x + 1


def _saves(parent, i, x):
    return torch.sigmoid(x) * parent.gate


@pytest.mark.parametrize("policy", GROUPS)
@pytest.mark.parametrize("between", [_dropout, _layerdrop, _in_place, _parameter_free, _saves])
def test_parent_work_between_blocks_keeps_gradients_bitwise(policy, between):
    torch.manual_seed(0)
    model = Parent(between)
    x = torch.randn(3, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _assert_same_grads(model, policy, x)


@pytest.mark.parametrize("policy", GROUPS)
@pytest.mark.parametrize("between", [None, _parameter_free, _dropout])
def test_two_forwards_before_one_backward(policy, between):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _assert_same_grads(Parent(between), policy, torch.randn(3, 8), passes=2)


class Looped(nn.Module):
    """The stack looped twice, or its first block reused after the stack."""

    def __init__(self, order):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.order = order

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        return x


@pytest.mark.parametrize("policy", GROUPS)
@pytest.mark.parametrize("order", [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 0], [0, 1, 1, 2, 3], [0, 1, 0, 1, 2, 3]])
def test_blocks_run_twice_in_one_forward(policy, order):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _assert_same_grads(Looped(order), policy, torch.randn(3, 8))


def test_a_split_region_warns_once_naming_what_the_parent_did():
    torch.manual_seed(0)
    model = Parent(_dropout)
    apply_policy(model, "group:2")
    x = torch.randn(3, 8)
    with pytest.warns(RuntimeWarning, match="random numbers") as record:
        for _ in range(3):
            model(x).sum().backward()
    assert len([w for w in record if "lightning_ckpt" in str(w.message)]) == 1
    assert "\n" not in str(record[0].message)


def _packed_gates(model, x):
    """How many times the parent's ``gate`` was saved through the user's outer hooks."""
    count = 0

    def pack(t):
        nonlocal count
        count += t is model.gate
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return count


@pytest.mark.parametrize("policy", GROUPS)
def test_the_parents_saves_between_blocks_go_through_the_users_hooks(policy):
    torch.manual_seed(0)
    model = Parent(_saves)
    x = torch.randn(3, 8)
    plain = _packed_gates(model, x)
    apply_policy(model, policy)
    assert plain == 4 and _packed_gates(model, x) == plain


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Parent(n=3)
        self.decoder = Parent(n=3)

    def forward(self, x):
        return self.decoder(self.encoder(x))


@pytest.mark.parametrize("policy", ["group:2", "group:sqrt", "group:4"])
def test_a_region_never_spans_two_stacks(policy):
    torch.manual_seed(0)
    model = EncoderDecoder()
    plan = apply_policy(model, policy)
    stacks = [name.rsplit(".", 2)[0] for name in plan.names]
    for start, stop in plan.layout.groups:
        assert len(set(stacks[start:stop])) == 1, (start, stop)
    assert plan.layout.groups  # still grouped within each stack
    remove_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no 'not called back to back' warning
        _assert_same_grads(model, policy, torch.randn(3, 8))


def _hook_entries(model):
    return sum(len(m._forward_hooks) + len(getattr(m, "_forward_hooks_always_called", {})) for m in model.modules())


def test_remove_checkpointing_leaves_no_hook_entries():
    model = Parent()
    apply_policy(model, "group:2")
    remove_checkpointing(model)
    assert _hook_entries(model) == 0
    plan = apply_policy(model, "group:2")
    for _ in range(3):
        plan.retarget("group:2")
        plan.retarget("all")
    assert _hook_entries(model) == 0


class Recycling(nn.Module):
    """Between blocks the block's output dies and a new tensor is made at once: CPython gives the new tensor the dead
    one's ``id()``, which must not pass for the block's output."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x = torch.tanh(x)
            x = x + 1
        return x


@pytest.mark.parametrize("policy", GROUPS)
def test_an_id_recycled_by_python_is_not_taken_for_the_previous_output(policy):
    torch.manual_seed(0)
    _assert_same_grads(Recycling(), policy, torch.randn(3, 8, requires_grad=True))


class MutatesAnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(p=0.0) for _ in range(2))

    def forward(self, x):
        h = x + 0
        y = self.blocks[0](x)
        y = self.blocks[1](h)  # h is kept as it was for the replay...
        h.mul_(2)  # ...and changed before backward
        return y


def test_an_input_changed_in_place_before_backward_is_refused_at_replay():
    model = MutatesAnInput()
    apply_policy(model, "group:2")
    out = model(torch.randn(3, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"do not change a tensor in place after passing it to a block"):
        out.sum().backward()


class AutocastBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(p=0.0) for _ in range(4))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1):
                x = block(x)
            x = x.float()
        return x


@pytest.mark.parametrize("policy", GROUPS)
def test_autocast_switched_between_blocks_keeps_gradients(policy):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _assert_same_grads(AutocastBetween(), policy, torch.randn(3, 8))


class RaisesBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x, fail=False):
        x = self.blocks[0](x)
        if fail:
            raise KeyError("the parent's own error")
        for block in self.blocks[1:]:
            x = block(x)
        return x


def test_an_error_of_the_parent_between_blocks_leaves_no_hooks_behind():
    model = RaisesBetween()
    apply_policy(model, "group:4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(KeyError):
            model(torch.randn(2, 8), fail=True)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(torch.randn(2, 8)).sum().backward()


def _tiny_bart():
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=6, decoder_layers=6, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, use_cache=False)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config)


def test_a_six_plus_six_bart_under_group_sqrt_trains_bitwise():
    model = _tiny_bart()
    model.train()
    reference = copy.deepcopy(model)
    plan = apply_policy(model, "group:sqrt")
    assert plan.layout.groups == ((0, 3), (3, 6), (6, 9), (9, 12))
    ids = torch.randint(4, 64, (2, 10))
    grads = []
    for m in (reference, model):
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # LayerDrop's draw splits the regions
            m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("between", [_saves, _dropout])
def test_a_region_runs_under_fake_tensors_and_a_users_dispatch_mode(between):
    """The checks between blocks dispatch no op: a fake-tensor trace (the forecast's) cannot answer ``torch.equal``,
    and a user's dispatch mode must not see the plugin's own work."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Parent(between)
    apply_policy(model, "group:2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("error", UserWarning)  # FakeTensor's data pointer read: the states must be real
        with FakeTensorMode(allow_non_fake_inputs=True):
            model(torch.randn(2, 8)).sum().backward()
        with Ops():
            model(torch.randn(2, 8)).sum()
    assert torch.ops.aten.equal.default not in Ops.seen


def test_a_region_and_plan_state_pickled_by_the_previous_version_load():
    """The previous version pickled a region's forward state (gen, records, next, prev_leaves, between) and no
    per-plan warning set: loading such a state starts afresh instead of failing at the first split."""
    from lightning_ckpt.core.regions import GroupRegion
    from lightning_ckpt.core.wrap import get_plan

    model = Parent(_dropout)
    plan = apply_policy(model, "group:2")
    for region in plan._regions:
        old = {"members": region.members, "anchor": region.anchor, "gen": None, "records": [], "next": 0,
               "prev_leaves": {}, "between": None}
        region.__dict__.clear()
        GroupRegion.__setstate__(region, old)
    shared = get_plan(model).shared
    state = shared.__getstate__()
    del state["group_warnings"]
    shared.__dict__.clear()
    shared.__setstate__(state)
    with pytest.warns(RuntimeWarning, match="random numbers"):
        model(torch.randn(2, 8)).sum().backward()
