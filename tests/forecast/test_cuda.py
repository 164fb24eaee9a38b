"""``cuda_semantics``: a CPU trace (fake or real tensors) saves for backward what CUDA autograd would save."""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_ckpt.forecast import cuda
from lightning_ckpt.forecast.cuda import SDPA_BACKENDS, choose_sdpa, choose_sdpa_backend, cuda_semantics
from lightning_ckpt.forecast.sdpa import (
    GpuTarget,
    SdpaCall,
    parse_torch_version,
    resolve_gpu,
    saved_bytes,
    saved_for_backward,
)
from lightning_ckpt.forecast.trace import cast_floating
from lightning_ckpt.measure.tracker import LiveBytes, storage_key, storages

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# targets: an A100 runs flash first (the tables below were derived for it); an H100 with a recent cuDNN prefers
# cuDNN attention; a T4 has neither flash nor bf16 efficient attention
A100 = GpuTarget((8, 0), 92400, (2, 14), name="A100")
H100 = GpuTarget((9, 0), 91900, (2, 11), name="H100")
T4 = GpuTarget((7, 5), 91900, (2, 11), name="T4")
# this torch's efficient kernel takes k, v with fewer heads than q (pytorch#191085, torch 2.14)
EFFICIENT_GQA_HERE = parse_torch_version(torch.__version__) >= (2, 14)
# the tracker keys fake storages by identity after reading their (zero) data pointer, which PyTorch warns about
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


# --- helpers ----------------------------------------------------------------------------------------------------


def tensor_mode(fake: bool):
    """Where the test's tensors live: a fake-tensor mode (what the planner traces with) or real CPU tensors."""
    return FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()


class Saved:
    """Every tensor autograd saves while active, and the unique CPU storages behind them (a saved view counts as
    its base, once; tensors on other devices and ``exclude``d storages, e.g. parameters, are not counted)."""

    def __init__(self, exclude=()):
        self.exclude = {storage_key(st) for t in exclude for st in storages(t)}
        self.tensors = []  # (shape, dtype, device type) of every saved tensor, in order
        self.bases = {}  # storage key -> (nbytes, base shape, dtype)
        self.inside = None  # when set, a callable telling whether a first save belongs to the measured region
        self.region = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        self.tensors.append((tuple(t.shape), t.dtype, t.device.type))
        root = t if t._base is None else t._base
        if root.device.type == "cpu":
            for st in storages(root):
                key = storage_key(st)
                if key not in self.bases and key not in self.exclude:
                    self.bases[key] = (st.nbytes(), tuple(root.shape), root.dtype)
                    if self.inside is not None and self.inside():
                        self.region[key] = self.bases[key]
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(b[0] for b in self.bases.values())

    def of(self, dtype):
        return [b for b in self.bases.values() if b[2] == dtype]


def qkv(shape, dtype=BF16, kv_heads=None, grad=True):
    """Independent query, key, value leaves [B, H, L, D] (key and value with ``kv_heads`` heads)."""
    b, h, length, d = shape
    q = torch.randn(b, h, length, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, kv_heads or h, length, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, kv_heads or h, length, d, dtype=dtype, requires_grad=grad)
    return q, k, v


@contextlib.contextmanager
def fake_cuda_autocast(dtype):
    """CUDA autocast on fake CUDA tensors: PyTorch's own AutocastCUDA kernels, without a GPU. ``torch.autocast``
    refuses CUDA when no device is present, so the state is set directly, and restored."""
    prev_enabled, prev_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev_enabled)
        torch.set_autocast_dtype("cuda", prev_dtype)


def fake_cuda_available() -> bool:
    try:
        with FakeTensorMode():
            torch.empty(1, device="cuda")
        return True
    except Exception:  # a build that cannot describe CUDA tensors at all
        return False


# --- arguments --------------------------------------------------------------------------------------------------


def test_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"--sdpa-backend='x'.*'auto', 'cudnn', 'flash', 'efficient', 'math'"):
        with cuda_semantics("x"):
            pass
    q, k, v = qkv((1, 1, 4, 8))
    with pytest.raises(ValueError, match=r"--sdpa-backend='fast'"):
        choose_sdpa_backend(q, k, v, override="fast")
    assert SDPA_BACKENDS == ("auto", "cudnn", "flash", "efficient", "math")


def test_autocast_dtype_must_be_a_cuda_autocast_dtype():
    with pytest.raises(ValueError, match=r"autocast_dtype=torch.float32 .*torch.bfloat16 or torch.float16"):
        with cuda_semantics(autocast_dtype=FP32):
            pass


# --- rule 1: dropout --------------------------------------------------------------------------------------------

DROPOUTS = {
    "F.dropout": lambda x: F.dropout(x, 0.1, training=True),
    "nn.Dropout": lambda x: torch.nn.Dropout(0.1)(x),
    "torch.dropout": lambda x: torch.dropout(x, 0.1, True),
}


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("entry", list(DROPOUTS))
def test_dropout_saves_a_bool_mask(entry, dtype, fake):
    with tensor_mode(fake):
        x = torch.randn(4, 32, dtype=dtype, requires_grad=True)
        with Saved() as cpu:
            DROPOUTS[entry](x)
        with cuda_semantics(), Saved() as gpu:
            y = DROPOUTS[entry](x)
        y.sum().backward()  # native_dropout's backward runs
    # CPU: input * noise, mul saves the noise in the input dtype; CUDA: native_dropout saves a bool mask
    assert [b[1:] for b in cpu.bases.values()] == [((4, 32), dtype)]
    assert [b[1:] for b in gpu.bases.values()] == [((4, 32), torch.bool)]
    assert gpu.nbytes == 4 * 32 and cpu.nbytes == 4 * 32 * x.element_size()
    assert x.grad.shape == x.shape


def test_dropout_values_and_gradient_are_dropout():
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    with cuda_semantics():
        y = F.dropout(x, 0.25, training=True)
    y.sum().backward()
    kept = y != 0
    assert 0.6 < kept.float().mean() < 0.9
    torch.testing.assert_close(y[kept], x.detach()[kept] / 0.75)
    torch.testing.assert_close(x.grad, kept.float() / 0.75)


def test_dropout_keeps_the_other_code_paths():
    x = torch.randn(8, 8, requires_grad=True)
    with cuda_semantics():
        for p, training in ((0.0, True), (0.5, False)):  # _dropout_impl returns its input: nothing saved
            with Saved() as saved:
                y = F.dropout(x, p, training=training)
            assert saved.tensors == [] and torch.equal(y, x)
        with Saved() as saved:  # p == 1: input * zeros({}), mul saves the 0-dim zero
            y = F.dropout(x, 1.0, training=True)
        assert saved.tensors == [((), FP32, "cpu")] and not y.any()
        with Saved() as saved:  # in place: never fused, CUDA runs the CPU code path (noise in the input dtype)
            z = x.detach().clone().requires_grad_()
            F.dropout(z.clone(), 0.5, training=True, inplace=True)
        assert [t[1] for t in saved.tensors] == [FP32]
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, 1.5)


# --- rule 2: scaled_dot_product_attention: the backend choice ----------------------------------------------------

# (label, dtype, head dim, query/key lengths, attn_mask, dropout, is_causal, kv heads, enable_gqa, expected)
CHOICES = [
    ("bf16 causal", BF16, 64, (16, 16), None, 0.0, True, None, False, "flash"),
    ("fp16 dropout", FP16, 128, (16, 16), None, 0.1, False, None, False, "flash"),
    ("head dim 256", BF16, 256, (16, 16), None, 0.0, False, None, False, "flash"),
    ("head dim 12 is padded", BF16, 12, (16, 16), None, 0.0, False, None, False, "flash"),
    ("head dim 264 > 256", BF16, 264, (16, 16), None, 0.0, False, None, False, "efficient"),
    ("bf16 with a mask", BF16, 64, (16, 16), "bool", 0.1, False, None, False, "efficient"),
    ("float mask", FP16, 64, (16, 16), "float", 0.0, False, None, False, "efficient"),
    ("causal, lengths differ", BF16, 64, (8, 16), None, 0.0, True, None, False, "efficient"),
    ("fp32", FP32, 64, (16, 16), None, 0.1, True, None, False, "efficient"),
    ("fp32 head dim 12", FP32, 12, (16, 16), None, 0.0, False, None, False, "efficient"),
    ("fp32 head dim 6", FP32, 6, (16, 16), None, 0.0, False, None, False, "math"),
    ("bf16 head dim 12 with a mask", BF16, 12, (16, 16), "bool", 0.0, False, None, False, "math"),
    ("fp64", torch.float64, 64, (16, 16), None, 0.0, False, None, False, "math"),
    ("GQA", BF16, 64, (16, 16), None, 0.0, True, 2, True, "flash"),
    ("GQA with a mask", BF16, 64, (16, 16), "bool", 0.0, False, 2, True, "efficient"),
    ("heads differ without enable_gqa", BF16, 64, (16, 16), None, 0.0, True, 2, False, "math"),
    ("MQA broadcast", BF16, 64, (16, 16), None, 0.0, True, 1, False, "flash"),
]


def _call_args(dtype, head_dim, lengths, mask, kv_heads):
    lq, lk = lengths
    q = torch.randn(2, 4, lq, head_dim, dtype=dtype)
    k = torch.randn(2, kv_heads or 4, lk, head_dim, dtype=dtype)
    v = torch.randn(2, kv_heads or 4, lk, head_dim, dtype=dtype)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.ones(lq, lk, dtype=torch.bool).tril()
    elif mask == "float":
        attn_mask = torch.zeros(2, 1, lq, lk, dtype=dtype)
    return q, k, v, attn_mask


@pytest.mark.parametrize("label, dtype, head_dim, lengths, mask, dropout, causal, kv_heads, gqa, expected", CHOICES,
                         ids=[c[0] for c in CHOICES])
def test_backend_choice_follows_cuda_sdp_utils(label, dtype, head_dim, lengths, mask, dropout, causal, kv_heads, gqa,
                                               expected):
    q, k, v, attn_mask = _call_args(dtype, head_dim, lengths, mask, kv_heads)
    assert choose_sdpa_backend(q, k, v, attn_mask, dropout, causal, gqa, gpu=A100) == expected


def test_backend_choice_edge_cases():
    q, k, v = qkv((2, 4, 16, 64), grad=False)
    assert choose_sdpa_backend(q[0], k[0], v[0], gpu=A100) == "flash"  # unbatched inputs get a batch of one
    # efficient needs q, k, v storage offsets aligned to 8 half-precision elements (check_data_ptr_alignment)
    base = torch.randn(2 * 4 * 16 * 64 + 4, dtype=BF16)
    shifted = base[4:].view(2, 4, 16, 64)
    assert choose_sdpa_backend(shifted, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), gpu=A100) == "math"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # fused kernels disabled by the user
        assert choose_sdpa_backend(q, k, v, gpu=A100) == "math"
        assert choose_sdpa_backend(q, k, v, gpu=H100) == "math"


# the same bf16 causal training call [2, 4, 64, 64] on each target, and what PyTorch runs there
TARGETS = [
    ("H100, cuDNN 9.19, torch 2.11", H100, BF16, "cudnn"),
    ("H100, cuDNN 9.10", GpuTarget((9, 0), 91002, (2, 11)), BF16, "flash"),
    ("B200", GpuTarget((10, 0), 91900, (2, 11)), BF16, "cudnn"),
    ("A100", GpuTarget((8, 0), 91900, (2, 11)), BF16, "flash"),
    ("T4 bf16", T4, BF16, "math"),
    ("T4 fp16", T4, FP16, "efficient"),
]


@pytest.mark.parametrize("label, gpu, dtype, expected", TARGETS, ids=[t[0] for t in TARGETS])
def test_auto_runs_what_the_target_gpu_runs(label, gpu, dtype, expected):
    q, k, v = qkv((2, 4, 64, 64), dtype=dtype)
    choice = choose_sdpa(q, k, v, is_causal=True, gpu=gpu)
    assert choice.backend == expected
    assert choice.source.file.startswith("aten/src/ATen/native/transformers/")


@pytest.mark.parametrize("gpu, expected", [(H100, "math"), (replace(H100, torch_version=(2, 14)), "cudnn")],
                         ids=["2.11", "2.14"])
def test_unbatched_attention_runs_math_on_2_11_and_a_fused_kernel_on_2_14(gpu, expected):
    q, k, v = (t[0].detach().requires_grad_() for t in qkv((1, 4, 64, 32)))  # [H, L, D] leaves
    record = []
    with cuda_semantics(gpu=gpu, record=record):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().sum().backward()
    assert [c.backend for c in record] == [expected] and out.shape == q.shape and q.grad.shape == q.shape


def test_default_target_is_resolved_with_its_assumptions(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    q, k, v = qkv((2, 4, 64, 64))
    record = []
    with cuda_semantics(record=record):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert [c.backend for c in record] == [choose_sdpa_backend(q, k, v, is_causal=True, gpu=resolve_gpu())]
    assert record[0].order[0] == "cudnn"  # an assumed H100 with this machine's (recent) cuDNN


def test_override_forces_a_backend_or_explains_why_not():
    q, k, v, mask = _call_args(BF16, 64, (16, 16), "bool", None)
    assert choose_sdpa_backend(q, k, v, mask, override="efficient", gpu=A100) == "efficient"
    assert choose_sdpa_backend(q, k, v, override="efficient", gpu=A100) == "efficient"  # flash could, but is forced
    assert choose_sdpa_backend(q, k, v, mask, override="math", gpu=A100) == "math"
    assert choose_sdpa_backend(q, k, v, mask, override="cudnn", gpu=H100) == "cudnn"
    with pytest.raises(ValueError, match=r"--sdpa-backend='flash' cannot run .*attn_mask.*'auto'"):
        choose_sdpa_backend(q, k, v, mask, override="flash", gpu=A100)
    with pytest.raises(ValueError, match=r"--sdpa-backend='cudnn' cannot run .*T4 \(SM 7.5\).*SM 8.0 to 12.1"):
        choose_sdpa_backend(q, k, v, override="cudnn", gpu=T4)
    q64, k64, v64, _ = _call_args(torch.float64, 64, (16, 16), None, None)
    with pytest.raises(ValueError, match=r"--sdpa-backend='efficient' cannot run .*float64"):
        choose_sdpa_backend(q64, k64, v64, override="efficient", gpu=A100)
    with cuda_semantics("flash", gpu=A100), pytest.raises(ValueError, match="--sdpa-backend='flash'"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # raised from inside the dispatcher, unchanged


# --- rule 2: what each backend saves ------------------------------------------------------------------------------


def _saved_by_sdpa(backend, q, k, v, gpu=A100, backward=False, **kwargs):
    """What SDPA saves under ``cuda_semantics``; ``backward`` runs the backward too, inside the context (on real
    tensors the fused ops' CPU placeholders exist only there)."""
    with cuda_semantics(backend, gpu=gpu):
        with Saved() as saved:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        if backward:
            out.float().sum().backward()
    return out, saved


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_flash_saves_qkv_output_and_logsumexp(fake):
    b, h, length, d = 2, 4, 24, 64
    with tensor_mode(fake):
        q, k, v = qkv((b, h, length, d))
        out, saved = _saved_by_sdpa("auto", q, k, v, is_causal=True, dropout_p=0.1)
    # derivatives.yaml _scaled_dot_product_flash_attention: query, key, value, output, logsumexp, rng_state, unused
    assert sorted(saved.tensors, key=str) == sorted([((b, h, length, d), BF16, "cpu")] * 4 + [
        ((b, h, length), FP32, "cpu"),  # logsumexp, float32 whatever the inputs
        ((2,), torch.uint64, "cpu"), ((), torch.uint64, "cpu"),  # rng_state, unused (as PyTorch's fake kernel)
    ], key=str)
    # no dropout mask: the kernel regenerates it from the philox state
    assert saved.nbytes == 4 * b * h * length * d * 2 + b * h * length * 4 + 16 + 8
    assert out.shape == (b, h, length, d) and out.is_contiguous()  # the query's layout: mha_fwd's empty_like(q)


def test_flash_pads_the_head_dim_to_a_multiple_of_8():
    q, k, v = qkv((1, 2, 8, 12))
    out, saved = _saved_by_sdpa("flash", q, k, v, backward=True)
    assert [t[0] for t in saved.tensors].count((1, 2, 8, 16)) == 4  # attention.cpp's pad_last_dim<8> copies, output
    assert out.shape == (1, 2, 8, 12)
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("length, lse", [(1, 32), (31, 32), (32, 32), (33, 64), (64, 64)])
def test_efficient_logsumexp_is_padded_to_32(length, lse):
    q, k, v = qkv((2, 3, length, 8), dtype=FP32)
    _, saved = _saved_by_sdpa("efficient", q, k, v)
    assert ((2, 3, lse), FP32, "cpu") in saved.tensors


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_efficient_saves_the_padded_additive_bias(fake):
    b, h, length, d = 2, 4, 17, 16
    with tensor_mode(fake):
        q, k, v = qkv((b, h, length, d), dtype=FP32)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        out, saved = _saved_by_sdpa("auto", q, k, v, attn_mask=mask, backward=True)
    # q, k, v, bias (the bool mask made additive in the query dtype, padded 17 -> 24 for alignment, sliced,
    # expanded to [B, H, L, S]), output, log_sumexp [B, H, 32], philox seed and offset
    assert sorted(saved.tensors, key=str) == sorted([((b, h, length, d), FP32, "cpu")] * 3 + [
        ((b, h, length, length), FP32, "cpu"), ((b, h, length, d), FP32, "cpu"), ((b, h, 32), FP32, "cpu"),
        ((), torch.int64, "cpu"), ((), torch.int64, "cpu")], key=str)
    assert ((length * 24 * 4, (length, 24), FP32)) in saved.bases.values()


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_math_is_pytorchs_composite_with_a_bool_dropout_mask(dtype, dropout):
    b, h, length, d = 2, 2, 8, 16
    q, k, v = qkv((b, h, length, d), dtype=dtype)
    with Saved() as reference:  # PyTorch's math path, as CUDA runs it; its dropout is the CPU one here
        torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, dropout, True)
    out, saved = _saved_by_sdpa("math", q, k, v, dropout_p=dropout, is_causal=True)
    # the same tensors, except that the CPU's float dropout noise is a bool mask
    expected = [(t[0], torch.bool, t[2]) if i == 3 and dropout else t for i, t in enumerate(reference.tensors)]
    assert saved.tensors == expected
    # allowFP16BF16ReductionMathSDP is off by default: bf16 q, k, v are upcast, the attention matrix is float32
    assert saved.tensors[2] == ((b, h, length, length), FP32, "cpu")
    if dropout:
        assert reference.tensors[3] == ((b, h, length, length), FP32, "cpu")
    out.sum().backward()


def test_math_repeats_kv_heads_for_gqa():
    q, k, v = qkv((1, 4, 8, 16), dtype=FP32, kv_heads=2)
    out, saved = _saved_by_sdpa("math", q, k, v, enable_gqa=True)
    assert ((4, 8, 16), FP32, "cpu") in saved.tensors  # pre_process_group_query_attention_input: repeat_interleave
    out.sum().backward()
    assert k.grad.shape == k.shape


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_stand_ins_save_what_pytorchs_fused_ops_save(backend):
    """On fake tensors PyTorch's own fused ops run their meta kernels under their real autograd nodes: the
    stand-ins must save the same shapes and dtypes."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = qkv((2, 4, 40, 64))
        with Saved() as pytorch:
            if backend == "flash":
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.1, True)
            else:
                torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.1, True)
        _, saved = _saved_by_sdpa(backend, q, k, v, dropout_p=0.1, is_causal=True)
    assert sorted(saved.tensors, key=str) == sorted(pytorch.tensors, key=str)


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("backend", ["flash", "efficient", "math"])
def test_gradients_have_the_inputs_shapes(backend, fake):
    with tensor_mode(fake):
        q, k, v = qkv((2, 4, 16, 32), kv_heads=2 if backend != "efficient" or EFFICIENT_GQA_HERE else None)
        bias = torch.zeros(2, 1, 16, 16, dtype=BF16, requires_grad=True) if backend == "efficient" else None
        with cuda_semantics(backend, gpu=A100):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.1, enable_gqa=True)
            out.float().pow(2).sum().backward()
    assert out.shape == q.shape
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    if bias is not None:
        assert bias.grad.shape == bias.shape


@pytest.mark.skipif(EFFICIENT_GQA_HERE, reason="this torch's efficient kernel takes GQA")
def test_efficient_gqa_needs_a_torch_whose_kernel_takes_it():
    """The A100 target's 2.14 rules send GQA to the efficient kernel; an older installed torch's kernel (whose meta
    kernel the trace runs) would give key gradients with the query's heads: refused, with the fix."""
    q, k, v = qkv((2, 4, 16, 32), kv_heads=2)
    with cuda_semantics("efficient", gpu=A100), pytest.raises(ValueError, match="Install torch 2.14"):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_fused_output_and_logsumexp_are_counted_as_new_storages():
    """The meter counts storages operators create under grad mode; ``Function.forward`` runs without it, so the
    stand-in's output and logsumexp must be created outside it."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = qkv((2, 4, 16, 64))
        live = LiveBytes(torch.device("cpu"), gate=torch.is_grad_enabled)
        with cuda_semantics(gpu=A100), live:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert storage_key(out.untyped_storage()) in live.tracked
        # output (bf16), logsumexp (fp32), rng_state and unused (24 bytes); nothing else
        assert live.live == out.numel() * 2 + 2 * 4 * 16 * 4 + 24


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "bool-mask"])
def test_cudnn_stand_in_saves_what_pytorchs_cudnn_op_saves(mask):
    """PyTorch's own ``_scaled_dot_product_cudnn_attention`` on fake tensors (meta kernel, real autograd node), with
    the bias attention.cpp passes it (convert_boolean_attn_mask_cudnn), against the stand-in."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = qkv((2, 4, 40, 64))
        bool_mask = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril() if mask else None
        bias = None if bool_mask is None else torch.where(bool_mask.logical_not(), -65504.0,
                                                          torch.scalar_tensor(0.0, dtype=BF16))
        with Saved() as pytorch:
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.1, not mask)
        out, saved = _saved_by_sdpa("auto", q, k, v, gpu=H100, attn_mask=bool_mask, dropout_p=0.1,
                                    is_causal=not mask)
    assert sorted(saved.tensors, key=str) == sorted(pytorch.tensors, key=str)
    assert ((2, 4, 40, 1), FP32, "cpu") in saved.tensors  # logsumexp [B, H, L, 1]
    assert out.shape == q.shape


@pytest.mark.parametrize("backend, gpu", [("cudnn", H100), ("flash", A100)])
def test_fused_output_takes_the_querys_layout(backend, gpu):
    """A query that is a transposed view of a [B, L, 3C] projection (Hugging Face GPT-2): the output keeps its
    order, so the caller's ``transpose(1, 2).contiguous()`` copies nothing (cuDNN: alloc_with_matching_layout;
    flash: mha_fwd's ``empty_like(q)``)."""
    qkv_out = torch.randn(2, 40, 3 * 64, dtype=BF16, requires_grad=True)
    q, k, v = (t.view(2, 40, 4, 16).transpose(1, 2) for t in qkv_out.split(64, dim=2))
    assert choose_sdpa(q, k, v, is_causal=True, gpu=gpu).backend == backend
    with cuda_semantics(gpu=gpu):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().sum().backward()
    assert out.transpose(1, 2).is_contiguous()


SAVED_CASES = [("cudnn", H100, True), ("flash", A100, False), ("efficient", A100, True), ("math", T4, False)]


@pytest.mark.parametrize("backend, gpu, mask", SAVED_CASES, ids=[c[0] for c in SAVED_CASES])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_saved_bytes_per_backend_match_the_trace(backend, gpu, mask, dropout):
    """The per-backend saved-bytes forecast (:func:`saved_bytes`, what the numbers route adds) equals what the
    trace saves for the call, each backend reached by the rule on its target GPU."""
    b, h, length, d = 2, 4, 40, 64
    q, k, v = qkv((b, h, length, d))
    attn_mask = torch.ones(length, length, dtype=torch.bool).tril() if mask else None
    choice = choose_sdpa(q, k, v, attn_mask, dropout, not mask, gpu=gpu)
    assert choice.backend == backend
    _, saved = _saved_by_sdpa("auto", q, k, v, gpu=gpu, attn_mask=attn_mask, dropout_p=dropout, is_causal=not mask)
    call = SdpaCall.from_tensors(q, k, v, attn_mask, dropout, not mask)
    assert saved.nbytes == saved_bytes(backend, call)
    big = sorted(t.nbytes for t in saved_for_backward(backend, call) if t.nbytes > 64)
    assert big == sorted(n for n, _, _ in saved.bases.values() if n > 64)  # tensor by tensor, RNG scalars aside


def test_pre_ampere_bf16_saves_the_full_score_matrix():
    """bf16 on a T4 (SM 7.5): no flash, no bf16 efficient kernel, so the math kernel runs and autograd keeps the
    float32 B·H·L·S probabilities; on an A100 the same call saves no [L, S] tensor at all."""
    b, h, length, d = 2, 4, 64, 32
    q, k, v = qkv((b, h, length, d))
    _, t4 = _saved_by_sdpa("auto", q, k, v, gpu=T4, is_causal=True, dropout_p=0.1)
    _, a100 = _saved_by_sdpa("auto", q, k, v, gpu=A100, is_causal=True, dropout_p=0.1)
    scores = [t for t in t4.tensors if t[0] == (b, h, length, length)]
    assert ((b, h, length, length), FP32, "cpu") in scores and ((b, h, length, length), torch.bool, "cpu") in scores
    assert not [t for t in a100.tensors if t[0][-2:] == (length, length)]
    call = SdpaCall.from_tensors(q, k, v, None, 0.1, True)
    assert t4.nbytes == saved_bytes("math", call) and a100.nbytes == saved_bytes("flash", call)
    assert t4.nbytes - a100.nbytes > b * h * length * length * (4 + 1 + 4)


def test_real_fused_outputs_are_placeholder_zeros():
    q, k, v = qkv((1, 2, 8, 16))
    out, _ = _saved_by_sdpa("flash", q, k, v)
    assert not out.any()


# --- rule 2 under the selective policy: the checkpoint policy sees the fused op --------------------------------------


class _AttentionBlock(torch.nn.Module):
    """q, k, v from one matmul, fused attention, an output projection, a residual."""

    def __init__(self, width: int, heads: int, dropout: float, dtype: torch.dtype):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False, dtype=dtype)
        self.proj = torch.nn.Linear(width, width, bias=False, dtype=dtype)

    def forward(self, x):
        b, length, c = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return x + self.proj(out.transpose(1, 2).reshape(b, length, c))


SEL_B, SEL_L, SEL_C, SEL_H, SEL_LAYERS = 2, 64, 64, 4, 3
SELECTIVE_CASES = [("flash", BF16, A100), ("cudnn", BF16, H100), ("efficient", FP32, A100)]


def _live_after_forward(policy: str, dropout: float, dtype, gpu) -> int:
    """Bytes of the storages a fake forward of a checkpointed stack of attention blocks leaves alive (what the
    blocks keep for backward, plus their outputs); the backward runs too."""
    from lightning_ckpt.core.wrap import apply_policy

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = torch.nn.Sequential(*(_AttentionBlock(SEL_C, SEL_H, dropout, dtype) for _ in range(SEL_LAYERS)))
        apply_policy(model, policy, blocks=_AttentionBlock)
        x = torch.randn(SEL_B, SEL_L, SEL_C, dtype=dtype)
        live = LiveBytes(torch.device("cpu"), gate=torch.is_grad_enabled)
        with cuda_semantics(gpu=gpu):
            with live:
                out = model(x)
            kept = live.live
            out.float().sum().backward()
    return kept


@pytest.mark.parametrize("backend, dtype, gpu", SELECTIVE_CASES, ids=[c[0] for c in SELECTIVE_CASES])
def test_selective_keeps_the_fused_attention_outputs_without_dropout(backend, dtype, gpu):
    """On a GPU the ``selective`` policy sees ``_scaled_dot_product_<backend>_attention`` and keeps its outputs
    (attention output, logsumexp, RNG state) when dropout_p == 0, and recomputes it with dropout; the CUDA trace
    must call the same op. The difference is computed from the shapes the kernel returns."""
    q = torch.empty(SEL_B, SEL_H, SEL_L, SEL_C // SEL_H, dtype=dtype)
    assert choose_sdpa(q, q, q, None, 0.125, True, gpu=gpu).backend == backend
    call = SdpaCall.from_tensors(q, q, q, None, 0.0, True)
    kernel_outputs = sum(t.nbytes for t in saved_for_backward(backend, call)
                         if t.name not in ("query", "key", "value", "attn_bias"))
    no_dropout = _live_after_forward("selective", 0.0, dtype, gpu)
    dropout = _live_after_forward("selective", 0.125, dtype, gpu)
    assert no_dropout - dropout == SEL_LAYERS * kernel_outputs
    # with dropout only the matmuls' outputs are kept: qkv [B·L, 3C] and proj [B·L, C] per block, beyond "all"
    e = torch.finfo(dtype).bits // 8
    assert dropout - _live_after_forward("all", 0.125, dtype, gpu) == SEL_LAYERS * SEL_B * SEL_L * 4 * SEL_C * e


# --- rule 3: cross-entropy ---------------------------------------------------------------------------------------


def test_cross_entropy_saves_the_same_on_both():
    logits = torch.randn(6, 11, dtype=BF16, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    with Saved() as cpu:
        F.cross_entropy(logits.float(), target)
    with cuda_semantics(), Saved() as gpu:
        F.cross_entropy(logits.float(), target)
    # _log_softmax saves its result, nll_loss_forward that result (same storage), target and total_weight
    assert gpu.tensors == cpu.tensors and len(gpu.bases) == 3


# --- rule 5: rms_norm ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_rms_norm_saves_input_weight_and_rstd(fake):
    with tensor_mode(fake):
        x = torch.randn(2, 5, 16, requires_grad=True)
        w = torch.randn(16, requires_grad=True)
        with Saved() as cpu:
            F.rms_norm(x, (16,), w, 1e-6)
        with cuda_semantics():
            with Saved() as gpu:
                y = F.rms_norm(x, (16,), w, 1e-6)
            y.pow(2).sum().backward()  # the backward kernel is the context's too
    assert len(cpu.tensors) > 3  # the CPU decomposes: x, x², x·rstd, ...
    assert gpu.tensors == [((2, 5, 16), FP32, "cpu"), ((16,), FP32, "cpu"), ((2, 5, 1), FP32, "cpu")]


def test_rms_norm_values_and_gradients_are_unchanged():
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    F.rms_norm(x, (16,), w).pow(2).sum().backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with cuda_semantics():
        F.rms_norm(x, (16,), w).pow(2).sum().backward()
    torch.testing.assert_close((x.grad, w.grad), expected)


# --- rule 4: autocast ---------------------------------------------------------------------------------------------


def test_layer_norm_runs_in_float32_under_the_cuda_rule():
    x = torch.randn(4, 16, dtype=BF16, requires_grad=True)
    ln = torch.nn.LayerNorm(16)
    with torch.autocast("cpu", dtype=BF16):
        assert ln(x).dtype == BF16  # CPU autocast leaves layer_norm alone
    with cuda_semantics(autocast_dtype=BF16), torch.autocast("cpu", dtype=BF16), Saved() as saved:
        y = ln(x)
        assert y.dtype == FP32  # CUDA autocast: layer_norm is on the fp32 list
    # native_layer_norm saves the float32 copy of its input (and float32 mean and rstd), not the bf16 input
    assert ((4, 16), FP32, "cpu") in saved.tensors and not saved.of(BF16)
    y.sum().backward()
    assert x.grad.dtype == BF16 and ln.weight.grad.dtype == FP32


def _autocast_cases():
    """(label, function of (x: [4, 16] low precision, w: [16, 16] float32, xf: [4, 16] float32))."""
    return {
        "layer_norm": lambda x, w, xf: F.layer_norm(x, (16,)),
        "rms_norm": lambda x, w, xf: F.rms_norm(x, (16,)),
        "group_norm": lambda x, w, xf: F.group_norm(x, 4),
        "softmax": lambda x, w, xf: torch.softmax(x, -1),
        "softmax with dtype": lambda x, w, xf: torch.softmax(x, -1, dtype=FP16),
        "log_softmax": lambda x, w, xf: F.log_softmax(x, -1),
        "exp": lambda x, w, xf: x.exp(),
        "pow": lambda x, w, xf: x.pow(2),
        "rsqrt": lambda x, w, xf: x.abs().rsqrt(),
        "sum": lambda x, w, xf: x.sum(),
        "sum dim": lambda x, w, xf: x.sum(-1),
        "cumsum": lambda x, w, xf: x.cumsum(0),
        "prod": lambda x, w, xf: x.prod(),
        "norm": lambda x, w, xf: torch.norm(x),
        "logsumexp": lambda x, w, xf: x.logsumexp(-1),
        "linear": lambda x, w, xf: F.linear(xf, w),
        "matmul": lambda x, w, xf: xf @ w,
        "bmm": lambda x, w, xf: torch.bmm(xf[None], w[None]),
        "baddbmm": lambda x, w, xf: torch.baddbmm(xf[None], xf[None], w[None]),
        "addmm": lambda x, w, xf: torch.addmm(xf, xf, w),
        "einsum": lambda x, w, xf: torch.einsum("ij,jk->ik", xf, w),
        "mv": lambda x, w, xf: torch.mv(w, xf[0]),
        "addmm_activation": lambda x, w, xf: torch._addmm_activation(xf, xf, w),
        "addcmul": lambda x, w, xf: torch.addcmul(xf, x, x),
        "cat": lambda x, w, xf: torch.cat([x, xf]),
        "cross_entropy": lambda x, w, xf: F.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=x.device)),
        "mse_loss": lambda x, w, xf: F.mse_loss(x, xf),
        "gelu": lambda x, w, xf: F.gelu(x),
        "sdpa": lambda x, w, xf: F.scaled_dot_product_attention(xf[None, None], xf[None, None], xf[None, None]),
    }


@pytest.mark.skipif(not fake_cuda_available(), reason="this torch build cannot make fake CUDA tensors")
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", list(_autocast_cases()))
def test_autocast_matches_pytorchs_cuda_autocast(case, dtype):
    """Ground truth: PyTorch's AutocastCUDA kernels, run on fake CUDA tensors."""
    fn = _autocast_cases()[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = (torch.randn(4, 16, dtype=dtype), torch.randn(16, 16), torch.randn(4, 16))
        with fake_cuda_autocast(dtype):
            expected = fn(*(a.to("cuda") for a in args)).dtype
        with cuda_semantics(autocast_dtype=dtype), torch.autocast("cpu", dtype=dtype):
            got = fn(*args).dtype
    assert got == expected


def test_autocast_cpu_policy_differs_without_the_context():
    """The cases above can fail: plain CPU autocast disagrees with CUDA on these."""
    x, w, xf = torch.randn(4, 16, dtype=BF16), torch.randn(16, 16), torch.randn(4, 16)
    cases = _autocast_cases()
    with torch.autocast("cpu", dtype=BF16):
        got = {name: cases[name](x, w, xf).dtype for name in ("layer_norm", "softmax", "exp", "addmm_activation")}
    assert got == {"layer_norm": BF16, "softmax": BF16, "exp": BF16, "addmm_activation": BF16}


def test_autocast_tables_cover_every_cuda_autocast_kernel():
    """A PyTorch upgrade that adds an op to the CUDA lists fails here: copy the new AT_FORALL_* entries from
    aten/src/ATen/autocast_mode.h into lightning_ckpt/forecast/cuda.py."""
    cuda_ops = cuda._registered("AutocastCUDA")
    missing = cuda_ops - set(cuda._policy_names()) - cuda._CUDA_NOT_MIRRORED
    assert not missing


def test_autocast_backward_runs_on_fake_tensors():
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(4, 16, requires_grad=True)
        ln, lin = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)
        with cuda_semantics(autocast_dtype=BF16):
            with torch.autocast("cpu", dtype=BF16):
                y = torch.softmax(lin(ln(x)), -1)
            assert y.dtype == FP32
            y.sum().backward()
    assert x.grad.dtype == FP32 and lin.weight.grad.shape == (16, 16)


# --- restoring PyTorch -------------------------------------------------------------------------------------------


def _dispatcher_state():
    ops = ("aten::dropout", "aten::scaled_dot_product_attention", "aten::_fused_rms_norm", "aten::layer_norm",
           "aten::softmax.int", "aten::cat")
    return ({op: torch._C._dispatch_dump(op) for op in ops},
            sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")),
            sorted(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
            F.dropout, F.scaled_dot_product_attention)


def _cpu_behaviour():
    x = torch.randn(4, 8, requires_grad=True)
    with Saved() as saved:
        F.dropout(x, 0.5, True)
        F.rms_norm(x, (8,))
    with torch.autocast("cpu", dtype=BF16):
        ln = F.layer_norm(x.bfloat16(), (8,)).dtype
    return [t[1] for t in saved.tensors], ln


@pytest.mark.parametrize("fail", [False, True], ids=["exit", "exception"])
def test_everything_is_restored(fail):
    before, behaviour = _dispatcher_state(), _cpu_behaviour()
    with contextlib.suppress(RuntimeError):
        with cuda_semantics(autocast_dtype=BF16):
            assert _dispatcher_state() != before
            assert _cpu_behaviour() != behaviour
            if fail:
                raise RuntimeError("boom")
    assert _dispatcher_state() == before
    assert _cpu_behaviour() == behaviour


def test_nested_contexts_restore_in_order():
    x = torch.randn(4, 8, dtype=BF16)
    with cuda_semantics(autocast_dtype=BF16):
        with cuda_semantics("math", autocast_dtype=BF16):
            pass
        with torch.autocast("cpu", dtype=BF16):
            assert F.layer_norm(x, (8,)).dtype == FP32  # the outer context's kernels are back
    with torch.autocast("cpu", dtype=BF16):
        assert F.layer_norm(x, (8,)).dtype == BF16


# --- end to end: a GPT-2 layer --------------------------------------------------------------------------------------

B, T, C, HEADS = 2, 40, 64, 4  # T not a multiple of 32: the efficient kernel's logsumexp padding shows
D, N = C // HEADS, B * T  # head dim; tokens


def _layer_bytes_by_hand(attention: str, e: int, cache: bool) -> int:
    """Bytes a GPT-2 block saves for backward on CUDA (activations only: parameters excluded), summed over the
    tensors each op saves; ``e`` is the element size of the activations, ``cache`` whether the model runs with a
    ``DynamicCache`` (``use_cache=True``).

    LayerNorm statistics take the activation dtype here: that is what PyTorch's CPU layer_norm and its fake kernel
    give, and what the trace counts; CUDA keeps them in float32 (a documented gap of 2 × N × 2 bytes per LayerNorm
    in bf16).
    """
    layer_norm = N * C * e + 2 * N * e  # native_layer_norm: input [N, C], mean and rstd [N, 1]
    c_attn = N * C * e  # Conv1D = addmm(bias, x.view(-1, C), W): saves x (W is a parameter)
    # GPT2Attention splits the c_attn output qkv [N, 3C] into q, k, v views [B, H, T, D]; with a DynamicCache, k
    # and v are replaced by the cache's copies (torch.cat), each its own [N, C] storage
    qkv = 3 * N * C * e
    kv_copies = 2 * N * C * e if cache else 0
    if attention == "eager":
        # matmul(q, kᵀ) on strided views: bmm saves contiguous copies of q and kᵀ (with a cache, kᵀ is a view of
        # the cache's copy, saved once all the same); softmax saves its result [B, H, T, T]; dropout (CUDA) a bool
        # mask; matmul(probs, v) the dropped probabilities and a copy of v (or the cache's)
        attn = 3 * N * C * e + B * HEADS * T * T * (e + 1 + e)
        attn += N * C * e  # [B, H, T, D] -> transpose -> reshape: a copy [N, C], which c_proj saves
    elif attention in ("efficient", "efficient+mask"):
        # the kernel saves q (a view: its base qkv counts whole), k, v, the output [B, H, T, D] laid out
        # [B, T, H, D] (so transpose(1, 2).contiguous() is free and c_proj saves a view of it), log_sumexp
        # [B, H, ceil(T/32)*32] float32, philox seed and offset (int64 scalars)
        attn = qkv + kv_copies + N * C * e + B * HEADS * math.ceil(T / 32) * 32 * 4 + 8 + 8
        if attention == "efficient+mask":
            # Hugging Face's bool mask [B, 1, T, T] made additive in the activation dtype (a new tensor; its
            # strides are multiples of 8, so no padding), expanded to [B, H, T, T]: the base counts
            attn += B * T * T * e
    elif attention in ("cudnn", "cudnn+mask"):
        # the kernel saves q (its base qkv counts whole), k, v, the output in the query's layout ([B, T, H, D]
        # here: empty_like keeps the split view's order, so transpose(1, 2).contiguous() is free), logsumexp
        # [B, H, T, 1] float32, philox seed and offset (int64 scalars)
        attn = qkv + kv_copies + N * C * e + B * HEADS * T * 4 + 8 + 8
        if attention == "cudnn+mask":
            attn += B * T * T * e  # the bool mask [B, 1, T, T] made additive (-65504 / 0), not expanded
    elif attention == "flash":
        # as efficient, with logsumexp [B, H, T] unpadded, rng_state uint64 [2] and unused uint64 []
        attn = qkv + kv_copies + N * C * e + B * HEADS * T * 4 + 16 + 8
    elif attention == "math":
        # PyTorch's math composite in float32 (bf16 q, k, v are upcast): bmm saves copies of q·√s and kᵀ·√s,
        # _safe_softmax its float32 result, dropout a bool mask, bmm the dropped probabilities and a copy of v;
        # the additive mask is added, not saved; the output goes back to the activation dtype and
        # transpose(1, 2).contiguous() copies it for c_proj
        attn = 3 * N * C * 4 + B * HEADS * T * T * (4 + 1 + 4) + N * C * e
    else:
        raise AssertionError(attention)
    resid_dropout = N * C  # bool mask
    mlp = N * C * e + N * 4 * C * e + N * 4 * C * e  # c_fc input, GELU input [N, 4C], c_proj input [N, 4C]
    mlp_dropout = N * C  # bool mask
    return layer_norm + c_attn + attn + resid_dropout + layer_norm + mlp + mlp_dropout


def _traced_layer(implementation: str, dtype, backend: str, cache: bool, context: bool = True, gpu=A100) -> int:
    """Bytes of the storages first saved inside the (only) GPT-2 block during a fake training step."""
    import transformers

    config = transformers.GPT2Config(n_embd=C, n_head=HEADS, n_layer=1, n_positions=T, vocab_size=96,
                                     attn_implementation=implementation, resid_pdrop=0.1, attn_pdrop=0.1,
                                     embd_pdrop=0.1, activation_function="gelu", bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel(config)
        cast_floating(model, dtype)
        model.train()
        ids = torch.randint(0, 96, (B, T))
        block = model.transformer.h[0]
        inside = [False]
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
        saved = Saved(exclude=list(model.parameters()))
        saved.inside = lambda: inside[0]
        semantics = cuda_semantics(backend, gpu=gpu) if context else contextlib.nullcontext()
        with semantics:
            with saved:
                loss = model(ids, labels=ids, use_cache=cache).loss
            loss.backward()  # the context stays active through backward
    return sum(b[0] for b in saved.region.values())


# (attn_implementation, dtype, --sdpa-backend, use_cache, what the derivation expects). Without a cache Hugging Face
# passes SDPA an explicit bool causal mask on fake tensors (masking_utils treats FakeTensor as tracing), so flash is
# out and efficient takes the mask; with a cache it passes is_causal=True and no mask.
E2E = [
    ("eager", FP32, "auto", False, "eager"),
    ("eager", BF16, "auto", False, "eager"),
    ("eager", FP32, "auto", True, "eager"),
    ("sdpa", FP32, "auto", False, "efficient+mask"),
    ("sdpa", BF16, "auto", False, "efficient+mask"),
    ("sdpa", FP32, "auto", True, "efficient"),
    ("sdpa", BF16, "auto", True, "flash"),
    ("sdpa", BF16, "efficient", True, "efficient"),
    ("sdpa", FP32, "math", False, "math"),
    ("sdpa", BF16, "math", False, "math"),
    ("sdpa", BF16, "auto", True, "cudnn", H100),  # torch 2.11 on an H100 takes dropout 0.1 to cuDNN
    ("sdpa", BF16, "auto", False, "cudnn+mask", H100),
    ("sdpa", FP32, "auto", False, "efficient+mask", H100),  # cuDNN attention is 16-bit only
    ("sdpa", BF16, "auto", True, "math", T4),  # bf16 before SM 8.0: the math kernel, the score matrix saved
]
E2E = [row if len(row) == 6 else (*row, A100) for row in E2E]


@pytest.mark.slow
@pytest.mark.parametrize("implementation, dtype, backend, cache, attention, gpu", E2E,
                         ids=[f"{i}-{str(d)[6:]}-{b}-{'cache' if c else 'nocache'}-{g.name}"
                              for i, d, b, c, _, g in E2E])
def test_gpt2_layer_saves_what_the_hand_derivation_says(implementation, dtype, backend, cache, attention, gpu):
    e = torch.finfo(dtype).bits // 8
    assert _traced_layer(implementation, dtype, backend, cache, gpu=gpu) == _layer_bytes_by_hand(attention, e, cache)


def test_gpt2_layer_differs_without_the_context():
    """CPU semantics save the dropout noise in the activation dtype: 4 bytes instead of 1 for each of the
    three masks (attention probabilities, attention residual, MLP residual)."""
    with_context = _traced_layer("eager", FP32, "auto", cache=False)
    without = _traced_layer("eager", FP32, "auto", cache=False, context=False)
    assert without - with_context == (2 * N * C + B * HEADS * T * T) * 3


PLAN_CASES = [("bf16-true", "auto", "flash"), ("bf16-true", "efficient", "efficient"), ("32-true", "auto", "efficient"),
              ("bf16-true", "math", "math")]


@pytest.mark.slow
@pytest.mark.parametrize("precision, backend, attention", PLAN_CASES, ids=[f"{p}-{b}" for p, b, _ in PLAN_CASES])
def test_plan_device_cuda_adds_a_layer_of_the_hand_derived_bytes(precision, backend, attention):
    """End to end through the planner (``forecast_model(device="cuda")``, a training step without a cache, as
    Lightning runs it): one more GPT-2 layer adds exactly the bytes derived by hand above. In training Hugging Face
    passes no mask (is_causal=True; the planner decides the mask as on real tensors), so bf16 runs flash and fp32
    the memory-efficient kernel."""
    from lightning_ckpt.forecast.trace import forecast_model

    def plan(n_layer):
        args = dict(n_layer=n_layer, n_embd=C, n_head=HEADS, n_positions=T, vocab_size=96, dropout=0.1,
                    attn_implementation="sdpa", activation_function="gelu")
        return forecast_model("lightning_ckpt.demos.factories:gpt2_config", args, micro_batch=B, seq_len=T,
                              policies=["none"], precision=precision, device="cuda", sdpa_backend=backend, gpu=A100)

    one_more = plan(3).activations["none"] - plan(2).activations["none"]
    assert one_more == _layer_bytes_by_hand(attention, 2 if precision == "bf16-true" else 4, cache=False)


# --- on the real GPU: the rule against what PyTorch selects ---------------------------------------------------------

_FUSED_OPS = {"_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_flash_attention": "flash",
              "_scaled_dot_product_efficient_attention": "efficient"}


def _ran(fn):
    """The SDPA backend that ran inside ``fn``: the fused aten op a TorchDispatchMode sees, or math (which
    decomposes into bmm/softmax) when none of them ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        out = fn()
    fused = [_FUSED_OPS[n] for n in seen.names if n in _FUSED_OPS]
    return (fused[0] if fused else "math"), out


def _sdpa_inputs(device, dtype, head_dim, mask, b=2, h=8, length=256):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, length, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    elif mask == "float":
        attn_mask = torch.zeros(b, 1, length, length, dtype=dtype, device=device)
    return q, k, v, attn_mask


GPU_CASES = [  # (dtype, head dim, mask, dropout, is_causal)
    (BF16, 64, None, 0.0, True),
    (BF16, 128, "bool", 0.0, False),
    (FP16, 64, None, 0.1, True),     # 2.11: cuDNN takes any dropout; 2.14: only multiples of 1/16
    (BF16, 64, None, 0.125, True),
    (BF16, 256, None, 0.0, True),    # cuDNN's head-dim limit on SM 9.0
    (BF16, 96, "float", 0.0, False),
    (FP32, 64, None, 0.0, True),     # cuDNN and flash are 16-bit only
    (FP32, 6, None, 0.1, False),     # efficient needs multiples of 4 in fp32: the math kernel
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, mask, dropout, causal", GPU_CASES,
                         ids=[f"{str(c[0])[6:]}-d{c[1]}-{c[2]}-p{c[3]}-{'causal' if c[4] else 'full'}"
                              for c in GPU_CASES])
def test_real_cuda_runs_the_backend_the_rule_picks_and_saves_the_forecast_bytes(dtype, head_dim, mask, dropout,
                                                                                 causal):
    """On this GPU (its SM, the cuDNN torch loads, this torch's rules): the aten op PyTorch runs is the rule's
    choice, and the bytes autograd saves (unique storages, every device) are the CPU trace's under
    ``cuda_semantics`` for the same target, within the RNG scalars' 64 bytes."""
    gpu = resolve_gpu()
    q, k, v, attn_mask = _sdpa_inputs("cuda", dtype, head_dim, mask)
    expected = choose_sdpa(q, k, v, attn_mask, dropout, causal, gpu=gpu)
    real: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.nbytes():
            real[(t.device, st.data_ptr())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ran, out = _ran(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout,
                                                               is_causal=causal))
    out.float().sum().backward()  # the chosen backend's backward runs too
    assert ran == expected.backend, f"PyTorch ran {ran} on {gpu.describe()}; the rule said:\n{expected.explain()}"
    cq, ck, cv, cmask = _sdpa_inputs("cpu", dtype, head_dim, mask)
    _, forecast = _saved_by_sdpa("auto", cq, ck, cv, gpu=gpu, attn_mask=cmask, dropout_p=dropout, is_causal=causal)
    assert abs(sum(real.values()) - forecast.nbytes) <= 64, (ran, sum(real.values()), forecast.nbytes)
