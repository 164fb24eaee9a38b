"""The ledger against the real storage of every state layout: torchao's 8-bit, 4-bit and float8 optimizer states
and NF4 weights, bitsandbytes' 8-bit states, paged optimizers and 4-bit weights (QLoRA through PEFT), frozen
parameters, several optimizers, and optimizer state offloaded to host memory.

Each known answer is the library's documented layout written out (codes, scales, code maps); the ledger must be
within 3 % of it (it is exact). What a tensor's ``dtype`` and shape *appear* to hold is 2-8x more for these.
"""

import pytest
import torch
from torch import nn

from lightning_ckpt.measure.ledger import ModelStateWalk, build_ledger, model_state_bytes
from lightning_ckpt.measure.meter import StepReading


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _adam_plain(params, step_bytes=4):
    """fp32 Adam state of ``params`` kept as plain tensors: two moments and a scalar step each."""
    return sum(2 * 4 * p.numel() + step_bytes for p in params)


@pytest.fixture
def eager_compile(monkeypatch):
    """torchao's optimizers compile their per-parameter step with torch.compile, 10-20 s per optimizer on a CPU;
    run that step eagerly (same library code, same state tensors)."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)


def _layer(n_in=512, n_out=512):
    torch.manual_seed(0)
    return nn.Linear(n_in, n_out)


def _fit_step(model, opt, n_in=512, steps=2):
    for _ in range(steps):
        model(torch.randn(4, n_in)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)


# ------------------------------------------------------------------------------------------- torchao states


def _torchao_known(numel, bias, code_bytes_per_value, block, qmap_values):
    """A torchao low-bit Adam state: per moment codes, one fp32 scale per block and a code map; parameters under
    4096 values keep plain fp32 moments; a fp32 step scalar each."""
    moment = numel * code_bytes_per_value + numel // block * 4 + qmap_values * 4
    return 2 * moment + 4 + _adam_plain([bias])


@pytest.mark.parametrize("name, code_bytes, block, qmap", [
    ("AdamW8bit", 1.0, 256, 256),
    ("AdamW4bit", 0.5, 128, 16),
    ("AdamWFp8", 1.0, 256, 0),
])
def test_torchao_low_bit_states_count_their_codes_scales_and_code_maps(eager_compile, name, code_bytes, block, qmap):
    optim = pytest.importorskip("torchao.optim")
    model = _layer()
    opt = getattr(optim, name)(model.parameters())
    _fit_step(model, opt)

    state = model_state_bytes(model, [opt])
    known = _torchao_known(model.weight.numel(), model.bias, code_bytes, block, qmap)
    assert state.optimizer == pytest.approx(known, rel=0.03)
    appearance = _nbytes(t for s in opt.state.values() for t in s.values())  # what dtype x numel claims
    assert appearance > 3 * state.optimizer
    assert state.params == _nbytes(model.parameters()) and state.grads == state.params
    assert ("float8_e4m3fn" if name == "AdamWFp8" else "uint8") in state.optimizer_by_dtype


def test_a_dominant_compressed_state_is_not_told_to_compress(eager_compile):
    optim = pytest.importorskip("torchao.optim")
    model = _layer()
    opt = optim.AdamW8bit(model.parameters())
    _fit_step(model, opt)
    ledger = build_ledger(model, [opt], None)
    fat = build_ledger(model, [torch.optim.AdamW(model.parameters())], None)
    tiny = ledger.__class__(params=1, grads=1, optimizer=ledger.optimizer,
                            optimizer_by_dtype=ledger.optimizer_by_dtype)
    assert tiny.compressed_state and not fat.compressed_state
    assert "already compressed" in tiny.diagnosis() and "8-bit" not in tiny.diagnosis().split("compressed")[1]


def test_nf4_weights_with_lora_adapters(eager_compile):
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

    class NF4LoRA(nn.Module):
        """A frozen NF4 base weight (QLoRA as torchtune builds it) with trainable rank-8 adapters."""

        def __init__(self, n=512, rank=8):
            super().__init__()
            torch.manual_seed(0)
            self.weight = nn.Parameter(nf4.to_nf4(torch.randn(n, n, dtype=torch.bfloat16)), requires_grad=False)
            self.lora_a = nn.Parameter(torch.randn(rank, n) * 0.01)
            self.lora_b = nn.Parameter(torch.zeros(n, rank))

        def forward(self, x):
            return nf4.linear_nf4(x.bfloat16(), self.weight).float() + x @ self.lora_a.t() @ self.lora_b.t()

    model = NF4LoRA()
    opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    _fit_step(model, opt)

    n = model.weight.numel()
    # NF4 (torchao): 4-bit codes, an int8 scaler per 64 values, a bf16 factor per 256 scalers, a bf16 mean, 16 levels
    nf4_known = n // 2 + n // 64 + n // 64 // 256 * 2 + 2 + 16 * 2
    adapters = [model.lora_a, model.lora_b]
    state = model_state_bytes(model, opt)
    assert state.params == pytest.approx(nf4_known + _nbytes(adapters), rel=0.03)
    assert state.params < 0.4 * n * 2  # not the bf16 weight the subclass appears to be
    assert state.grads == _nbytes(adapters)  # the frozen base has no gradient
    assert state.optimizer == _adam_plain(adapters)


# ------------------------------------------------------------------------------------------- bitsandbytes


def test_bitsandbytes_8bit_adam_state():
    bnb = pytest.importorskip("bitsandbytes")
    model = _layer()
    opt = bnb.optim.AdamW8bit(model.parameters())
    _fit_step(model, opt)
    state = model_state_bytes(model, opt)
    assert state.optimizer == pytest.approx(_bnb_8bit_known(model), rel=0.03)
    assert state.notes == ()


def _bnb_8bit_known(model):
    """bitsandbytes' blockwise 8-bit Adam: per moment uint8 codes, an fp32 absmax per 256 values and a 256-entry
    fp32 code map; parameters under 4096 values keep 32-bit moments; the step is a Python int."""
    n = model.weight.numel()
    return 2 * (n + n // 256 * 4 + 256 * 4) + 2 * 4 * model.bias.numel()


def test_a_paged_optimizer_is_noted_and_its_managed_memory_stays_off_the_allocator_line():
    bnb = pytest.importorskip("bitsandbytes")
    model = _layer()
    opt = bnb.optim.PagedAdamW8bit(model.parameters())  # on a CPU it falls back to ordinary tensors
    _fit_step(model, opt)
    state = model_state_bytes(model, opt)
    assert state.optimizer == pytest.approx(_bnb_8bit_known(model), rel=0.03)
    assert state.notes and "PagedAdamW8bit" in state.notes[0] and "managed memory" in state.notes[0]
    ledger = build_ledger(model, opt, None)
    assert state.notes[0] in ledger.diagnosis()


def test_paged_state_is_counted_on_its_gpu_and_left_out_of_what_the_allocator_saw():
    """bitsandbytes' ``get_paged`` makes a CPU tensor over CUDA managed memory and marks it ``is_paged`` with its
    ``page_deviceid`` (what a CUDA run's paged state looks like; marked by hand here)."""
    model = _layer(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    _fit_step(model, opt, n_in=64)
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    for t in moments:
        t.is_paged, t.page_deviceid = True, 0
    state = model_state_bytes(model, opt, device="cuda:0")
    assert state.optimizer == state.paged == _nbytes(moments)
    assert state.host == _nbytes(model.parameters()) * 2 + 4 * 2  # weights, grads and steps are host tensors here
    reading = StepReading(activations=1000, peak_allocated=10 ** 6, peak_reserved=2 * 10 ** 6)
    ledger = build_ledger(model, opt, reading, device="cuda:0")
    assert ledger.other == 10 ** 6 - 1000  # the allocator never saw the paged state: nothing of it subtracted


def test_qlora_through_peft_counts_4bit_weights_with_their_quantisation_state_and_adapters_only():
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = bnb.nn.Linear4bit(512, 512, bias=False, quant_type="nf4", compute_dtype=torch.float32)
            self.o = nn.Linear(512, 16)

        def forward(self, x):
            return self.o(self.q(x))

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny().to("cpu"), peft.LoraConfig(r=8, target_modules=["q"]))  # .to quantises
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters)
    _fit_step(model, opt)

    n = 512 * 512
    # bitsandbytes NF4 with nested statistics: packed 4-bit codes, a uint8 absmax per 64 values, a 16-entry fp32
    # code map, an fp32 offset, and the absmax's own fp32 absmax per 256 and 256-entry fp32 code map
    four_bit = n // 2 + n // 64 + 16 * 4 + 4 + n // 64 // 256 * 4 + 256 * 4
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype != torch.uint8]
    state = model_state_bytes(model, opt)
    assert state.params == pytest.approx(four_bit + _nbytes(frozen) + _nbytes(adapters), rel=0.03)
    assert state.params >= four_bit + _nbytes(frozen) + _nbytes(adapters)
    assert state.grads == _nbytes(adapters)
    assert state.optimizer == _adam_plain(adapters)


# ------------------------------------------------------------------------------------------- frozen, LoRA, several


def test_lora_through_peft_has_gradients_and_state_for_its_adapters_only():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0", "2"]))
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(model.parameters())  # frozen parameters handed to the optimizer too
    _fit_step(model, opt, n_in=256)
    state = model_state_bytes(model, opt)
    assert state.params == _nbytes(model.parameters())
    assert state.grads == _nbytes(adapters) < state.params / 10
    assert state.optimizer == _adam_plain(adapters)


def test_a_frozen_embedding_has_no_gradient_or_state_lines():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Flatten(), nn.Linear(64 * 4, 8))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randint(0, 1000, (2, 4))).sum().backward()
        opt.step()
    trainable = list(model[2].parameters())
    state = model_state_bytes(model, opt)
    assert state.grads == _nbytes(trainable)
    assert state.optimizer == _adam_plain(trainable)


def test_several_optimizers_are_summed_muon_and_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    muon, adamw = torch.optim.Muon(matrices), torch.optim.AdamW(vectors)
    for _ in range(2):
        model(torch.randn(4, 128)).sum().backward()
        muon.step()
        adamw.step()
    state = model_state_bytes(model, [muon, adamw])
    assert state.optimizer == _nbytes(matrices) + _adam_plain(vectors)  # Muon: one momentum buffer per matrix
    assert state.optimizer == model_state_bytes(model, muon).optimizer + model_state_bytes(model, adamw).optimizer


# ------------------------------------------------------------------------------------------- host memory


def _cpu_offload_optimizer(model, minimal_size):
    """torchao's ``CPUOffloadOptimizer`` laid out as its constructor lays it out (a host copy of each weight of at
    least ``minimal_size`` values with a host gradient and its own AdamW over it; the small weights in one AdamW on
    the device), built without the constructor, which needs CUDA streams and pinned memory. The device is "meta"."""
    cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")
    opt = cpu_offload.CPUOffloadOptimizer.__new__(cpu_offload.CPUOffloadOptimizer)
    opt.minimal_size, opt.param_d2h_map, opt.optim_dict, opt.queue = minimal_size, {}, {}, {}
    retained = []
    for p in model.parameters():
        if p.numel() < minimal_size:
            retained.append(p)
            continue
        p_host = torch.zeros(p.shape)
        p_host.grad = torch.zeros_like(p_host)
        opt.param_d2h_map[p] = p_host
        opt.optim_dict[p] = torch.optim.AdamW([{"params": p_host}])
    opt.d_param_groups = [{"params": retained}]
    opt.d_opt = torch.optim.AdamW(opt.d_param_groups)
    return opt


def test_offloaded_optimizer_state_is_a_host_line_not_on_the_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).to("meta")
    opt = _cpu_offload_optimizer(model, minimal_size=1000)
    walk = ModelStateWalk()
    model(torch.randn(4, 64, device="meta")).sum().backward()
    before = walk(model, opt, device="meta")
    for p_host in opt.param_d2h_map.values():
        p_host.grad.normal_()
    for inner in opt.optim_dict.values():
        inner.step()
    opt.d_opt.step()
    after = walk(model, [opt], device="meta")
    assert after == model_state_bytes(model, opt, device="meta") != before  # the inner optimizers' new state seen

    big = [p for p in model.parameters() if p.numel() >= 1000]
    small = [p for p in model.parameters() if p.numel() < 1000]
    assert after.params == _nbytes(model.parameters()) and after.grads == after.params
    assert after.optimizer == _adam_plain(small, step_bytes=0)  # the device keeps the small weights' moments
    # host: each big weight's copy and gradient, its AdamW moments and step; the small weights' host steps
    assert after.host == sum(2 * _nbytes([p]) for p in big) + _adam_plain(big) + 4 * len(small)
    ledger = build_ledger(model, opt, None, device="meta", state=after)
    assert ledger.as_metrics()["memory/host_gib"] * 2 ** 30 == after.host
    assert "host" in str(ledger)
    assert model_state_bytes(model, opt, device="meta").optimizer < after.host / 10


@pytest.mark.gpu
def test_the_real_cpu_offload_optimizer_keeps_its_big_weights_state_on_the_host_line():
    """The real thing the test above lays out by hand: torchao's constructor (CUDA streams, pinned host copies),
    one step on the GPU. The big weights' moments, host copies and host gradients are the host line; the device
    keeps the small weights' moments only."""
    cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).cuda()
    opt = cpu_offload.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, minimal_size=1000)
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    state = model_state_bytes(model, opt, device="cuda")
    big = [p for p in model.parameters() if p.numel() >= 1000]
    small = [p for p in model.parameters() if p.numel() < 1000]
    assert state.optimizer == _adam_plain(small, step_bytes=0)
    assert state.host == sum(2 * _nbytes([p]) for p in big) + _adam_plain(big) + 4 * len(small)
