"""``selective`` never keeps a call that draws random numbers (issue 24).

A kept op is skipped when its block is replayed in backward, so a kept op that draws random numbers leaves the
generator behind and every later random op of the block (dropout) draws a shifted stream: wrong gradients,
silently. The fused attention kernels draw their own dropout when ``dropout_p > 0``, so they are kept only for calls
with ``dropout_p == 0``; ops that always draw are refused in a save list.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from lightning_ckpt import apply_policy
from lightning_ckpt.core.policy import parse_policy
from lightning_ckpt.core.wrap import CheckpointOptions, _Shared

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
ATEN = torch.ops.aten


class RandBlock(nn.Module):
    """The issue's repro: a random op whose output feeds a later dropout."""

    def __init__(self, width=16):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        y = self.a(x) * torch.rand_like(x)
        return x + self.drop(self.b(torch.relu(y)))


class Net(nn.Module):
    def __init__(self, block=RandBlock, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _grads(model, x, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(x).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_bitwise(model, reference, x):
    expected = _grads(reference, x)
    got = _grads(model, x)
    worst = {n: (got[n] - expected[n]).abs().max().item() for n in got if not torch.equal(got[n], expected[n])}
    assert not worst, f"gradients differ from the un-checkpointed model: {worst}"


# ------------------------------------------------------------------------------------------ parse time


def test_the_issues_repro_block_is_refused_before_training():
    model = Net()
    with pytest.raises(ValueError, match=r"drop 'rand_like' from the save list"):
        apply_policy(model, "selective:mm,rand_like")
    assert all("forward" not in block.__dict__ for block in model.blocks)  # nothing was wrapped


# ------------------------------------------------------------------------- the policy function, per call


def _policy_fn(spec="selective"):
    shared = _Shared(CheckpointOptions())
    shared.set_save_ops(parse_policy(spec).layout(1).save_ops)
    return shared.sac_policy


def _qkv():
    q = torch.randn(1, 2, 4, 8)
    return q, q.clone(), q.clone()


# the arguments the CUDA dispatcher passes (keyword-only arguments as keywords); dropout_p is read, nothing runs
CUDA_CALLS = {
    "flash": (ATEN._scaled_dot_product_flash_attention.default, lambda q, k, v: (q, k, v), 3),
    "efficient": (ATEN._scaled_dot_product_efficient_attention.default, lambda q, k, v: (q, k, v, None, True), 5),
    "cudnn": (ATEN._scaled_dot_product_cudnn_attention.default, lambda q, k, v: (q, k, v, None, True), 5),
    "cpu_flash": (ATEN._scaled_dot_product_flash_attention_for_cpu.default, lambda q, k, v: (q, k, v), 3),
    "overrideable": (ATEN._scaled_dot_product_fused_attention_overrideable.default,
                     lambda q, k, v: (q, k, v, None), 4),
}


@pytest.mark.parametrize("kernel", sorted(CUDA_CALLS))
def test_attention_is_kept_only_for_calls_without_dropout(kernel):
    policy = _policy_fn()
    op, leading, position = CUDA_CALLS[kernel]
    args = leading(*_qkv())
    assert len(args) == position  # dropout_p comes next in the schema
    assert op._schema.arguments[position].name == "dropout_p"
    # positional, as the C++ caller passes it; the dispatcher drops trailing defaults, so also without it
    assert policy(None, op, *args, 0.0, True) is SAVE
    assert policy(None, op, *args) is SAVE
    assert policy(None, op, *args, 0.1, True) is RECOMPUTE
    assert policy(None, op, *args, 0.1) is RECOMPUTE
    # by keyword
    assert policy(None, op, *args, dropout_p=0.0, scale=0.5) is SAVE
    assert policy(None, op, *args, dropout_p=0.1, is_causal=True) is RECOMPUTE


def test_the_quantized_flash_overload_reads_dropout_p_at_its_own_position():
    policy = _policy_fn()
    op = ATEN._scaled_dot_product_flash_attention.quantized
    q, k, v = _qkv()
    assert policy(None, op, q, k, v, None, None, None, 0.0) is SAVE
    assert policy(None, op, q, k, v, None, None, None, 0.25) is RECOMPUTE


def test_the_low_level_kernels_need_dropout_p_and_are_decided_by_it():
    policy = _policy_fn("selective:_efficient_attention_forward,_flash_attention_forward")
    q, k, v = _qkv()
    efficient = ATEN._efficient_attention_forward.default
    assert policy(None, efficient, q, k, v, None, None, None, None, None, 0.0, 0) is SAVE
    assert policy(None, efficient, q, k, v, None, None, None, None, None, 0.5, 0) is RECOMPUTE
    flash = ATEN._flash_attention_forward.default
    assert policy(None, flash, q, k, v, None, None, 4, 4, 0.0, False, False) is SAVE
    assert policy(None, flash, q, k, v, None, None, 4, 4, 0.5, False, False) is RECOMPUTE


def test_a_dropout_p_that_is_not_a_number_is_recomputed():
    """Under dynamic shapes a symbolic float could arrive: keeping it would risk a shifted stream."""
    policy = _policy_fn()
    op = ATEN._scaled_dot_product_flash_attention.default
    assert policy(None, op, *_qkv(), object()) is RECOMPUTE


def test_matmuls_are_always_kept_and_unlisted_ops_recomputed():
    policy = _policy_fn()
    a = torch.randn(4, 4)
    for op in (ATEN.mm.default, ATEN.addmm.default, ATEN.bmm.default, ATEN.mm.out):
        assert policy(None, op, a, a) is SAVE
    assert policy(None, ATEN.gelu.default, a) is RECOMPUTE
    assert policy(None, ATEN.native_dropout.default, a, 0.1, True) is RECOMPUTE


def test_a_seeded_op_that_reaches_the_policy_is_never_kept():
    """A save list built without parsing (the plan's internals) still never keeps an op that draws."""
    shared = _Shared(CheckpointOptions())
    shared.set_save_ops(("mm", "rand_like", "bernoulli"))
    a = torch.randn(4, 4)
    assert shared.sac_policy(None, ATEN.rand_like.default, a) is RECOMPUTE
    assert shared.sac_policy(None, ATEN.bernoulli.p, a, 0.5) is RECOMPUTE
    assert shared.sac_policy(None, ATEN.mm.default, a, a) is SAVE


# ------------------------------------------------------------------------------------------ end to end


def test_a_seeded_op_in_the_save_list_replays_the_same_stream():
    """The issue's repro, past the parse-time check: gradients bitwise equal to the un-checkpointed model."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    plan = apply_policy(model, "selective:mm")
    plan.shared.set_save_ops(("mm", "addmm", "rand_like"))
    _assert_bitwise(model, reference, torch.randn(2, 5, 16))


FUSED = ATEN._scaled_dot_product_fused_attention_overrideable


@pytest.fixture
def cpu_fused_attention():
    """A CPU kernel for the fused attention op meant for other backends (in the default ``sdpa`` save list): math
    attention whose dropout draws its seed from the CPU generator, as the CUDA kernels draw theirs (the CPU build
    has no fused kernel that draws: the CPU flash kernel refuses ``dropout_p > 0``)."""
    lib = torch.library.Library("aten", "IMPL")

    def mask(seed, p, shape):
        generator = torch.Generator().manual_seed(int(seed.item()))
        return (torch.rand(shape, generator=generator) >= p).to(torch.float32) / (1 - p)

    def forward(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = q @ k.transpose(-2, -1) * scale
        probs = torch.softmax(scores, -1)
        seed = torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0 else torch.zeros((), dtype=torch.int64)
        if dropout_p > 0:
            probs = probs * mask(seed, dropout_p, probs.shape)
        empty = torch.empty(0)
        return (probs @ v, torch.logsumexp(scores, -1), empty, empty, q.shape[-2], k.shape[-2], seed,
                torch.zeros((), dtype=torch.int64), empty)

    def backward(grad, q, k, v, attn_bias, grad_input_mask, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
                 is_causal, seed, offset, *, scale=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        probs = torch.softmax(q @ k.transpose(-2, -1) * scale, -1)
        keep = mask(seed, dropout_p, probs.shape) if dropout_p > 0 else torch.ones_like(probs)
        grad_v = (probs * keep).transpose(-2, -1) @ grad
        grad_probs = (grad @ v.transpose(-2, -1)) * keep
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, grad_v, None

    lib.impl("_scaled_dot_product_fused_attention_overrideable", forward, "CPU")
    lib.impl("_scaled_dot_product_fused_attention_overrideable_backward", backward, "CPU")
    yield
    lib._destroy()


class FusedAttentionBlock(nn.Module):
    """Attention with dropout inside the fused kernel, then a residual dropout (GPT-2's layout)."""

    def __init__(self, width=16, heads=2, attn_dropout=0.2):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)
        self.heads, self.attn_dropout = heads, attn_dropout

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = FUSED(q, k, v, None, self.attn_dropout)[0].transpose(1, 2).reshape(b, t, w)
        return x + self.drop(self.proj(attn))


def test_the_cpu_fused_attention_fixture_is_attention(cpu_fused_attention):
    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(FUSED(q, q, q)[0].sum(), q)
    (expected,) = torch.autograd.grad(F.scaled_dot_product_attention(q, q, q).sum(), q)
    torch.testing.assert_close(grad, expected)
    torch.manual_seed(0)
    first = FUSED(q, q, q, None, 0.5)[0]
    second = FUSED(q, q, q, None, 0.5)[0]
    assert not torch.equal(first, second)  # it draws


@pytest.mark.parametrize("attn_dropout", [0.2, 0.0])
def test_default_selective_with_attention_dropout_is_bitwise(cpu_fused_attention, attn_dropout):
    torch.manual_seed(0)
    model = Net(lambda: FusedAttentionBlock(attn_dropout=attn_dropout))
    reference = copy.deepcopy(model)
    apply_policy(model, "selective")
    _assert_bitwise(model, reference, torch.randn(2, 6, 16))


def test_attention_without_dropout_is_still_kept(cpu_fused_attention):
    """The fix keeps what ``selective`` is for: a dropout-free attention call is saved, not replayed."""
    torch.manual_seed(0)
    model = Net(lambda: FusedAttentionBlock(attn_dropout=0.0), n=1)
    apply_policy(model, "selective", blocks="blocks.*")
    calls = {"n": 0}

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls["n"] += func is FUSED.default
            return func(*args, **(kwargs or {}))

    out = model(torch.randn(2, 6, 16)).sum()
    with Count():
        out.backward()
    assert calls["n"] == 0
    model = Net(lambda: FusedAttentionBlock(attn_dropout=0.2), n=1)
    apply_policy(model, "selective", blocks="blocks.*")
    out = model(torch.randn(2, 6, 16)).sum()
    with Count():
        out.backward()
    assert calls["n"] == 1  # with dropout: recomputed


# ------------------------------------------------------------------------------------------------ CUDA


class SdpaBlock(nn.Module):
    def __init__(self, width=64, heads=4):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.heads = heads

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        return x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, w)))


@pytest.mark.gpu
def test_cuda_selective_with_sdpa_dropout_is_bitwise():
    device = torch.device("cuda")
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # float32 takes the memory-efficient kernel, whose backward may split the keys across thread blocks (atomic
    # adds); 32 keys fit one key block, so it cannot split, and deterministic mode is asked for on top
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.manual_seed(0)
        model = Net(SdpaBlock, n=3).to(device)
        reference = copy.deepcopy(model)
        apply_policy(model, "selective")
        x = torch.randn(2, 32, 64, device=device)
        fused = []

        class Fused(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(a.name == "dropout_p" for a in func._schema.arguments):
                    fused.append(func)
                return func(*args, **(kwargs or {}))

        with Fused(), torch.no_grad():
            reference(x)
        assert fused, "SDPA took the math path: the test needs a fused kernel that draws its own dropout"
        _assert_bitwise(model, reference, x)
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
