"""Which ``scaled_dot_product_attention`` backend PyTorch runs on a given NVIDIA GPU, and what it saves for backward.

On CUDA, ``aten::scaled_dot_product_attention`` (attention.cpp) asks ``select_sdp_backend``
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) for a backend: it walks a *priority order* and returns the
first backend whose ``can_use_*`` checks all pass. This module is that procedure as data, per PyTorch version:
every rule is a :class:`Check` carrying its :class:`Source` (file, function, torch version, the pull request that
made it), so a forecast can say *why* a backend was (not) chosen. :func:`select_backend` decides from numbers
(SM major.minor, cuDNN version, dtype, head dim, dropout, mask, causality, torch version);
:func:`select_for_call` from a :class:`SdpaCall` (built from real or fake tensors by :meth:`SdpaCall.from_tensors`).

The priority order. ``Context.h`` starts it as flash → efficient → math → cuDNN; ``priority_order`` (sdp_utils.cpp)
moves cuDNN first, once per process, when ``check_prefer_cudnn_attention`` holds:

========== ================================================================= ==================================
torch      cuDNN first when                                                   source
========== ================================================================= ==================================
2.9        compile-time cuDNN ≥ 9.9.0 and SM 9.0 or 10.0                      pytorch#162073
2.10–2.12  runtime cuDNN > 9.15.0 (≥ 9.15.1) and SM 9.x/10.x with minor 0     pytorch#171627 (in 2.10 via
           or 3 (SM 9.0, 10.0, 10.3)                                          #171895), #170800 (SM 10.3)
≥ 2.13     as 2.10; CUDA 13 builds drop the minor restriction                 2.13: an analysis of v2.13.0;
                                                                              2.14: main @001f694a; 2.15: its
                                                                              binary (the same constants)
========== ================================================================= ==================================

``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` (2.10+) or ``TORCH_CUDNN_SDPA_PREFERRED=0`` (2.9) turns the preference off; a
priority set with ``torch.nn.attention.sdpa_kernel(..., set_priority=True)`` replaces it (both are honoured).

The checks that matter for a forecast (full lists in :data:`RULES`, read from the 2.11 and the 2.14 source and the
2.15.0 binary):

=========== ======================= ========================================= ==========================================
backend     SM                      dtypes                                    limits
=========== ======================= ========================================= ==========================================
cudnn       8.0 – 12.1              fp16, bf16                                head dim ≤ 128 and a multiple of 8 (256 on
                                                                              SM 9.0, 192/128 on 10.x: see the rules);
                                                                              masks of 2 or 4 dims; no mask gradient;
                                                                              KV length ≠ 1; dropout refused on cuDNN
                                                                              9.11–9.13, and (2.12+) unless a multiple
                                                                              of 1/16; not under deterministic mode;
                                                                              (2.15) before 9.26 on SM 9.0, no
                                                                              non-causal training with KV length
                                                                              64 mod 128
flash       8.0 – 12.1              fp16, bf16                                no mask; q, k, v head dims equal, ≤ 256;
                                                                              is_causal needs L = S; training on SM
                                                                              8.6–8.9/12.x: head dim ≤ 192 (or > 224
                                                                              without dropout); (2.15) batch and
                                                                              heads ≤ 65535
efficient   5.0 – 12.1              fp16, fp32, bf16 on SM ≥ 8.0;             head dims multiples of 8 (16-bit) or 4
                                    fp16, fp32 below                          (fp32; 1 below SM 8.0); any mask; GQA
                                                                              and MQA from 2.14 only
math        any                     any                                       none: PyTorch's composite
=========== ======================= ========================================= ==========================================

So bf16 attention on a pre-Ampere GPU (V100, T4: SM 7.x) runs the math kernel, which saves the full B·H·L·S
attention probabilities in float32 (plus the dropout mask and the dropped copy); fp16 there runs the efficient
kernel. What each backend saves (``derivatives.yaml`` and the ops' meta kernels in ``torch/_meta_registrations.py``):
:func:`saved_for_backward`.

Evidence. "2.14": PyTorch main @001f694a (the newest source read), whose checks' messages the installed torch
2.14.1 binary carries (the 1/16 dropout rule, the d256 backward rule, the 65535 batch limit). "2.11": the upstream
file as it stood between pytorch#171627 (2026-01-02) and pytorch#174245 (2026-02-26), read from a fork that vendors
it; release/2.11 was cut on 2026-02-18 (pytorch#175093). 2.12 and 2.13 are 2.11 plus the changes merged before
their branch cuts (:data:`RULES` names them). "2.15": the torch 2.15.0 binary (libtorch_cuda.so), whose symbol
table names every sdp_utils.cpp check, disassembled against 2.14.1's: the same checks and constants per backend bar
flash's grid-size check (batch and heads ≤ 65535) and cuDNN's SM 9.x rule (cuDNN < 9.26: no non-causal training
with key/value length 64 mod 128); the source was not read. torch < 2.10 uses the 2.11 checks with its own priority
rule, newer than 2.15 the 2.15 rules: both unverified, and the forecast's assumptions name a newer torch
(:data:`NEWER_THAN_READ` adds what its binary is known to check). Unbatched (3-D) q, k, v: 2.11 hands them to the
4-D shape checks as given, so math runs; 2.14 gives them a batch of one first (2.12 and 2.13 taken as 2.11). Not
modelled: nested tensors, FA3/FA4 (opt-in: ``torch.nn.attention.activate_flash_attention_impl``), fp8, ROCm.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from lightning_ckpt.forecast.gpus import format_sm, parse_sm

__all__ = [
    "BACKENDS",
    "NEWER_THAN_READ",
    "RULES",
    "Check",
    "GpuTarget",
    "PreferCudnn",
    "RuleSet",
    "SavedTensor",
    "SdpaCall",
    "SdpaChoice",
    "SdpaFlags",
    "Source",
    "blockers",
    "describe_choices",
    "format_cudnn",
    "parse_cudnn",
    "parse_torch_version",
    "resolve_gpu",
    "rules_for",
    "saved_bytes",
    "saved_for_backward",
    "select_backend",
    "select_for_call",
]

BACKENDS = ("cudnn", "flash", "efficient", "math")
SDP_UTILS = "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
SDP_UTILS_H = "aten/src/ATen/native/transformers/sdp_utils_cpp.h"
CONTEXT_H = "aten/src/ATen/Context.h"
DERIVATIVES = "tools/autograd/derivatives.yaml"
META = "torch/_meta_registrations.py"
ATTENTION_CPP = "aten/src/ATen/native/transformers/attention.cpp"
# torch._C._get_sdp_priority_order() numbers the backends as at::SDPBackend (math 0, flash 1, efficient 2, cudnn 3)
_ENUM = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # Context.h sdp_priority_order
CUDNN_ORDER = ("cudnn", "flash", "efficient", "math")  # sdp_utils.cpp priority_order, when cuDNN is preferred
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Source:
    """Where a rule comes from: ``file:function`` in PyTorch's tree, the torch version read, the PR/issue."""

    function: str
    torch: str
    file: str = SDP_UTILS
    ref: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.function} (torch {self.torch}{'; ' + self.ref if self.ref else ''})"


# --- the inputs: the call and the GPU ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SdpaCall:
    """The properties of one ``scaled_dot_product_attention`` call the backend checks read.

    ``heads``/``q_len``/``head_dim`` are the query's; ``kv_*`` and ``v_*`` default to them. ``mask`` is the
    attention mask's shape (``None``: no mask). ``requires_grad``: whether any of q, k, v requires a gradient (the
    training checks). ``storage_offsets``: of q, k, v, in elements (the efficient kernel's pointer alignment).
    ``unbatched``: q, k, v were 3-D (``dims`` is 3); the other fields describe them with a batch of one, which only
    the rules that batch such input before their checks (torch ≥ 2.14) read.
    """

    dtype: torch.dtype
    head_dim: int = 64
    batch: int = 1
    heads: int = 1
    q_len: int = 128
    kv_len: Optional[int] = None
    kv_heads: Optional[int] = None
    v_heads: Optional[int] = None
    k_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    same_dtype: bool = True
    same_batch: bool = True
    mask: Optional[Tuple[int, ...]] = None
    mask_dtype: Optional[torch.dtype] = None
    mask_requires_grad: bool = False
    mask_last_stride_1: bool = True
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True
    dims: int = 4
    last_dim_stride_1: bool = True
    storage_offsets: Tuple[int, int, int] = (0, 0, 0)
    nested: bool = False
    unbatched: bool = False

    @property
    def lk(self) -> int:
        return self.q_len if self.kv_len is None else self.kv_len

    @property
    def hk(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def hv(self) -> int:
        return self.hk if self.v_heads is None else self.v_heads

    @property
    def dk(self) -> int:
        return self.head_dim if self.k_head_dim is None else self.k_head_dim

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @classmethod
    def from_tensors(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                     enable_gqa: bool = False) -> "SdpaCall":
        """The call's properties, read from its tensors (real or fake). 3-D q, k, v are described with a batch of
        one (as ``normalize_unbatched_input``, sdp_utils_cpp.h, makes them) and marked ``unbatched``: whether a
        fused backend takes them is the rules' decision."""
        q, k, v, mask = query, key, value, attn_mask
        unbatched = q.dim() == k.dim() == v.dim() == 3
        if unbatched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
            mask = mask.unsqueeze(0) if mask is not None and mask.dim() == 3 else mask
        nested = any(t.is_nested for t in (q, k, v))
        if nested or not q.dim() == k.dim() == v.dim() == 4:
            return cls(dtype=q.dtype, dims=q.dim() if not nested else 4, nested=nested, dropout=dropout_p,
                       is_causal=is_causal, enable_gqa=enable_gqa)
        return cls(
            dtype=q.dtype, head_dim=q.size(-1), batch=q.size(0), heads=q.size(1), q_len=q.size(2),
            kv_len=k.size(2), kv_heads=k.size(1), v_heads=v.size(1), k_head_dim=k.size(-1),
            v_head_dim=v.size(-1), same_dtype=q.dtype == k.dtype == v.dtype,
            same_batch=q.size(0) == k.size(0) == v.size(0),
            mask=None if mask is None else tuple(mask.shape), mask_dtype=None if mask is None else mask.dtype,
            mask_requires_grad=mask is not None and mask.requires_grad,
            mask_last_stride_1=mask is None or mask.dim() == 0 or mask.stride(-1) == 1,
            dropout=float(dropout_p), is_causal=bool(is_causal), enable_gqa=bool(enable_gqa),
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
            last_dim_stride_1=all(t.stride(-1) == 1 for t in (q, k, v)),
            storage_offsets=(q.storage_offset(), k.storage_offset(), v.storage_offset()),
            dims=3 if unbatched else 4, unbatched=unbatched,
        )


def parse_cudnn(value) -> int:
    """A cuDNN version as ``torch.backends.cudnn.version()`` reports it: ``"9.15.1"`` → 91501, ``"8.9.7"`` → 8907,
    ``91900`` → 91900 (cuDNN 9 numbers versions major·10000 + minor·100 + patch, cuDNN 8 major·1000 + ...)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1000:
        return value
    text = str(value).strip()
    if text.isdigit() and len(text) >= 4:
        return int(text)
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"--cudnn={value!r} is not a cuDNN version; pass e.g. 9.15.1, 9.19 or 91900 (what "
                         "torch.backends.cudnn.version() prints on the target).")
    major, minor, patch = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


def format_cudnn(version: int) -> str:
    base = 10000 if version >= 90000 else 1000
    return f"{version // base}.{version % base // 100}.{version % 100}"


def parse_torch_version(value) -> Tuple[int, int]:
    """``"2.11.0+cu128"`` / ``"2.11"`` → (2, 11)."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(value))
    if not m:
        raise ValueError(f"--torch-version={value!r} is not a torch version; pass e.g. 2.11 or 2.11.0+cu128.")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class GpuTarget:
    """The GPU and software a forecast is for: SM (major, minor), the runtime cuDNN version (torch's integer), the
    torch version whose rules apply and the CUDA version torch was built with (``None``: unknown; only the ≥ 2.13
    priority rule reads it, on SM 9.x/10.x minors other than 0 and 3). ``assumptions`` say what was not given."""

    sm: Tuple[int, int]
    cudnn: int
    torch_version: Tuple[int, int]
    cuda: Optional[Tuple[int, int]] = None
    name: Optional[str] = None
    assumptions: Tuple[str, ...] = ()

    def describe(self) -> str:
        gpu = f"{self.name} ({format_sm(self.sm)})" if self.name else format_sm(self.sm)
        version = f"{self.torch_version[0]}.{self.torch_version[1]}"
        rules = rules_for(self.torch_version).name
        return f"{gpu}, cuDNN {format_cudnn(self.cudnn)}, torch {version}" + (
            "" if rules == version else f" (the {rules} rules)")


# The cuDNN the forecast assumes when none is given and none is loaded here: the oldest cuDNN with which PyTorch
# 2.10+ prefers cuDNN attention (check_prefer_cudnn_attention: cudnn_version > 91500)
ASSUMED_CUDNN = 91501


def resolve_gpu(sm: Optional[str] = None, cudnn=None, torch_version=None, cuda=None) -> GpuTarget:
    """A :class:`GpuTarget` from what the user gave; what was not given is filled in and said in ``assumptions``.

    Args:
        sm: ``--sm``: an SM version or a GPU name (:func:`lightning_ckpt.forecast.gpus.parse_sm`). ``None``: this
            machine's GPU when it has one, else an H100 (SM 9.0).
        cudnn: the target's runtime cuDNN (``"9.19.0"``, 91900). ``None``: the cuDNN this machine's torch loads
            (``torch.backends.cudnn.version()``), else 9.15.1.
        torch_version: the torch the target runs (``"2.11"``); ``None``: the installed one.
        cuda: the CUDA version that torch was built with (``"12.8"``); ``None``: the installed torch's when the
            versions match, else unknown.
    """
    notes: List[str] = []
    local = tuple(parse_torch_version(torch.__version__))
    target_torch = local if torch_version is None else parse_torch_version(torch_version)
    name = None
    if sm is not None:
        cap, name = parse_sm(sm)
    elif torch.cuda.is_available():
        cap, name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
        notes.append(f"no --sm given: this machine's GPU, {name} ({format_sm(cap)})")
    else:
        cap, name = (9, 0), "H100"
        notes.append("no --sm given: assumed an H100 (SM 9.0); pass --sm with the target's SM or GPU name")
    if cudnn is not None:
        version = parse_cudnn(cudnn)
    else:
        loaded = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        version = loaded or ASSUMED_CUDNN
        where = (f"the cuDNN this machine's torch {torch.__version__} loads" if loaded else
                 "new enough for PyTorch to prefer cuDNN attention (> 9.15.0)")
        notes.append(f"no --cudnn given: assumed cuDNN {format_cudnn(version)}, {where}; pass --cudnn with "
                     "torch.backends.cudnn.version() of the target")
    notes += _newer_than_read(tuple(target_torch))
    build = None
    if cuda is not None:
        build = parse_torch_version(cuda)
    elif target_torch == local and torch.version.cuda:
        build = parse_torch_version(torch.version.cuda)
    return GpuTarget(sm=tuple(cap), cudnn=version, torch_version=target_torch, cuda=build, name=name,
                     assumptions=tuple(notes))


@dataclass(frozen=True)
class SdpaFlags:
    """The switches PyTorch reads at call time: ``torch.backends.cuda.enable_*_sdp`` (and ``sdpa_kernel``), the
    priority order ``sdpa_kernel(..., set_priority=True)`` sets, deterministic mode, the math kernel's reduced
    precision and the cuDNN-preference environment variables."""

    flash: bool = True
    efficient: bool = True
    cudnn: bool = True
    math: bool = True
    order: Optional[Tuple[str, ...]] = None  # a user-set priority; None: PyTorch's own (with the cuDNN rule)
    deterministic: bool = False  # deterministic algorithms on, not warn-only: cuDNN refuses
    fp16_bf16_reduction_math: bool = False
    env_off: FrozenSet[str] = frozenset()  # the preference-disabling environment settings present

    @classmethod
    def current(cls) -> "SdpaFlags":
        b = torch.backends.cuda
        order = None
        getter = getattr(torch._C, "_get_sdp_priority_order", None)
        if getter is not None:
            names = tuple(_ENUM[i] for i in getter() if i in _ENUM)
            # PyTorch's default, or the cuDNN order its own rule installed once an SDPA call ran on this machine
            order = None if names in (DEFAULT_ORDER, CUDNN_ORDER) else names
        reduction = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", None)
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        return cls(flash=b.flash_sdp_enabled(), efficient=b.mem_efficient_sdp_enabled(),
                   cudnn=getattr(b, "cudnn_sdp_enabled", lambda: True)(), math=b.math_sdp_enabled(), order=order,
                   deterministic=torch.are_deterministic_algorithms_enabled() and not warn_only,
                   fp16_bf16_reduction_math=bool(reduction()) if reduction else False, env_off=_env_off())


def _env_off() -> FrozenSet[str]:
    """c10::utils::check_env reads 1/ON/YES/TRUE/Y as true and 0/OFF/NO/FALSE/N as false."""
    def value(name):
        v = os.environ.get(name, "").upper()
        return True if v in ("1", "ON", "YES", "TRUE", "Y") else False if v in ("0", "OFF", "NO", "FALSE", "N") \
            else None
    off = set()
    if value("TORCH_CUDNN_SDPA_DEPRIORITIZED") is True:
        off.add("TORCH_CUDNN_SDPA_DEPRIORITIZED=1")
    if value("TORCH_CUDNN_SDPA_PREFERRED") is False:
        off.add("TORCH_CUDNN_SDPA_PREFERRED=0")
    return frozenset(off)


# --- the rules -----------------------------------------------------------------------------------------------------

Rule = Callable[[SdpaCall, GpuTarget, SdpaFlags], Optional[str]]


@dataclass(frozen=True)
class Check:
    """One ``check_*`` of ``can_use_<backend>``: ``rule(call, gpu, flags)`` returns why the backend cannot run the
    call, or ``None``."""

    name: str
    rule: Rule
    source: Source


@dataclass(frozen=True)
class PreferCudnn:
    """``check_prefer_cudnn_attention``: cuDNN goes first when the cuDNN version is above ``cudnn_above`` and the
    SM major is in ``majors`` and (unless ``None``) the minor in ``minors``; ``minors_below_cuda`` set: the minor
    rule applies only to builds with CUDA below that major (CUDA 13 builds take every minor)."""

    cudnn_above: int
    majors: FrozenSet[int]
    minors: Optional[FrozenSet[int]]
    source: Source
    minors_below_cuda: Optional[int] = None
    env: str = "TORCH_CUDNN_SDPA_DEPRIORITIZED=1"

    def reason(self, gpu: GpuTarget, flags: SdpaFlags) -> Optional[str]:
        """Why cuDNN is *not* moved first (``None``: it is)."""
        if self.env in flags.env_off:
            return f"{self.env} is set"
        if gpu.cudnn <= self.cudnn_above:
            return f"cuDNN {format_cudnn(gpu.cudnn)} is older than {format_cudnn(self.cudnn_above + 1)}"
        if gpu.sm[0] not in self.majors:
            return f"{format_sm(gpu.sm)} is not SM {'/'.join(f'{m}.x' for m in sorted(self.majors))}"
        minors_apply = self.minors is not None and (
            self.minors_below_cuda is None or gpu.cuda is None or gpu.cuda[0] < self.minors_below_cuda)
        if minors_apply and gpu.sm[1] not in self.minors:
            return (f"{format_sm(gpu.sm)}: only minor {' or '.join(map(str, sorted(self.minors)))}"
                    + (" on CUDA < 13 builds" if self.minors_below_cuda else ""))
        return None


@dataclass(frozen=True)
class RuleSet:
    """The rules of one PyTorch version range (``since`` ≤ torch): the cuDNN preference and each backend's checks."""

    name: str
    since: Tuple[int, int]
    prefer: Optional[PreferCudnn]
    checks: Dict[str, Tuple[Check, ...]]
    evidence: str


def _sm_in(gpu: GpuTarget, low: Tuple[int, int], high: Tuple[int, int]) -> bool:
    return low <= tuple(gpu.sm) <= high  # check_sm_version: inclusive on both ends, lexicographic (major, minor)


def _alignment(call: SdpaCall, gpu: GpuTarget) -> int:
    """``minimum_gemm_alignment``: tensor cores from SM 8.0 (SM 7.x for 16-bit) want 128-bit operands."""
    half = call.dtype in _HALF
    tensor_cores = gpu.sm[0] >= 8 or (gpu.sm[0] >= 7 and half)
    alignment = 4 if gpu.sm[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _dtypes(allowed: Tuple[torch.dtype, ...], what: str) -> Rule:
    def rule(call, gpu, flags):
        if call.same_dtype and call.dtype in allowed:
            return None
        return (f"{what} needs q, k, v in {' or '.join(str(d)[6:] for d in allowed)}" +
                ("" if call.same_dtype else " (all three alike)") + f", got {str(call.dtype)[6:]}")
    return rule


def _hardware(low: Tuple[int, int], high: Tuple[int, int], what: str) -> Rule:
    def rule(call, gpu, flags):
        if _sm_in(gpu, low, high):
            return None
        return f"{what} runs on SM {low[0]}.{low[1]} to {high[0]}.{high[1]}, not {format_sm(gpu.sm)}"
    return rule


def _four_d(call, gpu, flags):
    if call.nested:
        return "nested tensors are not modelled"
    return None if call.dims == 4 else f"q, k, v must be 4-D (got {call.dims}-D)"


def _four_d_after_batching(call, gpu, flags):
    """``check_tensor_shapes`` on input that ``normalize_unbatched_input`` has given a batch of one."""
    return None if call.unbatched else _four_d(call, gpu, flags)


def _nonzero(call, gpu, flags):
    return None if call.q_len and call.lk else "zero sequence length"


def _last_stride(ignore_singleton: bool) -> Rule:
    def rule(call, gpu, flags):
        if call.last_dim_stride_1 or (ignore_singleton and call.head_dim == 1):
            return None
        return "the last dimension of q, k, v must have stride 1"
    return rule


def _mask_stride(call, gpu, flags):
    return None if call.mask is None or call.mask_last_stride_1 else "the mask's last dimension must have stride 1"


def _heads(supports_gqa: bool, same_kv_heads: bool, supports_mqa: bool) -> Rule:
    """``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads, supports_mqa>``."""

    def rule(call, gpu, flags):
        hq, hk, hv = call.heads, call.hk, call.hv
        if not call.same_batch:
            return "q, k, v must have the same batch size"
        if call.enable_gqa and supports_gqa:
            if same_kv_heads and hk != hv:
                return f"GQA needs k and v with equal heads (got {hk}, {hv})"
            if hq % hk or (not same_kv_heads and hq % hv):
                return f"GQA needs k/v heads dividing q's (got {hq}, {hk}, {hv})"
            return None
        if hq == hk == hv:
            return None
        if supports_mqa and hq > 0 and hk == hv == 1:
            return None
        gqa = "" if supports_gqa else " (this backend has no GQA)"
        return f"q, k, v must have the same number of heads (got {hq}, {hk}, {hv}){gqa}"
    return rule


def _disabled(flag: str, what: str) -> Rule:
    def rule(call, gpu, flags):
        return None if getattr(flags, flag) else f"{what} disabled (torch.backends.cuda / sdpa_kernel)"
    return rule


# flash -----------------------------------------------------------------------------------------------------------


def _flash_no_mask(call, gpu, flags):
    return None if call.mask is None else "flash takes no attn_mask (is_causal=True is fine)"


def _flash_head_dim(call, gpu, flags):
    d = (call.head_dim, call.dk, call.dv)
    return None if d[0] == d[1] == d[2] and d[0] <= 256 else f"q, k, v head dims must be equal and ≤ 256 (got {d})"


def _flash_sm86_89_120(call, gpu, flags):
    """``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``: the backward kernel lacks these."""
    if not call.requires_grad or not (_sm_in(gpu, (8, 6), (8, 9)) or _sm_in(gpu, (12, 0), (12, 1))):
        return None
    d = call.head_dim
    if d <= 192 or (call.dropout == 0 and d > 224):
        return None
    return f"training on {format_sm(gpu.sm)} with head dim {d} (192 < d ≤ 224, or > 224 with dropout)"


def _flash_grid(call, gpu, flags):
    """``check_flash_attention_grid_size`` (2.15): the kernel's grid holds the batch and the query heads, each at
    most 65535."""
    if call.batch > 65535 or call.heads > 65535:
        return f"batch {call.batch} or heads {call.heads} above 65535"
    return None


def _flash_causal(call, gpu, flags):
    if call.is_causal and call.q_len != call.lk:
        return f"is_causal with query length {call.q_len} ≠ key length {call.lk}"
    return None


# efficient -------------------------------------------------------------------------------------------------------


def _efficient_head_dim(call, gpu, flags):
    a = _alignment(call, gpu)
    if call.head_dim == call.dk and call.head_dim % a == 0 and call.head_dim > 0 and call.dv % a == 0 and call.dv:
        return None
    return f"head dims must match for q, k and be multiples of {a} for q, v (got {call.head_dim}, {call.dk}, {call.dv})"


def _efficient_pointer_alignment(call, gpu, flags):
    """``check_data_ptr_alignment_mem_efficient``: from SM 8.0 the CUTLASS kernels need aligned q, k, v pointers;
    the caching allocator aligns bases to 256 bytes, so the storage offsets decide."""
    if gpu.sm[0] < 8:
        return None
    a = _alignment(call, gpu)
    if all(off % a == 0 for off in call.storage_offsets):
        return None
    return f"q, k, v storage offsets must be multiples of {a} elements"


# cuDNN -----------------------------------------------------------------------------------------------------------


def _cudnn_built(call, gpu, flags):
    return None if gpu.cudnn >= 90000 else f"cuDNN attention needs cuDNN ≥ 9.0.0 (got {format_cudnn(gpu.cudnn)})"


def _cudnn_dropout_9_11_to_9_13(call, gpu, flags):
    if call.dropout > 0 and 91100 < gpu.cudnn < 91400:
        return f"dropout is refused on cuDNN 9.11–9.13 (got {format_cudnn(gpu.cudnn)})"
    return None


def _cudnn_deterministic(call, gpu, flags):
    return "cuDNN attention is not deterministic (torch.use_deterministic_algorithms)" if flags.deterministic else None


def _cudnn_mask_shape(call, gpu, flags):
    """``check_attn_mask_shape`` (sdp_utils_cpp.h): 2-D or 4-D, each dim the call's or 1, no gradient."""
    if call.mask is None:
        return None
    if call.mask_requires_grad:
        return "the mask requires grad"
    m = call.mask
    bad = f"mask shape {m} is not [L, S] or [B|1, H|1, L|1, S|1]"
    if len(m) < 2 or m[-2] not in (call.q_len, 1) or m[-1] not in (call.lk, 1):
        return bad
    if len(m) == 2 or (len(m) == 4 and m[0] in (1, call.batch) and m[1] in (1, call.heads)):
        return None
    return bad


def _cudnn_dropout_sixteenths(call, gpu, flags):
    if call.dropout * 16.0 == math.floor(call.dropout * 16.0):
        return None
    return f"dropout {call.dropout} is not a multiple of 1/16 (cuDNN's dropout resolution)"


def _cudnn_common_shapes(call, gpu, flags, limit: int) -> Optional[str]:
    """The version- and length-checks both versions of ``check_cudnn_tensor_shapes`` share, given the head-dim
    limit."""
    v = gpu.cudnn
    dq, dv, sq, sk, drop = call.head_dim, call.dv, call.q_len, call.lk, call.dropout != 0
    if v < 8903:
        return "SDPA needs cuDNN ≥ 8.9.3"
    if v < 8906 and drop:
        return "dropout needs cuDNN ≥ 8.9.6"
    if dq > limit or dv > limit:
        return f"head dim ({dq}, {dv}) above {limit} on {format_sm(gpu.sm)} with cuDNN {format_cudnn(v)}"
    if dq % 8 or dv % 8:
        return f"head dims ({dq}, {dv}) must be multiples of 8"
    if v < 8906 and sk % 64:
        return "KV length not a multiple of 64 needs cuDNN ≥ 8.9.6"
    if v < 90000 and (sq < 64 or (drop and (sq % 64 or sk % 64))):
        return "short or unaligned lengths need cuDNN ≥ 9.0.0"
    if sk == 1:
        return "KV sequence length 1"
    if sq == 1 and drop:
        return "query length 1 with dropout"
    return None


def _cudnn_shapes_211(call, gpu, flags):
    """``check_cudnn_tensor_shapes`` (2.11): head dim ≤ 128; ≤ 256 on SM 9.0 with cuDNN ≥ 9.10; 192 (q, k) / 128
    (v) on SM 10.x with cuDNN ≥ 9.11."""
    limit = 128
    if gpu.cudnn >= 91000 and tuple(gpu.sm) == (9, 0):
        limit = 256
    if gpu.cudnn >= 91100 and gpu.sm[0] == 10 and call.head_dim == 192 and call.dv == 128:
        limit = 192
    return _cudnn_common_shapes(call, gpu, flags, limit)


def _supports_d256(gpu: GpuTarget) -> bool:
    """2.14: d = 256 on SM 9.0/10.x with cuDNN > 9.22 (and a cuDNN frontend ≥ 1.24 in the build, assumed), not on
    SM 10.7 before cuDNN 9.25.1."""
    sm90_10x = tuple(gpu.sm) == (9, 0) or gpu.sm[0] == 10
    sm107_old = tuple(gpu.sm) == (10, 7) and gpu.cudnn <= 92500
    return sm90_10x and not sm107_old and gpu.cudnn > 92200


def _cudnn_decode_disabled(call, gpu: GpuTarget) -> bool:
    """2.14's ``check_cudnn_tensor_shapes``: "cuDNN SDPA decode is disabled on SM 10.x and 11.x for cuDNN versions
    9.19-9.25.0 (except 9.24.1)" (the message in the 2.14.1 binary). Checked before the 8.9.x version checks in
    the source; it needs cuDNN ≥ 9.19, so they never both refuse."""
    return call.q_len == 1 and gpu.sm[0] in (10, 11) and 91900 <= gpu.cudnn <= 92500 and gpu.cudnn != 92401


def _cudnn_sm90_kv64(call, gpu: GpuTarget) -> Optional[str]:
    """2.15's ``check_cudnn_tensor_shapes``: "cuDNN SDPA before version 9.26 can produce non-finite query gradients
    on SM90 for non-causal attention when the key/value sequence length is 64 modulo 128" (the message in the 2.15.0
    binary; there the check reads SM major 9, cuDNN ≤ 9.25.99, ``is_causal`` false, the query's ``requires_grad``
    and ``key.size(2) % 128 == 64``; the forecast's ``requires_grad`` is any of q, k, v under grad mode, the same
    in training)."""
    if (gpu.cudnn < 92600 and gpu.sm[0] == 9 and not call.is_causal and call.requires_grad
            and call.lk % 128 == 64):
        return (f"training without is_causal with key/value length {call.lk} (64 mod 128) on {format_sm(gpu.sm)} "
                f"needs cuDNN ≥ 9.26 (got {format_cudnn(gpu.cudnn)}): older ones give non-finite query gradients")
    return None


def _cudnn_shapes_214(call, gpu, flags, sm90_kv64: bool = False):
    """``check_cudnn_tensor_shapes`` (2.14): batch and heads ≤ 65535; no decode on SM 10.x/11.x with some cuDNN
    versions (:func:`_cudnn_decode_disabled`); head dim ≤ 128, 256 where :func:`_supports_d256`, else 192/128 on
    SM 9.0/10.x with cuDNN ≥ 9.11. ``sm90_kv64`` (2.15): :func:`_cudnn_sm90_kv64` after the cuDNN 8.9 checks."""
    if call.batch > 65535 or call.heads > 65535:
        return f"batch {call.batch} or heads {call.heads} above 65535"
    if sm90_kv64:
        if gpu.cudnn < 8903 or (gpu.cudnn < 8906 and call.dropout != 0):
            return _cudnn_common_shapes(call, gpu, flags, 256)  # the version refusal, as 2.15 checks it first
        refused = _cudnn_sm90_kv64(call, gpu)
        if refused:
            return refused
    if _cudnn_decode_disabled(call, gpu):
        return (f"decode (query length 1) is disabled on {format_sm(gpu.sm)} for cuDNN 9.19–9.25.0 except 9.24.1 "
                f"(got {format_cudnn(gpu.cudnn)})")
    limit = 128
    sm90_10x = tuple(gpu.sm) == (9, 0) or gpu.sm[0] == 10
    if _supports_d256(gpu):
        limit = 256
    elif sm90_10x and gpu.cudnn >= 91100 and call.head_dim == 192 and call.dv == 128:
        limit = 192
    return _cudnn_common_shapes(call, gpu, flags, limit)


def _cudnn_shapes_215(call, gpu, flags):
    """``check_cudnn_tensor_shapes`` (2.15): 2.14's with :func:`_cudnn_sm90_kv64`."""
    return _cudnn_shapes_214(call, gpu, flags, sm90_kv64=True)


def _cudnn_d256_backward(call, gpu, flags):
    """``check_cudnn_d256_bprop_head_dim``: where d = 256 runs forward, backward takes only (≤128, ≤128),
    (192, 128) and (256, 256)."""
    if not call.requires_grad or not _supports_d256(gpu):
        return None
    d = (call.head_dim, call.dv)
    if (d[0] <= 128 and d[1] <= 128) or d in ((192, 128), (256, 256)):
        return None
    return f"backward with head dims {d} on {format_sm(gpu.sm)}"


# --- the rule sets -------------------------------------------------------------------------------------------------

_E211 = "2.11"
_E214 = "2.14"
_REF211 = "upstream between pytorch#171627 and #174245; release/2.11 cut 2026-02-18"
_REF214 = "main @001f694a, as in the 2.14.1 binary"
_E215 = "2.15"
_REF215 = "the 2.15.0 binary (libtorch_cuda.so) disassembled against 2.14.1's; source not read"
# What changed after 2.11, by the release whose branch cut first contains the change (cuts: 2.12 2026-04-15,
# 2.13 2026-06-08, 2.14 2026-08-10); the text of each is read from the "2.14" source.
SIXTEENTHS = "cuDNN dropout in 1/16 steps"  # pytorch#174245, merged 2026-02-26: 2.12
POINTER_ALIGNMENT = "efficient: pointer alignment"  # pytorch#184258, merged 2026-05-18: 2.13
MQA_GQA = "GQA for efficient, MQA broadcast for all"  # pytorch#191085 (2026-07): 2.14
D256 = "cuDNN d = 256 on SM 9.0/10.x, batch ≤ 65535"  # cuDNN frontend 1.24 era (2026-06/07): 2.14
UNBATCHED = "3-D q, k, v batched before the checks"  # read in the 2.14 source; 2.12/2.13 unverified: 2.14
# 2.15: read from the torch 2.15.0 binary (libtorch_cuda.so, whose symbol table names sdp_utils.cpp's functions),
# disassembled against 2.14.1's: each backend's list of checks and their constants. What differs: flash's
# check_flash_attention_grid_size and cuDNN's SM 9.x rule below; FlashAttention-4 checks that apply only after
# torch.nn.attention.activate_flash_attention_impl("FA4") (userEnabledFA4SDP; not modelled); the SM 8.6-8.9/12.x
# training check renamed for SM 12.1 (the 2.14 binary took SM 12.1 already); symbolic-shape rewrites of the
# heads and causal checks (guard_or_false), the same on concrete sizes as far as read.
FLASH_GRID = "flash: batch and heads ≤ 65535"
CUDNN_SM90_KV64 = "cuDNN < 9.26 on SM 9.x: no non-causal training with key/value length 64 mod 128"


def _s(function: str, version: str, file: str = SDP_UTILS, ref: str = "") -> Source:
    return Source(function, version, file, ref or (_REF211 if version == _E211 else _REF214))


def _tensor_shapes(features: FrozenSet[str]) -> Check:
    """2.11's ``_fused_sdp_choice_cuda`` passes 3-D q, k, v to the checks unchanged, and every fused backend's
    ``check_tensor_shapes`` wants 4-D: unbatched input runs math. 2.14 batches it first."""
    if UNBATCHED in features:
        return Check("tensor_shapes", _four_d_after_batching, _s(
            "check_tensor_shapes", _E214, SDP_UTILS_H,
            "after normalize_unbatched_input in _fused_sdp_choice_cuda (cuda/attention.cu); " + _REF214))
    return Check("tensor_shapes", _four_d, _s("check_tensor_shapes", _E211, SDP_UTILS_H,
                                              "3-D q, k, v unbatched: _fused_sdp_choice_cuda passes them as given; "
                                              + _REF211))


def _v(feature: bool) -> str:
    return _E214 if feature else _E211


# in check_last_dim_stride_equals_1_dense of both versions: the 2.11 binary carries its message too ("GPU backends
# require attn_mask's last dimension to have stride 1 while the CPU does not")
_MASK_STRIDE = Check("mask_stride", _mask_stride, _s("check_last_dim_stride_equals_1_dense", _E211, SDP_UTILS_H,
                                                     "its message is in the 2.11.0 binary too"))


def _flash_checks(features: FrozenSet[str]) -> Tuple[Check, ...]:
    v, mqa = _v(MQA_GQA in features), MQA_GQA in features
    checks = [
        Check("runtime_disabled", _disabled("flash", "flash attention"), _s("check_runtime_disabled_flash", _E211,
                                                                             SDP_UTILS_H)),
        _tensor_shapes(features),
        Check("attn_mask", _flash_no_mask, _s("check_for_attn_mask", _E211, SDP_UTILS_H)),
        Check("head_dim", _flash_head_dim, _s("check_head_dim_size_flash", _E211)),
        Check("hardware", _hardware((8, 0), (12, 1), "flash attention"),
              _s("check_flash_attention_hardware_support", _E211)),
        Check("sm86_89_120_training", _flash_sm86_89_120,
              _s("check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120", _E211)),
        Check("causal_lengths", _flash_causal, _s("check_flash_causal_non_square_seqlens", _E211)),
        Check("dtypes", lambda c, g, f: _dtypes(_HALF if g.sm[0] >= 8 else (torch.float16,), "flash")(c, g, f),
              _s("check_dtypes_flash_attention", _E211)),
    ]
    if FLASH_GRID in features:
        checks.append(Check("grid_size", _flash_grid, _s("check_flash_attention_grid_size", _E215, ref=_REF215)))
    checks += [
        # check_batch_size_and_num_heads_dense<true> (GQA); MQA broadcast with pytorch#191085
        Check("heads", _heads(True, True, mqa), _s("check_batch_size_and_num_heads_dense", v, SDP_UTILS_H,
                                                    "pytorch#191085" if mqa else "")),
        Check("nonzero_lengths", _nonzero, _s("check_nonzero_sequence_lengths_dense", _E211, SDP_UTILS_H)),
        Check("last_dim_stride", _last_stride(True), _s("check_last_dim_stride_equals_1_dense", _E211,
                                                        SDP_UTILS_H)),
    ]
    return tuple(checks)


def _efficient_dtypes(call, gpu, flags):
    allowed = (torch.float16, torch.float32, torch.bfloat16) if gpu.sm[0] >= 8 else (torch.float16, torch.float32)
    return _dtypes(allowed, "efficient attention" + ("" if gpu.sm[0] >= 8 else " below SM 8.0"))(call, gpu, flags)


def _efficient_checks(features: FrozenSet[str]) -> Tuple[Check, ...]:
    checks = [
        Check("runtime_disabled", _disabled("efficient", "memory-efficient attention"),
              _s("check_runtime_disabled_mem_efficient", _E211, SDP_UTILS_H)),
        Check("hardware", _hardware((5, 0), (12, 1), "memory-efficient attention"),
              _s("check_mem_efficient_hardware_support", _E211)),
        _tensor_shapes(features),
        Check("head_dim", _efficient_head_dim, _s("check_head_dim_size_mem_efficient", _E211)),
    ]
    if POINTER_ALIGNMENT in features:
        checks.append(Check("pointer_alignment", _efficient_pointer_alignment,
                            _s("check_data_ptr_alignment_mem_efficient", _E214, ref="pytorch#184258")))
    checks += [
        Check("nonzero_lengths", _nonzero, _s("check_nonzero_sequence_lengths_dense", _E211, SDP_UTILS_H)),
        Check("last_dim_stride", _last_stride(False), _s("check_last_dim_stride_equals_1_dense", _E211,
                                                         SDP_UTILS_H)),
    ]
    checks.append(_MASK_STRIDE)
    gqa = MQA_GQA in features
    checks += [
        # 2.11: check_batch_size_and_num_heads_dense<false>: no GQA, no MQA; pytorch#191085: <true, true, true>
        Check("heads", _heads(gqa, True, gqa), _s("check_batch_size_and_num_heads_dense", _v(gqa), SDP_UTILS_H,
                                                   "pytorch#191085" if gqa else "")),
        Check("dtypes", _efficient_dtypes, _s("can_use_mem_efficient_attention (check_tensor_dtype)", _E211)),
    ]
    return tuple(checks)


def _cudnn_dtypes(call, gpu, flags):
    return _dtypes(_HALF if gpu.sm[0] >= 8 else (torch.float16,), "cuDNN attention")(call, gpu, flags)


def _cudnn_checks(features: FrozenSet[str]) -> Tuple[Check, ...]:
    d256, mqa = D256 in features, MQA_GQA in features
    checks = [
        Check("cudnn_9", _cudnn_built, _s("can_use_cudnn_attention (CUDNN_VERSION < 90000)", _E211)),
        Check("dropout_9_11_9_13", _cudnn_dropout_9_11_to_9_13, _s("can_use_cudnn_attention", _E211,
                                                                   ref="pytorch#163903")),
        Check("runtime_disabled", _disabled("cudnn", "cuDNN attention"), _s("check_runtime_disabled_cudnn", _E211)),
        _tensor_shapes(features),
        Check("deterministic", _cudnn_deterministic, _s("check_cudnn_deterministic", _E211)),
        Check("dtypes", _cudnn_dtypes, _s("check_dtypes_low_precision", _E211)),
        Check("attn_mask_shape", _cudnn_mask_shape, _s("check_attn_mask_shape", _E211, SDP_UTILS_H)),
        Check("hardware", _hardware((8, 0), (12, 1), "cuDNN attention"), _s("check_cudnn_hardware_support", _E211)),
    ]
    if SIXTEENTHS in features:
        checks.append(Check("dropout_sixteenths", _cudnn_dropout_sixteenths,
                            _s("check_cudnn_dropout", _E214, ref="pytorch#174245")))
    checks += [
        Check("nonzero_lengths", _nonzero, _s("check_nonzero_sequence_lengths_dense", _E211, SDP_UTILS_H)),
        Check("last_dim_stride", _last_stride(True), _s("check_last_dim_stride_equals_1_dense", _E211,
                                                        SDP_UTILS_H)),
    ]
    checks.append(_MASK_STRIDE)
    checks += [
        # GQA with k and v heads allowed to differ; MQA broadcast with pytorch#191085
        Check("heads", _heads(True, False, mqa), _s("check_batch_size_and_num_heads_dense", _v(mqa), SDP_UTILS_H,
                                                     "pytorch#191085" if mqa else "")),
        Check("tensor_shapes_cudnn", _cudnn_shapes_215 if CUDNN_SM90_KV64 in features else
              _cudnn_shapes_214 if d256 else _cudnn_shapes_211,
              _s("check_cudnn_tensor_shapes", _E215, ref=_REF215) if CUDNN_SM90_KV64 in features else
              _s("check_cudnn_tensor_shapes", _v(d256))),
    ]
    if d256:
        checks.append(Check("d256_backward", _cudnn_d256_backward, _s("check_cudnn_d256_bprop_head_dim", _E214)))
    return tuple(checks)


def _checks(*features: str) -> Dict[str, Tuple[Check, ...]]:
    f = frozenset(features)
    return {"cudnn": _cudnn_checks(f), "flash": _flash_checks(f), "efficient": _efficient_checks(f)}


_CHECKS_211 = _checks()
_PREFER_210 = PreferCudnn(91500, frozenset({9, 10}), frozenset({0, 3}), _s(
    "check_prefer_cudnn_attention", _E211, ref="pytorch#171627 (2.10: #171895), #170800; issue #169849"))
_PREFER_213 = replace(_PREFER_210, minors_below_cuda=13, source=_s(
    "check_prefer_cudnn_attention", _E214, ref="CUDA 13 builds take every minor (in v2.13.0 per an analysis of it)"))

RULES: Tuple[RuleSet, ...] = (
    RuleSet("2.9", (2, 9), PreferCudnn(
        90899, frozenset({9, 10}), frozenset({0}),
        Source("check_prefer_cudnn_attention", "2.9", ref="pytorch#162073: compile-time CUDNN_VERSION >= 90900"),
        env="TORCH_CUDNN_SDPA_PREFERRED=0"), _CHECKS_211,
        "the 2.9 preference (pytorch#162073); checks as 2.11 (unverified for 2.9)"),
    RuleSet("2.10", (2, 10), _PREFER_210, _CHECKS_211, "the 2.11 rules (2.10: unverified beyond pytorch#171895)"),
    RuleSet("2.11", (2, 11), _PREFER_210, _CHECKS_211, _REF211),
    RuleSet("2.12", (2, 12), _PREFER_210, _checks(SIXTEENTHS),
            "2.11 + pytorch#174245 (merged before the 2.12 cut); the rest unverified"),
    RuleSet("2.13", (2, 13), _PREFER_213, _checks(SIXTEENTHS, POINTER_ALIGNMENT),
            "2.12 + pytorch#184258 and the CUDA 13 preference; the rest unverified"),
    RuleSet("2.14", (2, 14), _PREFER_213, _checks(SIXTEENTHS, POINTER_ALIGNMENT, MQA_GQA, D256, UNBATCHED),
            _REF214),
    RuleSet("2.15", (2, 15), _PREFER_213, _checks(SIXTEENTHS, POINTER_ALIGNMENT, MQA_GQA, D256, UNBATCHED,
                                                  FLASH_GRID, CUDNN_SM90_KV64),
            "2.14 + flash's grid-size check and cuDNN's SM 9.x key/value-length rule, read from " + _REF215),
)


# What a torch newer than the newest rules read is known to check beyond them (from the check messages its released
# binary carries and the newest rules' binary does not), added to the note that names it; none known today: 2.15,
# once such a note, has its own rules (read from its binary).
NEWER_THAN_READ: Dict[Tuple[int, int], str] = {}


def _newer_than_read(version: Tuple[int, int]) -> List[str]:
    """The note for a target torch newer than :data:`RULES` covers (empty otherwise)."""
    newest = RULES[-1]
    if version <= newest.since:
        return []
    known = NEWER_THAN_READ.get(version)
    return [f"torch {version[0]}.{version[1]} is newer than torch {newest.name}, the newest these rules were read "
            f"from: the {newest.name} rules apply, unverified" + (f"; {known}" if known else "")]


def rules_for(torch_version: Tuple[int, int]) -> RuleSet:
    """The rule set for a torch version: the newest whose ``since`` is not above it. Torch before 2.9 never
    preferred cuDNN (bar 2.5.0) and gets the 2.9 checks without the preference."""
    version = tuple(torch_version)
    for rules in reversed(RULES):
        if version >= rules.since:
            return rules
    return replace(RULES[0], name=f"{version[0]}.{version[1]}", prefer=None,
                   evidence="torch < 2.9: cuDNN is last in the priority order; checks as 2.11 (unverified)")


# --- the choice ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SdpaChoice:
    """The backend PyTorch would run, the order it tried, and why each earlier backend was refused."""

    backend: str
    order: Tuple[str, ...]
    order_reason: str
    order_source: Source
    rejected: Dict[str, Tuple[Tuple[str, Source], ...]] = field(default_factory=dict)
    rules: str = ""

    @property
    def source(self) -> Source:
        """The rule that decided: the first refusal of the backend before the chosen one in the order, or the
        priority rule when the chosen backend came first."""
        before = [b for b in self.order[:self.order.index(self.backend)] if b in self.rejected]
        return self.rejected[before[-1]][0][1] if before else self.order_source

    def explain(self) -> str:
        lines = [f"{self.backend} (torch {self.rules} rules; order {' → '.join(self.order)}: {self.order_reason})"]
        for backend in self.order[:self.order.index(self.backend)]:
            for reason, source in self.rejected.get(backend, ()):
                lines.append(f"  not {backend}: {reason} [{source}]")
        return "\n".join(lines)


def blockers(backend: str, call: SdpaCall, gpu: GpuTarget, flags: Optional[SdpaFlags] = None
             ) -> List[Tuple[str, Source]]:
    """Every check of ``backend`` that refuses ``call`` on ``gpu`` (empty: the backend can run it)."""
    flags = SdpaFlags.current() if flags is None else flags
    if backend == "math":
        return [] if flags.math else [("math disabled (torch.backends.cuda.enable_math_sdp / sdpa_kernel)",
                                       Source("select_sdp_backend", rules_for(gpu.torch_version).name))]
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not an SDPA backend; choose one of {list(BACKENDS)}.")
    out = []
    for check in rules_for(gpu.torch_version).checks[backend]:
        reason = check.rule(call, gpu, flags)
        if reason:
            out.append((reason, check.source))
            if check.name == "tensor_shapes":
                break  # the later checks index dims 0-3
    return out


def _order(rules: RuleSet, gpu: GpuTarget, flags: SdpaFlags) -> Tuple[Tuple[str, ...], str, Source]:
    if flags.order is not None:
        return (flags.order, "set with sdpa_kernel(..., set_priority=True)",
                Source("sdpa_kernel (set_priority)", rules.name, "torch/nn/attention/__init__.py"))
    if rules.prefer is None:
        return DEFAULT_ORDER, "PyTorch's default", Source("sdp_priority_order", rules.name, CONTEXT_H)
    why_not = rules.prefer.reason(gpu, flags)
    if why_not is None:
        return (CUDNN_ORDER, f"cuDNN first on {format_sm(gpu.sm)} with cuDNN {format_cudnn(gpu.cudnn)}",
                rules.prefer.source)
    return DEFAULT_ORDER, f"cuDNN last: {why_not}", rules.prefer.source


def select_for_call(call: SdpaCall, gpu: GpuTarget, flags: Optional[SdpaFlags] = None) -> SdpaChoice:
    """``select_sdp_backend``: the first backend of the priority order whose checks all pass.

    Raises:
        ValueError: every backend is refused (PyTorch raises "No available kernel"); the message lists why.
    """
    flags = SdpaFlags.current() if flags is None else flags
    rules = rules_for(gpu.torch_version)
    order, reason, source = _order(rules, gpu, flags)
    rejected: Dict[str, Tuple[Tuple[str, Source], ...]] = {}
    for backend in order:
        refused = blockers(backend, call, gpu, flags)
        if not refused:
            return SdpaChoice(backend, order, reason, source, rejected, rules.name)
        rejected[backend] = tuple(refused)
    why = "; ".join(f"{b}: {r[0][0]}" for b, r in rejected.items())
    raise ValueError(f"no SDPA backend can run this call on {gpu.describe()} ({why}); enable the math kernel "
                     "(torch.backends.cuda.enable_math_sdp(True)) or change the call.")


def select_backend(sm, cudnn, dtype: torch.dtype, head_dim: int, dropout: float = 0.0, mask: Optional[str] = None,
                   is_causal: bool = False, torch_version=None, flags: Optional[SdpaFlags] = None,
                   **call) -> SdpaChoice:
    """The backend PyTorch ``torch_version`` runs on a GPU of compute capability ``sm`` (``"9.0"``, ``(9, 0)`` or a
    GPU name) with runtime cuDNN ``cudnn`` (``"9.15.1"``, 91501) for a call in ``dtype`` with this head dim, dropout,
    mask (``None``, ``"bool"`` or ``"float"``, shaped [L, S]) and causality. Further :class:`SdpaCall` fields
    (``q_len``, ``heads``, ``requires_grad``, ...) go in ``call``; ``torch_version`` defaults to the installed
    torch, ``flags`` to PyTorch's defaults (not this process's switches)."""
    cap = tuple(sm) if isinstance(sm, tuple) else parse_sm(str(sm))[0]
    version = parse_torch_version(torch.__version__ if torch_version is None else torch_version)
    gpu = GpuTarget(sm=cap, cudnn=parse_cudnn(cudnn), torch_version=version,
                    cuda=call.pop("cuda", None))
    sdpa = SdpaCall(dtype=dtype, head_dim=head_dim, dropout=dropout, is_causal=is_causal, **call)
    if mask is not None:
        if mask not in ("bool", "float"):
            raise ValueError(f"mask={mask!r}: pass None, 'bool' or 'float'.")
        sdpa = replace(sdpa, mask=(sdpa.q_len, sdpa.lk), mask_dtype=torch.bool if mask == "bool" else dtype)
    return select_for_call(sdpa, gpu, SdpaFlags() if flags is None else flags)


# --- what each backend saves for backward ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTensor:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


SAVED_SOURCES = {
    "flash": Source("_scaled_dot_product_flash_attention", _E214, DERIVATIVES,
                    "logsumexp [B, H, L] fp32, rng_state uint64 [2], unused uint64 []: meta kernel in " + META
                    + "; head dim padded to 8 by " + ATTENTION_CPP),
    "efficient": Source("_scaled_dot_product_efficient_attention", _E214, DERIVATIVES,
                        "log_sumexp [B, H, ceil(L/32)*32] fp32, seed and offset int64 []; bias padded to 8 and "
                        "expanded (preprocess_mask, " + ATTENTION_CPP + ")"),
    "cudnn": Source("_scaled_dot_product_cudnn_attention", _E214, DERIVATIVES,
                    "logsumexp [B, H, L, 1] fp32, philox seed and offset int64 []; bool mask made additive "
                    "(convert_boolean_attn_mask_cudnn, " + ATTENTION_CPP + ")"),
    "math": Source("_scaled_dot_product_attention_math", _E214, ATTENTION_CPP,
                   "fp16/bf16 upcast to fp32 unless allowFP16BF16ReductionMathSDP; softmax, dropout and the two "
                   "bmm save B·H·L·S probabilities"),
}


def saved_for_backward(backend: str, call: SdpaCall, fp16_bf16_reduction_math: bool = False
                       ) -> Tuple[SavedTensor, ...]:
    """The tensors ``backend`` saves for backward for ``call`` (with gradient), by shape and dtype; the source of
    each list is :data:`SAVED_SOURCES`. q, k, v count as their own tensors (a caller's views of one projection share
    a storage, which the trace counts once)."""
    b, h, lq, lk, hk, hv = call.batch, call.heads, call.q_len, call.lk, call.hk, call.hv
    d, dk, dv, dt = call.head_dim, call.dk, call.dv, call.dtype
    mask_dtype = dt if call.mask_dtype in (None, torch.bool) else call.mask_dtype
    if backend == "flash":
        pad = lambda x: x + (-x % 8)  # noqa: E731
        return (SavedTensor("query", (b, h, lq, pad(d)), dt), SavedTensor("key", (b, hk, lk, pad(dk)), dt),
                SavedTensor("value", (b, hv, lk, pad(dv)), dt), SavedTensor("output", (b, h, lq, pad(dv)), dt),
                SavedTensor("logsumexp", (b, h, lq), torch.float32), SavedTensor("rng_state", (2,), torch.uint64),
                SavedTensor("unused", (), torch.uint64))
    if backend == "efficient":
        out = [SavedTensor("query", (b, h, lq, d), dt), SavedTensor("key", (b, hk, lk, dk), dt),
               SavedTensor("value", (b, hv, lk, dv), dt)]
        if call.mask is not None:
            m = call.mask
            out.append(SavedTensor("attn_bias", (*m[:-1], m[-1] + (-m[-1] % 8)) if m[-1] % 8 else m, mask_dtype))
        return (*out, SavedTensor("output", (b, h, lq, dv), dt),
                SavedTensor("log_sumexp", (b, h, math.ceil(lq / 32) * 32), torch.float32),
                SavedTensor("philox_seed", (), torch.int64), SavedTensor("philox_offset", (), torch.int64))
    if backend == "cudnn":
        out = [SavedTensor("attn_bias", call.mask, mask_dtype)] if call.mask is not None else []
        return (*out, SavedTensor("query", (b, h, lq, d), dt), SavedTensor("key", (b, hk, lk, dk), dt),
                SavedTensor("value", (b, hv, lk, dv), dt), SavedTensor("logsumexp", (b, h, lq, 1), torch.float32),
                SavedTensor("output", (b, h, lq, dv), dt), SavedTensor("philox_seed", (), torch.int64),
                SavedTensor("philox_offset", (), torch.int64))
    if backend == "math":
        ct = torch.float32 if dt in _HALF and not fp16_bf16_reduction_math else dt
        kv = h if call.enable_gqa else hk  # pre_process_group_query_attention_input repeats k, v heads
        # matmul saves q·√s and (k·√s)ᵀ; _safe_softmax (its own derivative) its result
        out = [SavedTensor("query_scaled", (b, h, lq, d), ct), SavedTensor("key_scaled_t", (b, kv, dk, lk), ct),
               SavedTensor("attn_probs", (b, h, lq, lk), ct)]
        if call.dropout > 0:
            out += [SavedTensor("dropout_mask", (b, h, lq, lk), torch.bool),
                    SavedTensor("attn_dropped", (b, h, lq, lk), ct)]
        return (*out, SavedTensor("value", (b, kv if call.enable_gqa else hv, lk, dv), ct))
    raise ValueError(f"backend={backend!r} is not an SDPA backend; choose one of {list(BACKENDS)}.")


def saved_bytes(backend: str, call: SdpaCall, fp16_bf16_reduction_math: bool = False) -> int:
    """Bytes :func:`saved_for_backward` lists."""
    return sum(t.nbytes for t in saved_for_backward(backend, call, fp16_bf16_reduction_math))


def describe_choices(choices: Sequence[SdpaChoice]) -> List[str]:
    """One line per distinct decision of a trace: the backend, how many calls, the deciding rule."""
    seen: Dict[Tuple[str, str], int] = {}
    for c in choices:
        key = (c.backend, str(c.source))
        seen[key] = seen.get(key, 0) + 1
    return [f"{backend} for {n} of {len(choices)} traced calls [{source}]" for (backend, source), n in seen.items()]
