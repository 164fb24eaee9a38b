"""The SDPA backend rule: PyTorch's ``select_sdp_backend`` per GPU architecture, cuDNN version and torch version, each
rule with its source; the GPU-name table; what each backend saves; ``lightning-ckpt plan --sm``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from lightning_ckpt.cli.main import main
from lightning_ckpt.forecast.gpus import GPU_SM, parse_sm
from lightning_ckpt.forecast.numbers import ForecastInputs, attention_call, forecast_from_numbers
from lightning_ckpt.forecast.sdpa import (
    BACKENDS,
    RULES,
    GpuTarget,
    SdpaCall,
    SdpaFlags,
    format_cudnn,
    parse_cudnn,
    parse_torch_version,
    resolve_gpu,
    rules_for,
    saved_bytes,
    saved_for_backward,
    select_backend,
    select_for_call,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def pick(sm, cudnn="9.19.0", dtype=BF16, head_dim=64, torch_version="2.11", **kw):
    return select_backend(sm, cudnn, dtype, head_dim, torch_version=torch_version, **kw)


# --- the priority order: check_prefer_cudnn_attention --------------------------------------------------------------


@pytest.mark.parametrize("torch_version", ["2.11", "2.14"])
@pytest.mark.parametrize("sm", ["9.0", "H100", "H200", "10.0", "B200", "10.3"])
def test_hopper_and_blackwell_with_a_new_cudnn_run_cudnn_attention(sm, torch_version):
    choice = pick(sm, "9.15.1", is_causal=True, torch_version=torch_version)
    assert choice.backend == "cudnn"
    assert choice.order == ("cudnn", "flash", "efficient", "math")
    assert choice.source.function == "check_prefer_cudnn_attention"
    assert choice.source.file == "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"


@pytest.mark.parametrize("cudnn", ["9.15.0", "9.10.2", "91400"])
def test_hopper_with_an_old_cudnn_runs_flash(cudnn):
    # check_prefer_cudnn_attention: cudnn_version > 91500, i.e. 9.15.1 or newer (issue #169849)
    choice = pick("9.0", cudnn, is_causal=True)
    assert choice.backend == "flash" and choice.order[0] == "flash"
    assert "older than 9.15.1" in choice.order_reason


@pytest.mark.parametrize("sm", ["8.0", "A100", "8.6", "A10G", "8.9", "L4", "RTX 4090", "12.0"])
def test_ampere_ada_and_consumer_blackwell_run_flash(sm):
    assert pick(sm, "9.19.0", is_causal=True).backend == "flash"
    assert pick(sm, "9.19.0", is_causal=True, torch_version="2.14").backend == "flash"


def test_sm_10_1_prefers_cudnn_only_in_cuda_13_builds_from_2_13():
    assert pick("10.1", torch_version="2.11", cuda=(13, 0)).backend == "flash"  # minor 0 or 3 only
    assert pick("10.1", torch_version="2.14", cuda=(13, 0)).backend == "cudnn"
    assert pick("10.1", torch_version="2.13", cuda=(13, 0)).backend == "cudnn"
    assert pick("10.1", torch_version="2.12", cuda=(13, 0)).backend == "flash"
    assert pick("10.1", torch_version="2.14", cuda=(12, 8)).backend == "flash"


def test_torch_2_9_needs_cudnn_9_9_and_sm_9_0_or_10_0():
    assert pick("9.0", "9.9.0", torch_version="2.9").backend == "cudnn"
    assert pick("9.0", "9.8.0", torch_version="2.9").backend == "flash"
    assert pick("10.3", "9.19.0", torch_version="2.9").backend == "flash"
    assert rules_for((2, 8)).prefer is None and pick("9.0", "9.19", torch_version="2.8").backend == "flash"


def test_the_preference_can_be_turned_off_or_replaced():
    off = SdpaFlags(env_off=frozenset({"TORCH_CUDNN_SDPA_DEPRIORITIZED=1"}))
    assert pick("9.0", flags=off).backend == "flash"
    user = SdpaFlags(order=("efficient", "flash", "math", "cudnn"))  # sdpa_kernel(..., set_priority=True)
    assert pick("9.0", flags=user).backend == "efficient"
    assert pick("9.0", flags=SdpaFlags(cudnn=False)).backend == "flash"
    strict = SdpaFlags(deterministic=True)  # torch.use_deterministic_algorithms(True): cuDNN SDPA refuses
    assert pick("9.0", flags=strict).backend == "flash"


def test_flags_read_from_torch_follow_sdpa_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        flags = SdpaFlags.current()
    assert (flags.cudnn, flags.flash, flags.efficient, flags.math) == (False, False, True, True)
    assert pick("9.0", flags=flags).backend == "efficient"


# --- pre-Ampere: bf16 falls back to the math kernel ---------------------------------------------------------------


@pytest.mark.parametrize("sm", ["7.5", "T4", "7.0", "V100"])
def test_pre_ampere_bf16_runs_the_math_kernel_and_fp16_the_efficient_one(sm):
    choice = pick(sm, dtype=BF16, is_causal=True)
    assert choice.backend == "math"
    # the deciding refusal: the efficient kernel's bf16 needs SM 8.0
    assert choice.source.function.startswith("can_use_mem_efficient_attention")
    assert "bfloat16" in choice.rejected["efficient"][0][0]
    assert "SM 8.0 to 12.1" in choice.rejected["flash"][0][0]
    assert pick(sm, dtype=FP16, is_causal=True).backend == "efficient"
    assert pick(sm, dtype=FP32).backend == "efficient"  # fp32 below SM 8.0: alignment 1


def test_pre_ampere_math_saves_the_full_score_matrix():
    call = SdpaCall(dtype=BF16, head_dim=64, batch=2, heads=12, q_len=512, is_causal=True)
    saved = {t.name: t for t in saved_for_backward("math", call)}
    assert saved["attn_probs"].shape == (2, 12, 512, 512) and saved["attn_probs"].dtype == FP32  # upcast
    assert saved_bytes("math", call) >= 2 * 12 * 512 * 512 * 4
    with_dropout = replace(call, dropout=0.1)
    # the dropout mask and the dropped copy: 1 + 4 more bytes per score
    assert saved_bytes("math", with_dropout) - saved_bytes("math", call) == 2 * 12 * 512 * 512 * 5
    for fused in ("cudnn", "flash", "efficient"):  # no score matrix in any fused kernel
        assert all(t.shape[-2:] != (512, 512) for t in saved_for_backward(fused, call))
    assert saved_bytes("math", call, fp16_bf16_reduction_math=True) < saved_bytes("math", call)


# --- each backend's constraints -----------------------------------------------------------------------------------


def test_dropout_per_backend_and_version():
    # 2.11: cuDNN takes any dropout from cuDNN 9.14; refused on 9.11-9.13 (pytorch#163903)
    assert pick("9.0", "9.19.0", dropout=0.1).backend == "cudnn"
    assert pick("9.0", "9.16.0", dropout=0.1).backend == "cudnn"
    # 2.14: cuDNN's dropout resolution is 1/16 (pytorch#174245): 0.1 goes to flash, 0.125 stays on cuDNN
    choice = pick("9.0", "9.19.0", dropout=0.1, torch_version="2.14")
    assert choice.backend == "flash" and choice.source.function == "check_cudnn_dropout"
    assert pick("9.0", "9.19.0", dropout=0.125, torch_version="2.14").backend == "cudnn"
    assert pick("9.0", "9.19.0", dropout=0.1, torch_version="2.12").backend == "flash"  # merged before the 2.12 cut
    # flash and efficient take dropout; query length 1 with dropout is not cuDNN's
    assert pick("8.0", dropout=0.3).backend == "flash"
    assert pick("9.0", "9.19.0", dropout=0.1, q_len=1, kv_len=64).backend == "flash"


def test_dropout_is_refused_by_cudnn_9_11_to_9_13():
    # those cuDNNs are too old to be preferred: put cuDNN first by hand (sdpa_kernel(..., set_priority=True))
    user = SdpaFlags(order=("cudnn", "flash", "efficient", "math"))
    choice = pick("9.0", "9.12.0", dropout=0.25, flags=user)
    assert choice.backend == "flash" and choice.rejected["cudnn"][0][1].ref == "pytorch#163903"
    assert pick("9.0", "9.12.0", flags=user).backend == "cudnn"
    assert pick("9.0", "9.11.0", dropout=0.25, flags=user).backend == "cudnn"  # cudnn_version > 91100
    assert pick("9.0", "9.14.0", dropout=0.25, flags=user).backend == "cudnn"


def test_masks_per_backend():
    # flash takes no mask; cuDNN takes [L, S] and [B|1, H|1, L, S] masks; efficient any
    choice = pick("8.0", mask="bool")
    assert choice.backend == "efficient" and choice.source.function == "check_for_attn_mask"
    assert pick("9.0", mask="bool").backend == "cudnn"
    assert pick("9.0", mask="float").backend == "cudnn"
    four_d = select_for_call(SdpaCall(BF16, batch=2, heads=4, mask=(2, 1, 128, 128), mask_dtype=torch.bool),
                             GpuTarget((9, 0), 91900, (2, 11)), SdpaFlags())
    assert four_d.backend == "cudnn"
    three_d = replace(SdpaCall(BF16, batch=2, heads=4), mask=(4, 128, 128), mask_dtype=torch.bool)
    choice = select_for_call(three_d, GpuTarget((9, 0), 91900, (2, 11)), SdpaFlags())
    assert choice.backend == "efficient" and choice.rejected["cudnn"][0][1].function == "check_attn_mask_shape"
    grad_mask = replace(three_d, mask=(128, 128), mask_requires_grad=True)
    assert select_for_call(grad_mask, GpuTarget((9, 0), 91900, (2, 11)), SdpaFlags()).backend == "efficient"


@pytest.mark.parametrize("torch_version, expected", [("2.11", "math"), ("2.13", "math"), ("2.14", "cudnn")])
def test_unbatched_input_runs_a_fused_backend_only_where_torch_batches_it(torch_version, expected):
    """3-D q, k, v: 2.11's _fused_sdp_choice_cuda hands them to check_tensor_shapes, which wants 4-D, so every
    fused backend refuses and math runs; 2.14 gives them a batch of one first (2.12/2.13 taken as 2.11)."""
    q = torch.empty(16, 1024, 64, dtype=BF16)
    call = SdpaCall.from_tensors(q, q, q)
    choice = select_for_call(call, GpuTarget((9, 0), 91900, parse_torch_version(torch_version)), SdpaFlags())
    assert choice.backend == expected
    if expected == "math":
        assert all(refusals[0][1].function == "check_tensor_shapes" for refusals in choice.rejected.values())
    assert (call.unbatched, call.dims, call.batch, call.heads, call.q_len) == (True, 3, 1, 16, 1024)
    batched = SdpaCall.from_tensors(q[None], q[None], q[None])
    assert not batched.unbatched and batched.dims == 4


@pytest.mark.parametrize("torch_version", ["2.11", "2.14"])
def test_a_mask_whose_last_dim_is_not_contiguous_runs_math(torch_version):
    """check_last_dim_stride_equals_1_dense refuses an expanded mask (stride 0) on every GPU backend, in 2.11 too
    (its binary carries the message)."""
    q = torch.empty(2, 8, 256, 64, dtype=BF16)
    mask = torch.ones(256, 1, dtype=torch.bool).expand(256, 256)
    h200 = GpuTarget((9, 0), 91900, parse_torch_version(torch_version), name="H200")
    choice = select_for_call(SdpaCall.from_tensors(q, q, q, mask), h200, SdpaFlags())
    assert choice.backend == "math"
    assert choice.rejected["cudnn"][0][1].function == "check_last_dim_stride_equals_1_dense"
    contiguous = select_for_call(SdpaCall.from_tensors(q, q, q, mask.contiguous()), h200, SdpaFlags())
    assert contiguous.backend == "cudnn"


@pytest.mark.parametrize("sm, cudnn, torch_version, q_len, expected", [
    ("10.0", "9.19.0", "2.14", 1, "flash"),   # decode refused: the next backend runs
    ("10.0", "9.25.0", "2.14", 1, "flash"),
    ("10.0", "9.24.1", "2.14", 1, "cudnn"),   # the exception
    ("10.0", "9.25.1", "2.14", 1, "cudnn"),
    ("10.0", "9.19.0", "2.14", 2, "cudnn"),   # not decode
    ("9.0", "9.19.0", "2.14", 1, "cudnn"),    # not SM 10.x/11.x
    ("10.0", "9.19.0", "2.11", 1, "cudnn"),   # a 2.14 rule
])
def test_cudnn_decode_is_refused_on_sm_10_and_11_for_some_cudnn_versions(sm, cudnn, torch_version, q_len, expected):
    choice = pick(sm, cudnn, torch_version=torch_version, q_len=q_len, kv_len=256)
    assert choice.backend == expected
    if expected != "cudnn":
        assert "decode" in choice.rejected["cudnn"][0][0]
        assert choice.rejected["cudnn"][0][1].function == "check_cudnn_tensor_shapes"


def test_is_causal_with_different_lengths():
    # flash refuses is_causal when L != S (check_flash_causal_non_square_seqlens); cuDNN has no such check
    assert pick("8.0", is_causal=True, q_len=64, kv_len=128).backend == "efficient"
    assert pick("9.0", is_causal=True, q_len=64, kv_len=128).backend == "cudnn"


@pytest.mark.parametrize("sm, cudnn, torch_version, head_dim, expected", [
    ("9.0", "9.19.0", "2.11", 128, "cudnn"),
    ("9.0", "9.19.0", "2.11", 256, "cudnn"),   # SM 9.0 with cuDNN >= 9.10: head dim up to 256
    ("9.0", "9.9.0", "2.11", 256, "flash"),    # (cuDNN 9.9 is also too old to be preferred)
    ("10.0", "9.19.0", "2.11", 256, "flash"),  # SM 10.x: 128 (192/128 for DeepSeek shapes)
    ("10.0", "9.24.0", "2.14", 256, "cudnn"),  # 2.14: d = 256 on SM 9.0/10.x with cuDNN > 9.22
    ("10.0", "9.24.0", "2.14", 160, "flash"),  # ... but its backward takes only <=128, 192/128, 256/256
    ("10.0", "9.19.0", "2.14", 160, "flash"),
    ("9.0", "9.19.0", "2.11", 12, "flash"),    # cuDNN needs multiples of 8; flash pads
    ("9.0", "9.19.0", "2.11", 264, "efficient"),  # flash: at most 256
    ("8.6", "9.19.0", "2.11", 200, "efficient"),  # flash training on SM 8.6-8.9: not 192 < d <= 224
    ("8.9", "9.19.0", "2.11", 256, "flash"),   # ... > 224 without dropout is fine
])
def test_head_dim_limits(sm, cudnn, torch_version, head_dim, expected):
    assert pick(sm, cudnn, head_dim=head_dim, torch_version=torch_version).backend == expected


def test_deepseek_head_dims_on_blackwell():
    call = SdpaCall(BF16, head_dim=192, v_head_dim=128)
    assert select_for_call(call, GpuTarget((10, 0), 91900, (2, 11)), SdpaFlags()).backend == "cudnn"
    # flash needs equal head dims; efficient takes them
    assert select_for_call(call, GpuTarget((8, 0), 91900, (2, 11)), SdpaFlags()).backend == "efficient"


def test_gqa_and_mqa_per_version():
    gqa = SdpaCall(BF16, heads=8, kv_heads=2, enable_gqa=True, mask=(128, 128), mask_dtype=torch.bool)
    a100_211, a100_214 = GpuTarget((8, 0), 91900, (2, 11)), GpuTarget((8, 0), 91900, (2, 14))
    # efficient: check_batch_size_and_num_heads_dense<false> in 2.11, <true, true, true> in 2.14
    assert select_for_call(gqa, a100_211, SdpaFlags()).backend == "math"
    assert select_for_call(gqa, a100_214, SdpaFlags()).backend == "efficient"
    assert select_for_call(gqa, GpuTarget((8, 0), 91900, (2, 13)), SdpaFlags()).backend == "math"
    mqa = SdpaCall(BF16, heads=8, kv_heads=1, is_causal=True)
    assert select_for_call(mqa, a100_211, SdpaFlags()).backend == "math"
    assert select_for_call(mqa, a100_214, SdpaFlags()).backend == "flash"
    h100 = GpuTarget((9, 0), 91900, (2, 11))
    assert select_for_call(replace(gqa, mask=None), h100, SdpaFlags()).backend == "cudnn"


def test_pointer_alignment_is_checked_from_2_14_on_sm_8_and_later():
    shifted = SdpaCall(BF16, storage_offsets=(4, 0, 0), mask=(128, 128), mask_dtype=torch.bool)
    assert select_for_call(shifted, GpuTarget((8, 0), 91900, (2, 14)), SdpaFlags()).backend == "math"
    assert select_for_call(shifted, GpuTarget((8, 0), 91900, (2, 13)), SdpaFlags()).backend == "math"
    assert select_for_call(shifted, GpuTarget((8, 0), 91900, (2, 12)), SdpaFlags()).backend == "efficient"
    assert select_for_call(shifted, GpuTarget((8, 0), 91900, (2, 11)), SdpaFlags()).backend == "efficient"
    fp16 = replace(shifted, dtype=FP16)  # below SM 8.0 the pointers are not checked (and bf16 is not taken)
    assert select_for_call(fp16, GpuTarget((7, 5), 91900, (2, 14)), SdpaFlags()).backend == "efficient"


def test_no_backend_left_is_an_error_naming_each_refusal():
    with pytest.raises(ValueError, match=r"no SDPA backend .* T4 \(SM 7.5\).*flash: .*enable_math_sdp"):
        select_for_call(SdpaCall(BF16), GpuTarget((7, 5), 91900, (2, 11), name="T4"),
                        SdpaFlags(math=False))


def test_every_rule_names_its_source():
    for rules in RULES:
        assert rules.evidence
        assert rules.prefer is None or rules.prefer.source.function == "check_prefer_cudnn_attention"
        assert set(rules.checks) == {"cudnn", "flash", "efficient"}
        for checks in rules.checks.values():
            for check in checks:
                assert check.source.file.startswith("aten/src/ATen/native/transformers/")
                assert check.source.torch in ("2.11", "2.14", "2.15") and check.source.function
    assert [r.name for r in RULES] == ["2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15"]
    assert rules_for((2, 11)).name == "2.11" and rules_for((2, 15)).name == "2.15"
    assert rules_for((2, 16)).name == "2.15"


# --- inputs: SM versions, GPU names, cuDNN versions ---------------------------------------------------------------


@pytest.mark.parametrize("name, sm", [
    ("H100", (9, 0)), ("H200", (9, 0)), ("NVIDIA H100 80GB HBM3", (9, 0)), ("B200", (10, 0)), ("GB200", (10, 0)),
    ("A100", (8, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0)), ("L4", (8, 9)), ("L40S", (8, 9)), ("T4", (7, 5)),
    ("Tesla T4", (7, 5)), ("V100", (7, 0)), ("Tesla V100-SXM2-16GB", (7, 0)), ("RTX 4090", (8, 9)),
    ("NVIDIA GeForce RTX 4090", (8, 9)), ("A10", (8, 6)), ("RTX 6000 Ada", (8, 9)), ("Quadro RTX 6000", (7, 5)),
    ("9.0", (9, 0)), ("sm90", (9, 0)), ("sm_75", (7, 5)), ("86", (8, 6)), ("10.3", (10, 3)), ("sm_100", (10, 0)),
    ("12.1", (12, 1)), ("8", (8, 0)), ("10", (10, 0)), ("11", (11, 0)), ("12", (12, 0)), ("sm_120", (12, 0)),
])
def test_sm_from_a_version_or_a_gpu_name(name, sm):
    assert parse_sm(name)[0] == sm
    assert all(isinstance(v, tuple) and len(v) == 2 for v in GPU_SM.values())


def test_unknown_gpu_is_refused_with_the_names():
    with pytest.raises(ValueError, match=r"--sm='Z9000' is neither .*--sm 9.0.*'A100'"):
        parse_sm("Z9000")


@pytest.mark.parametrize("text", ["sm_10", "sm12", "13", "sm_11"])
def test_two_digit_sm_1x_is_refused_as_ambiguous(text):
    """Read digit by digit these would be SM 1.x, which no PyTorch runs on; a bare 10-12 is a major."""
    with pytest.raises(ValueError, match=r"Pass major.minor \(--sm 1\d\.0\), three digits .* could mean SM"):
        parse_sm(text)


@pytest.mark.parametrize("text, version", [("9.15.1", 91501), ("9.19", 91900), ("91900", 91900), (91501, 91501),
                                           ("8.9.7", 8907)])
def test_cudnn_versions_as_torch_numbers_them(text, version):
    assert parse_cudnn(text) == version
    assert parse_cudnn(format_cudnn(version)) == version


def test_bad_cudnn_version_is_refused():
    with pytest.raises(ValueError, match=r"--cudnn='nine' .*9.15.1"):
        parse_cudnn("nine")


def test_resolve_gpu_says_what_it_assumed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu = resolve_gpu(torch_version="2.11")
    assert gpu.sm == (9, 0) and gpu.name == "H100" and gpu.torch_version == (2, 11)
    assert any("no --sm given: assumed an H100" in a for a in gpu.assumptions)
    assert any("no --cudnn given: assumed cuDNN" in a for a in gpu.assumptions)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert resolve_gpu("T4").cudnn == 91501  # nothing loaded here: the oldest cuDNN PyTorch prefers
    given = resolve_gpu("A100", "9.19.0", "2.11", "12.8")
    assert given.assumptions == () and given.cuda == (12, 8) and given.sm == (8, 0)
    assert given.describe() == "A100 (SM 8.0), cuDNN 9.19.0, torch 2.11"


def test_a_torch_newer_than_the_rules_read_is_named():
    newest = RULES[-1].name
    assert newest == "2.15"
    assert resolve_gpu("H100", "9.19.0", "2.15", "13.0").assumptions == ()  # 2.15: its own rules
    given = resolve_gpu("H100", "9.19.0", "2.16", "13.0")
    assert given.describe() == "H100 (SM 9.0), cuDNN 9.19.0, torch 2.16 (the 2.15 rules)"
    note = " ".join(given.assumptions)
    assert "torch 2.16 is newer than torch 2.15, the newest these rules were read from" in note, given.assumptions
    assert "the 2.15 rules apply, unverified" in note


# --- torch 2.15: what its binary checks beyond 2.14 ---------------------------------------------------------------


@pytest.mark.parametrize("case, expected", [
    (dict(), "flash"),                                        # refused: the next backend runs
    (dict(kv_len=320), "flash"),                              # 320 = 2 * 128 + 64
    (dict(kv_len=256), "cudnn"),                              # not 64 mod 128
    (dict(q_len=192, is_causal=True), "cudnn"),               # causal
    (dict(requires_grad=False), "cudnn"),                     # no backward
    (dict(cudnn="9.26.0"), "cudnn"),                          # fixed in cuDNN 9.26
    (dict(sm="10.0"), "cudnn"),                               # SM 9.x only
    (dict(torch_version="2.14"), "cudnn"),                    # a 2.15 rule
])
def test_cudnn_before_9_26_on_hopper_refuses_non_causal_training_with_kv_length_64_mod_128(case, expected):
    case = dict(dict(sm="9.0", cudnn="9.19.0", torch_version="2.15", q_len=128, kv_len=192), **case)
    choice = pick(case.pop("sm"), case.pop("cudnn"), **case)
    assert choice.backend == expected
    if expected != "cudnn":
        reason, source = choice.rejected["cudnn"][0]
        assert "64 mod 128" in reason and "9.26" in reason
        assert (source.function, source.torch) == ("check_cudnn_tensor_shapes", "2.15")


@pytest.mark.parametrize("torch_version, batch, heads, expected", [
    ("2.15", 65536, 1, "efficient"),  # flash's grid holds at most 65535 batches and heads
    ("2.15", 1, 65536, "efficient"),
    ("2.15", 65535, 1, "flash"),
    ("2.14", 65536, 1, "flash"),      # a 2.15 rule
])
def test_flash_refuses_a_batch_or_heads_above_65535_from_2_15(torch_version, batch, heads, expected):
    choice = pick("8.0", batch=batch, heads=heads, q_len=64, torch_version=torch_version)
    assert choice.backend == expected
    if expected != "flash":
        assert [s.function for _, s in choice.rejected["flash"]] == ["check_flash_attention_grid_size"]


# --- numbers: the forecast's saved bytes show the backend ---------------------------------------------------------


def test_numbers_forecast_adds_the_math_kernels_score_matrix():
    base = ForecastInputs(params=1e8, layers=4, hidden=1024, heads=8, micro_batch=2, seq_len=1024)
    fused = forecast_from_numbers(base)
    t4 = forecast_from_numbers(replace(base, attention_backend="math"))
    extra = t4.block_interior - fused.block_interior
    call = attention_call(base)
    assert call.head_dim == 128 and call.is_causal and call.dtype == BF16
    assert extra >= 2 * 8 * 1024 * 1024 * 4  # the float32 B·H·L·S probabilities
    assert t4.activations["none"] - fused.activations["none"] == 4 * extra
    assert forecast_from_numbers(replace(base, attention_backend="cudnn")).block_interior == fused.block_interior
    with pytest.raises(ValueError, match="--attn-dropout=1.5"):
        ForecastInputs(params=1e8, attn_dropout=1.5)


# --- the command line ---------------------------------------------------------------------------------------------

NUMBERS = ["plan", "--params", "1.3e9", "--micro-batch", "2", "--seq-len", "2048", "--policies", "none,all"]


def test_plan_prints_the_backend_and_its_source(capsys):
    assert main([*NUMBERS, "--sm", "H100", "--cudnn", "9.19.0", "--torch-version", "2.11"]) == 0
    out = capsys.readouterr().out
    assert ("attention on H100 (SM 9.0), cuDNN 9.19.0, torch 2.11: cudnn "
            "[aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:check_prefer_cudnn_attention (torch 2.11") in out
    assert "cuDNN first on SM 9.0 with cuDNN 9.19.0" in out and "assumption" not in out


def test_plan_on_a_t4_shows_the_math_kernel_and_its_scores(capsys):
    assert main([*NUMBERS, "--sm", "T4", "--cudnn", "9.19.0", "--torch-version", "2.11", "--json"]) == 0
    t4 = json.loads(capsys.readouterr().out)
    assert main([*NUMBERS, "--sm", "A100", "--cudnn", "9.19.0", "--torch-version", "2.11", "--json"]) == 0
    a100 = json.loads(capsys.readouterr().out)
    assert t4["attention"]["backend"] == "math" and a100["attention"]["backend"] == "flash"
    assert "can_use_mem_efficient_attention" in t4["attention"]["source"]
    scores = 2 * 16 * 2048 * 2048 * 4  # B·H·L·S float32 per block
    assert t4["block_interior"] - a100["block_interior"] >= scores
    assert t4["activations"]["none"] - a100["activations"]["none"] >= 24 * scores


def test_plan_says_which_cudnn_it_assumed(capsys):
    assert main([*NUMBERS, "--sm", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "assumption: no --cudnn given: assumed cuDNN" in out


@pytest.mark.slow
def test_plan_model_prints_the_traced_calls_backend(capsys):
    args = ["plan", "--model", "lightning_ckpt.demos.factories:gpt2_config", "--init-args",
            json.dumps(dict(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=96, dropout=0.0,
                            attn_implementation="sdpa")),
            "--seq-len", "32", "--precision", "bf16-true", "--device", "cuda", "--policies", "none"]
    assert main([*args, "--sm", "sm_75", "--cudnn", "9.19", "--torch-version", "2.11"]) == 0
    out = capsys.readouterr().out
    assert "attention on SM 7.5, cuDNN 9.19.0, torch 2.11: math for 4 of 4 traced calls" in out
    assert "can_use_mem_efficient_attention" in out
    assert main([*args, "--sm", "B200", "--cudnn", "9.19", "--torch-version", "2.11"]) == 0
    assert "cudnn for 4 of 4 traced calls [aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:check_prefer" \
        in capsys.readouterr().out


@pytest.mark.parametrize("extra, words", [
    (["--sm", "Z9000"], "--sm='Z9000' is neither"),
    (["--sm", "9.0", "--cudnn", "new"], "--cudnn='new' is not a cuDNN version"),
    (["--attn-dropout", "0.1"], "only applies with --sm"),
    (["--sm", "9.0", "--attn-dropout", "2"], "--attn-dropout=2.0 must be a probability"),
])
def test_bad_gpu_options_are_one_line_exit_2(capsys, extra, words):
    assert main([*NUMBERS, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_gpu_options_with_a_cpu_trace_are_refused(capsys):
    assert main(["plan", "--model", "lightning_ckpt.demos.factories:gpt2_config", "--device", "cpu",
                 "--sm", "9.0"]) == 2
    assert "--sm='9.0' does not apply here" in capsys.readouterr().err


def test_backends_are_the_four_pytorch_has():
    assert BACKENDS == ("cudnn", "flash", "efficient", "math")
