"""Make a fake-tensor trace on the CPU save what CUDA autograd would save, on a machine without a GPU.

:mod:`lightning_ckpt.forecast.trace` runs one training step on fake tensors whose device is ``cpu`` and counts
every storage autograd keeps alive. Where PyTorch picks a kernel by device, the CPU picks one that saves other
tensors than the GPU the forecast is for. Inside :func:`cuda_semantics` the CPU picks what CUDA picks. Every
override is a kernel registered in a ``torch.library.Library("aten", "IMPL")`` for the duration of the context, so
it reaches every caller (``nn.Dropout``, ``torch.dropout``, Hugging Face code, C++ composites such as the SDPA math
path), on fake tensors and real ones alike; leaving the context destroys the library and the dispatcher restores
PyTorch's own kernels. Keep the context active over forward *and* backward.

Rules (paths in PyTorch's source tree):

=== ================ ================================ ======================================= ======================
#   Operation        CPU (the plain trace)            CUDA, and how the context makes it      Source
=== ================ ================================ ======================================= ======================
1   dropout          unfused ``input * noise``:       ``native_dropout``: saves a bool mask   aten/src/ATen/native/
    (training,       ``mul`` saves the noise in the   (1 byte per element). ``aten::dropout`` Dropout.cpp (``is_
    0 < p < 1)       input's dtype.                   gets a CompositeImplicitAutograd kernel fused_kernel_accept-
                                                      calling it, as CUDA's does; p = 0,      able``); tools/
                                                      eval, p = 1, empty inputs and in-place  autograd/derivatives
                                                      ``dropout_`` keep their code path.      .yaml (native_dropout)
2   scaled_dot_      CPU flash kernel: output laid    the backend the GPU would run, see      aten/src/ATen/native/
    product_         out [B, H, L, D], so a caller's  :func:`choose_sdpa`;                    transformers/
    attention        ``transpose(1, 2).contiguous()`` ``aten::scaled_dot_product_attention``  attention.cpp,
                     copies it (a second saved        gets a CompositeImplicitAutograd        cuda/sdp_utils.cpp,
                     tensor); masks accepted. Or the  kernel.                                 sdp_utils_cpp.h
                     math path with CPU dropout.
2a    flash          —                                saves q, k, v (head dim padded to a     derivatives.yaml
                                                      multiple of 8 first), output            (_scaled_dot_product_
                                                      [B, H, L, D] in the query's layout      flash_attention);
                                                      (``empty_like(q)``), logsumexp          torch/_meta_
                                                      [B, H, L] float32, rng_state uint64     registrations.py;
                                                      [2], unused uint64 [].                  flash_api.cpp mha_fwd
2b    efficient      —                                saves q, k, v, attn_bias (a bool mask   derivatives.yaml
                                                      made additive, padded for 8-element     (_scaled_dot_product_
                                                      alignment, expanded to [B, H, L, S]),   efficient_attention);
                                                      output [B, H, L, D] laid out [B, L, H,  meta kernel:
                                                      D], log_sumexp [B, H, ceil(L/32)*32]    ``ceil(M / 32) * 32``
                                                      float32 (length 0 without grad), philox
                                                      seed and offset int64 [].
2c    math           —                                PyTorch's own ``_scaled_dot_product_    attention.cpp (allow
                                                      attention_math``: fp16/bf16 q, k, v     FP16BF16Reduction
                                                      upcast to float32 unless                MathSDP, pre_process_
                                                      ``allowFP16BF16ReductionMathSDP``, GQA  group_query_attention
                                                      by ``repeat_interleave``; its           _input)
                                                      ``at::dropout`` goes through rule 1.
2d    cudnn          —                                saves q, k, v, attn_bias (a bool mask   derivatives.yaml
                                                      made additive with -65504, as given:    (_scaled_dot_product_
                                                      not padded, not expanded), output       cudnn_attention);
                                                      (the query's layout), logsumexp         meta kernel; attention
                                                      [B, H, L, 1] float32, philox seed and   .cpp (convert_boolean
                                                      offset int64 [].                        _attn_mask_cudnn)
3   cross_entropy,   ``_log_softmax`` saves its       the same: device-independent formulas   derivatives.yaml
    log_softmax,     result, ``nll_loss_forward``     and composite, **no override**. (CUDA   (_log_softmax,
    nll_loss         that, target, total_weight.      skips the transient float32 copy of an  nll_loss_forward);
                                                      fp16 input with ``half_to_float``: not  SoftMax.cpp
                                                      saved, not modelled.)
4   autocast (with   CPU lists: ``layer_norm``,       CUDA lists: float32 for AT_FORALL_FP32, aten/src/ATen/
    ``autocast_      ``softmax``, ``log_softmax``,    ``dtype=float32`` for AT_FORALL_FP32_   autocast_mode.h (the
    dtype``)         ``exp``, ``pow``, ``rms_norm``,  SET_OPT_DTYPE, lower precision for      CUDA lists),
                     ``sum``, ... stay in bf16/fp16;  AT_FORALL_LOWER_PRECISION_FP, widest    autocast_mode.cpp
                     ``cat``/``stack`` promote,       type for AT_FORALL_PROMOTE; ops only    (the CPU lists)
                     ``_addmm_activation`` is lower.  the CPU lists fall through. Python
                                                      kernels at ``AutocastCPU``.
5   rms_norm         ``_fused_rms_norm`` has no CPU   the fused kernel's node: saves input,   aten/src/ATen/native/
                     kernel: its composite runs and   weight, rstd [..., 1] float32. The op's layer_norm.cpp (rms_
                     saves 6 tensors (x, x², x·rstd,  decomposition becomes its CPU kernel    norm_symint);
                     ...).                            (backward too), so PyTorch's own        derivatives.yaml
                                                      autograd node runs.                     (_fused_rms_norm)
=== ================ ================================ ======================================= ======================

SDPA backend choice (:func:`choose_sdpa`): PyTorch's own ``select_sdp_backend`` for a target GPU, cuDNN version and
torch version (:class:`~lightning_ckpt.forecast.sdpa.GpuTarget`), as rules with their sources in
:mod:`lightning_ckpt.forecast.sdpa`: cuDNN attention first on SM 9.0/10.x when the runtime cuDNN is newer than
9.15.0, flash from SM 8.0, the math kernel for bf16 before SM 8.0 (it saves the B·H·L·S probabilities). It honours
``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel`` (backends and priority) and deterministic mode.

How the fused backends run: the context calls PyTorch's own fused op (``_scaled_dot_product_flash_attention``,
``_efficient_``, ``_cudnn_``) with the arguments attention.cpp passes it on CUDA, so its real autograd node saves
what ``derivatives.yaml`` lists and every dispatch-level observer sees the op the GPU runs: the ``selective``
checkpoint policy keeps its outputs (attention output, logsumexp, RNG state) when ``dropout_p == 0``, as it does on
a GPU. On fake tensors the ops run their meta kernels; on real CPU tensors, the context gives them and their
backward ops a placeholder CPU kernel whose outputs have the meta kernel's shapes and strides and are zeros, which
is all a trace needs (keep the context active through backward). The context is for tracing memory, not for
computing. Everything else (dropout, the math path, rms_norm, autocast) is PyTorch's own code and computes real
values, on fake tensors through their meta kernels. The kernels are the installed torch's: a target whose efficient
kernel takes GQA (torch 2.14) cannot be traced with an older torch, which says so.

Not covered: code that calls a C++ kernel below these ops directly, cuDNN RNNs, LayerNorm statistics of fp16/bf16
*inputs* (the CPU and its fake kernel keep mean and rstd in the input dtype, CUDA in float32: 2 × tokens × 2 bytes
per LayerNorm), the autocast cache for the CUDA-only lower-precision ops (``einsum``, ``mv``, ... cast their
weights at every call), ``binary_cross_entropy`` (CUDA autocast refuses it; the CPU's float32 is kept). The
registrations are process-wide while the context is active: run no other CPU work in other threads meanwhile.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from lightning_ckpt.forecast.sdpa import (
    GpuTarget,
    SdpaCall,
    SdpaChoice,
    Source,
    blockers,
    parse_torch_version,
    resolve_gpu,
    rules_for,
    select_for_call,
)

__all__ = ["SDPA_BACKENDS", "choose_sdpa", "choose_sdpa_backend", "cuda_semantics"]

SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

# CUDA autocast policies, copied from the AT_FORALL_* lists of aten/src/ATen/autocast_mode.h (PyTorch 2.14), which
# autocast_mode.cpp registers for AutocastCUDA. Names are "op" or "op.overload". torch 2.15.0 registers the same
# kernels for AutocastCUDA (read from its binary's dispatcher registrations while testing it, 2026-12-06).
_CUDA_LOWER = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
_CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    # the named-dimension overloads: in torch 2.11's lists, gone by 2.14's
    "prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumprod.dimname", "cumsum.dimname",
    "sum.dim_DimnameList",
)
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: redispatched to the overload that takes a dtype, with dtype=float32
_CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
                           "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype"}  # the last: torch 2.11
_CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                 "tensordot", "scatter_add")
# registered for AutocastCUDA but with no CPU counterpart to mirror (cuDNN-only ops) or deliberately left alone:
# CUDA autocast refuses binary_cross_entropy with an error; the CPU's float32 cast is kept so traces do not fail
_CUDA_NOT_MIRRORED = frozenset({"_cudnn_rnn", "cudnn_convolution", "cudnn_convolution_transpose",
                                "binary_cross_entropy", "linalg_matrix_sqrth"})
# ops the CPU registers too but with another policy (CPU: float32 for all three), so CUDA's replaces it; every other
# op in both lists has the same policy on both devices and keeps the CPU kernel (and its cache of weight casts)
_CPU_POLICY_DIFFERS = frozenset({"prod", "prod.dim_int", "grid_sampler"})


def _check_backend(name: Any) -> str:
    if name not in SDPA_BACKENDS:
        raise ValueError(f"--sdpa-backend={name!r} is not an SDPA backend; choose one of {list(SDPA_BACKENDS)} "
                         "('auto' picks the backend the target GPU would run for each call).")
    return name


def _check_autocast_dtype(dtype: Any) -> Optional[torch.dtype]:
    if dtype is None or dtype in _AUTOCAST_DTYPES:
        return dtype
    raise ValueError(f"autocast_dtype={dtype!r} is not a CUDA autocast dtype; pass torch.bfloat16 or torch.float16 "
                     "(the dtype of the torch.autocast('cpu', dtype=...) the trace runs under), or None without "
                     "autocast.")


# --- rule 1: dropout ------------------------------------------------------------------------------------------


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``at::dropout`` as compiled for CUDA (Dropout.cpp): fused ``native_dropout`` when it is acceptable."""
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input  # _dropout_impl returns its input unchanged
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)  # _dropout_impl's p == 1 branch
    return torch.native_dropout(input, p, True)[0]


# --- rule 2: scaled_dot_product_attention ----------------------------------------------------------------------


def _as_4d(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``normalize_unbatched_input`` (sdp_utils_cpp.h): 3-D query, key and value get a batch of one."""
    if all(t.dim() == 3 for t in tensors):
        return tuple(t.unsqueeze(0) for t in tensors)
    return tensors


def choose_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False, override: str = "auto",
                gpu: Optional[GpuTarget] = None) -> SdpaChoice:
    """The backend ``gpu`` would run for these arguments, with the order tried and why earlier ones were refused
    (:func:`lightning_ckpt.forecast.sdpa.select_for_call`, honouring this process's ``torch.backends.cuda`` switches
    and ``sdpa_kernel``).

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa: as for
            ``torch.nn.functional.scaled_dot_product_attention``.
        override: ``"auto"`` follows PyTorch's priority order; a backend name forces that backend.
        gpu: the target (:func:`lightning_ckpt.forecast.sdpa.resolve_gpu`); ``None`` resolves the default (this
            machine's GPU, else an H100) with its assumptions.

    Raises:
        ValueError: ``override`` is not one of :data:`SDPA_BACKENDS`, or names a fused backend whose constraints
            these arguments break on ``gpu`` (the message lists them).
    """
    _check_backend(override)
    gpu = resolve_gpu() if gpu is None else gpu
    call = SdpaCall.from_tensors(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if override == "auto":
        return select_for_call(call, gpu)
    refused = blockers(override, call, gpu) if override != "math" else []
    if refused:
        reasons = "; ".join(f"{reason} [{source}]" for reason, source in refused)
        raise ValueError(f"--sdpa-backend={override!r} cannot run this attention call on {gpu.describe()}: {reasons}. "
                         "Use --sdpa-backend='auto' (picks what CUDA would run) or 'math'.")
    forced = Source("--sdpa-backend", f"{gpu.torch_version[0]}.{gpu.torch_version[1]}", "lightning-ckpt plan")
    return SdpaChoice(override, (override,), "forced by --sdpa-backend", forced, {}, rules_for(gpu.torch_version).name)


def choose_sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                        enable_gqa: bool = False, override: str = "auto", gpu: Optional[GpuTarget] = None) -> str:
    """The name of the backend :func:`choose_sdpa` picks: ``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``."""
    return choose_sdpa(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, override, gpu).backend


# The fused kernels attention.cpp calls on CUDA, and the backward ops their autograd nodes call. They have meta
# kernels but no CPU kernel: inside the context each gets one (:func:`_placeholder_kernel`), so the trace calls the
# real ops and every dispatch-level observer (the selective checkpoint policy, which keeps their outputs when
# dropout_p == 0; the meter) sees the op the GPU runs, with its arguments.
_FUSED_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
)


def _placeholder_kernel(op):
    """A CPU kernel for a CUDA-only op: the op's meta kernel gives each output's shape, strides and dtype, and the
    output is zeros (fake tensors never reach it: they run the meta kernel themselves)."""

    def to_meta(t: Any) -> Any:
        return t.to("meta") if isinstance(t, torch.Tensor) else t

    def to_zeros(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()

    def kernel(*args, **kwargs):
        return tree_map(to_zeros, op(*tree_map(to_meta, args), **tree_map(to_meta, kwargs)))

    return kernel


# the installed torch's efficient kernels (their meta kernels' gradient shapes) take GQA/MQA since pytorch#191085
_EFFICIENT_GQA_HERE = parse_torch_version(torch.__version__) >= (2, 14)


def _register_fused_attention(lib: torch.library.Library) -> None:
    for name in _FUSED_ATTENTION_OPS:
        lib.impl(name, _placeholder_kernel(getattr(torch.ops.aten, name).default), "CPU")


def _wants_grad(*tensors: torch.Tensor) -> bool:
    """``should_compute_logsumexp`` (attention.cpp): grad mode on and an input requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _pad_last_dim(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -t.size(-1) % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool,
           scale: Optional[float]) -> torch.Tensor:
    """``scaled_dot_product_attention``'s flash branch on CUDA (attention.cpp): pad the head dim to a multiple of
    8 (the padded copies are what the kernel saves), scale by the unpadded head dim, slice the output back."""
    head_dim = query.size(-1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale  # sdp::calculate_scale on the original query
    query, key, value = (_pad_last_dim(t, 8) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                             scale=scale)[0]
    return out[..., :head_dim] if out.size(-1) != head_dim else out


def _additive_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``convert_boolean_attn_mask`` (attention.cpp): a bool mask becomes 0 / -inf in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (attention.cpp): pad the bias' last dim for 8-element alignment, expand to 4-D."""
    aligned = all(s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        length = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 8 - length % 8))[..., :length]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
               dropout_p: float, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """``scaled_dot_product_attention``'s efficient branch on CUDA (attention.cpp): a bool mask becomes an additive
    bias, padded and expanded (:func:`_efficient_bias`), which the kernel saves."""
    if key.size(1) != query.size(1) and not _EFFICIENT_GQA_HERE:
        raise ValueError(
            f"Install torch 2.14 or newer here, or forecast for torch {torch.__version__.split('+')[0]}: the "
            "target's memory-efficient attention takes k, v with fewer heads than q (GQA/MQA, pytorch#191085), "
            "and this torch's kernels, which the trace runs, do not.")
    bias = _additive_mask(attn_mask, query.dtype)
    if bias is not None:
        bias = _efficient_bias(bias, query, key)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, _wants_grad(query, key, value), dropout_p, is_causal, scale=scale)[0]


def _cudnn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
           dropout_p: float, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """``scaled_dot_product_attention``'s cuDNN branch (attention.cpp): a bool mask becomes additive with -65504
    (``convert_boolean_attn_mask_cudnn``, not padded, not expanded), which the kernel saves."""
    bias = attn_mask
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
        bias = torch.where(attn_mask.logical_not(), -65504.0, zero)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, bias, _wants_grad(query, key, value), dropout_p, is_causal, False, scale=scale)[0]


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor:
    """The math branch: PyTorch's own composite, whose ``at::dropout`` goes through rule 1."""
    mask = _additive_mask(attn_mask, query.dtype)
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                             scale=scale, enable_gqa=enable_gqa)[0]


def _sdpa_kernel(override: str, gpu: GpuTarget, record: Optional[List[SdpaChoice]]):
    """A CompositeImplicitAutograd kernel for ``aten::scaled_dot_product_attention`` that runs what ``gpu`` runs
    (each decision appended to ``record``). Autocast has cast the arguments already (its kernel sits above this one
    and excludes itself, as on CUDA)."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        choice = choose_sdpa(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, override, gpu)
        if record is not None:
            record.append(choice)
        if choice.backend == "math":
            return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        # only the rules that batch unbatched input (SdpaCall.unbatched) let 3-D q, k, v reach a fused backend
        unbatched = query.dim() == 3
        if unbatched:
            query, key, value = _as_4d(query, key, value)
            attn_mask = attn_mask.unsqueeze(0) if attn_mask is not None and attn_mask.dim() == 3 else attn_mask
        fused = {"flash": _flash, "cudnn": _cudnn, "efficient": _efficient}[choice.backend]
        args = (query, key, value) if choice.backend == "flash" else (query, key, value, attn_mask)
        out = fused(*args, dropout_p, is_causal, scale)
        return out.squeeze(0) if unbatched else out

    return sdpa


# --- rule 5: rms_norm -------------------------------------------------------------------------------------------


def _register_rms_norm(lib: torch.library.Library) -> None:
    """Give ``_fused_rms_norm`` (and its backward) a CPU kernel, its own decomposition: the CPU then runs the op's
    autograd node (saves input, weight, rstd) instead of decomposing it, as CUDA does. No-op on PyTorch builds
    without the op, where rms_norm is a composite on every device."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    if not hasattr(aten, "_fused_rms_norm") or not hasattr(aten, "_fused_rms_norm_backward"):
        return
    forward = decomposition_table.get(aten._fused_rms_norm.default)
    backward = decomposition_table.get(aten._fused_rms_norm_backward.default)
    if forward is None or backward is None:
        return
    lib.impl("_fused_rms_norm", forward, "CPU")
    lib.impl("_fused_rms_norm_backward", backward, "CPU")


# --- rule 4: autocast ------------------------------------------------------------------------------------------


def _eligible(t: Any) -> bool:
    """``is_eligible`` in autocast_mode.h: a floating tensor on the autocast device that is not float64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cpu"


def _cast_all(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, tree)


def _redispatch(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
        return op(*args, **kwargs)


def _cast_kernel(op, dtype_of):
    """An autocast kernel that casts every eligible tensor argument to ``dtype_of(args, kwargs)`` and redispatches
    below autocast (``lower_precision_fp``, ``fp32`` and ``promote`` policies)."""

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            args, kwargs = _cast_all((args, kwargs), dtype_of(args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _widest(lower: torch.dtype):
    """``promote_type``: the lower-precision dtype promoted with every eligible argument's dtype."""

    def dtype_of(args, kwargs):
        leaves = [t for t in tree_leaves((args, kwargs)) if _eligible(t)]
        dtype = lower
        for t in leaves:
            dtype = torch.promote_types(dtype, t.dtype)
        return dtype

    return dtype_of


def _set_opt_dtype_kernel(op):
    """``fp32_set_opt_dtype``: when the first argument is eligible and no dtype was given, pass dtype=float32."""
    names = [a.name for a in op._schema.arguments]
    index = names.index("dtype")
    kwarg_only = op._schema.arguments[index].kwarg_only

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            given = kwargs.get("dtype") if kwarg_only or len(args) <= index else args[index]
            if given is None:
                if not kwarg_only and len(args) > index:
                    args = (*args[:index], torch.float32, *args[index + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
        return _redispatch(op, args, kwargs)

    return kernel


def _append_dtype_kernel(op, target):
    """``fp32_append_dtype`` (``norm``): redispatch to the overload taking a dtype, with dtype=float32."""

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            return _redispatch(target, args, {**kwargs, "dtype": torch.float32})
        return _redispatch(op, args, kwargs)

    return kernel


def _overload(name: str):
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _registered(key: str) -> set:
    """aten ops with a kernel at dispatch key ``key``, as ``"op.overload"`` (``"op"`` for the default)."""
    names = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    return {n[len("aten::"):] for n in names if n.startswith("aten::")}


def _autocast_kernels(lower: torch.dtype) -> Dict[str, Any]:
    """Autocast kernels implementing CUDA's policy, by op name: the tables' entries that this torch registers for
    AutocastCUDA (the lists change between releases: torch 2.14 casts ``rms_norm`` to float32, 2.11 does not), all
    of them on a build without AutocastCUDA registrations."""
    registered = _registered("AutocastCUDA")
    return {name: kernel for name, kernel in _table_kernels(lower).items() if not registered or name in registered}


def _table_kernels(lower: torch.dtype) -> Dict[str, Any]:
    kernels: Dict[str, Any] = {}
    fixed = {**{n: lower for n in _CUDA_LOWER}, **{n: torch.float32 for n in _CUDA_FP32}}
    for name, dtype in fixed.items():
        op = _overload(name)
        if op is not None:
            kernels[name] = _cast_kernel(op, lambda args, kwargs, dtype=dtype: dtype)
    for name in _CUDA_PROMOTE:
        op = _overload(name)
        if op is not None:
            kernels[name] = _cast_kernel(op, _widest(lower))
    for name in _CUDA_FP32_SET_OPT_DTYPE:
        op = _overload(name)
        if op is not None:
            kernels[name] = _set_opt_dtype_kernel(op)
    for name, target in _CUDA_FP32_APPEND_DTYPE.items():
        op, to = _overload(name), _overload(f"norm.{target}")
        if op is not None and to is not None:
            kernels[name] = _append_dtype_kernel(op, to)
    return kernels


def _register_autocast(lib: torch.library.Library, lower: torch.dtype) -> None:
    """Make CPU autocast apply CUDA's policy: CUDA's kernel where the CPU has none or another policy, and a
    fallthrough (no cast, as on CUDA) for ops only the CPU lists."""
    # a build without AutocastCUDA registrations would make every CPU op fall through: use the tables instead
    cpu, cuda = _registered("AutocastCPU"), _registered("AutocastCUDA") or set(_policy_names())
    kernels = _autocast_kernels(lower)
    for name, kernel in kernels.items():
        if name not in cpu or name in _CPU_POLICY_DIFFERS:
            lib.impl(name, kernel, "AutocastCPU")
    for name in sorted(cpu - cuda - set(kernels)):
        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")


# --- the context --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_semantics(sdpa_backend: str = "auto", autocast_dtype: Optional[torch.dtype] = None,
                   gpu: Optional[GpuTarget] = None, record: Optional[List[SdpaChoice]] = None) -> Iterator[None]:
    """Within this context, CPU kernels save for backward what CUDA kernels would (see the module docstring).

    Keep it active over the forward *and* the backward of the trace. Everything is restored on exit, also when the
    body raises.

    Args:
        sdpa_backend: ``"auto"`` runs, per attention call, the backend ``gpu`` would pick; ``"cudnn"``,
            ``"flash"``, ``"efficient"`` or ``"math"`` force one (a forced fused backend that cannot run a call
            raises ``ValueError``).
        autocast_dtype: the dtype of the ``torch.autocast("cpu", dtype=...)`` the trace runs under; CPU autocast
            then follows CUDA's op lists. ``None`` (no autocast) leaves autocast alone.

    Raises:
        ValueError: an unknown ``sdpa_backend`` or an ``autocast_dtype`` CUDA autocast does not support.
    """
    _check_backend(sdpa_backend)
    lower = _check_autocast_dtype(autocast_dtype)
    gpu = resolve_gpu() if gpu is None else gpu
    # torch 2.11 refuses a second Python kernel for the same op and key, so a nested context takes the outer one's
    # registrations down while it is active and puts them back when it exits (newer torch would stack them)
    outer = _ACTIVE[-1] if _ACTIVE else None
    if outer is not None:
        outer["lib"]._destroy()
    config = (sdpa_backend, lower, gpu, record)
    state = {"config": config, "lib": _install(*config)}
    _ACTIVE.append(state)
    try:
        yield
    finally:
        _ACTIVE.pop()["lib"]._destroy()
        if outer is not None:
            outer["lib"] = _install(*outer["config"])


_ACTIVE: List[Dict[str, Any]] = []  # the open cuda_semantics contexts, innermost last


def _install(sdpa_backend: str, lower: Optional[torch.dtype], gpu: GpuTarget,
             record: Optional[List[SdpaChoice]]) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
        lib.impl("scaled_dot_product_attention", _sdpa_kernel(sdpa_backend, gpu, record), "CompositeImplicitAutograd")
        _register_fused_attention(lib)
        _register_rms_norm(lib)
        if lower is not None:
            _register_autocast(lib, lower)
    except BaseException:
        lib._destroy()
        raise
    return lib


def _policy_names() -> Sequence[str]:
    """Every op name the CUDA policy tables mention (for tests)."""
    return (*_CUDA_LOWER, *_CUDA_FP32, *_CUDA_FP32_SET_OPT_DTYPE, *_CUDA_FP32_APPEND_DTYPE, *_CUDA_PROMOTE)
