import pytest
import torch
from torch import nn

from lightning_ckpt.core.units import GiB, MiB
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.measure.ledger import LEDGER_LINES, Ledger, ModelStateWalk, build_ledger, model_state_bytes
from lightning_ckpt.measure.meter import StepMeter, StepReading


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _train_step(model, opt, idx):
    model(idx, idx)[1].backward()
    opt.step()


@pytest.fixture
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny()), torch.randint(0, 96, (2, 16))


def test_params_grads_and_adam_state_are_exact_sums(gpt):
    model, idx = gpt
    opt = torch.optim.Adam(model.parameters())
    params = list(model.parameters())  # the tied embedding/LM head appears once
    assert len(params) < len(model.state_dict())

    fresh = model_state_bytes(model, opt)
    assert fresh.params == _nbytes(params) == fresh.params_by_dtype["float32"]
    assert fresh.grads == 0 and fresh.optimizer == 0  # no grads yet; Adam allocates its state lazily

    model(idx, idx)[1].backward()
    after_backward = model_state_bytes(model, opt)
    assert after_backward.grads == _nbytes(p.grad for p in params)
    assert after_backward.optimizer == 0

    opt.step()
    stepped = model_state_bytes(model, [opt])
    state = _state_tensors(opt)
    assert stepped.optimizer == _nbytes(state) > 2 * stepped.params  # exp_avg + exp_avg_sq + step counters
    assert stepped.optimizer_by_dtype == {"float32": _nbytes(state)}
    assert stepped.master == 0

    opt.zero_grad(set_to_none=True)
    assert model_state_bytes(model, opt).grads == 0


def test_bf16_params_with_fp32_moments_and_a_master_copy_by_dtype():
    class MixedAdam(torch.optim.Optimizer):
        """bf16 weights, fp32 moments and an fp32 master copy kept in the state (as many mixed-precision
        optimizers do)."""

        def __init__(self, params, lr=1e-3):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    if not st:
                        st["master_param"] = p.detach().float().clone()
                        st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                        st["step"] = 0
                    g = p.grad.float()
                    st["exp_avg"].lerp_(g, 0.1)
                    st["exp_avg_sq"].lerp_(g * g, 0.001)
                    st["master_param"].add_(st["exp_avg"], alpha=-group["lr"])
                    p.copy_(st["master_param"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)
    opt = MixedAdam(model.parameters())
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    state = model_state_bytes(model, opt)
    assert state.params == 2 * n and state.params_by_dtype == {"bfloat16": 2 * n}
    assert state.grads == 2 * n and state.grads_by_dtype == {"bfloat16": 2 * n}
    assert state.optimizer == 3 * 4 * n and state.optimizer_by_dtype == {"float32": 3 * 4 * n}
    assert state.master == 4 * n and state.master_by_dtype == {"float32": 4 * n}


def test_torch_adam_on_bf16_params_keeps_bf16_moments():
    model = nn.Linear(16, 16).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    by_dtype = model_state_bytes(model, opt).optimizer_by_dtype
    assert by_dtype == {"bfloat16": 2 * 2 * n, "float32": 4 * len(list(model.parameters()))}  # + step scalars


def test_optimizer_stepping_fp32_clones_reports_them_as_master_copies():
    model = nn.Linear(8, 4).to(torch.float16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for m, p in zip(masters, model.parameters(), strict=True):
        m.grad = torch.ones_like(m)
        p.grad = torch.ones_like(p)
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    state = model_state_bytes(model, opt)
    assert state.params == 2 * n
    assert state.master == 4 * n  # the clones the optimizer owns
    assert state.optimizer == 4 * n + 4 * n  # clones + momentum buffers
    assert state.grads == 2 * n + 4 * n  # fp16 model grads + fp32 master grads


def test_shared_storage_counted_once_and_duck_typed_optimizers():
    a = nn.Linear(4, 4, bias=False)
    b = nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    class Wrapper:  # what Lightning's LightningOptimizer exposes
        state = opt.state
        param_groups = opt.param_groups

    state = model_state_bytes(model, Wrapper())
    assert state.params == 16 * 4 and state.grads == 16 * 4 and state.optimizer == 16 * 4
    assert model_state_bytes(model, None).optimizer == 0
    assert model_state_bytes(model, [opt], device="cpu").params == 64
    assert model_state_bytes(model, [opt], device=torch.device("cuda", 0)).params == 0  # other device: not counted


def test_ledger_on_cpu_has_no_allocator_lines(gpt):
    model, idx = gpt
    opt = torch.optim.AdamW(model.parameters())
    meter = StepMeter("cpu", model=model)
    _train_step(model, opt, idx)  # Adam state exists from now on
    meter.start_step()
    model(idx, idx)[1].backward()
    ledger = build_ledger(model, [opt], meter.stop_step())
    assert ledger.other is None and ledger.cache is None and ledger.peak_allocated is None
    assert ledger.activations > 0 and ledger.grads == ledger.params
    metrics = ledger.as_metrics()
    assert set(metrics) == {"memory/params_gib", "memory/grads_gib", "memory/optimizer_gib",
                            "memory/activations_gib"}
    assert metrics["memory/params_gib"] == ledger.params / GiB
    assert ledger.dominant() == "optimizer"
    assert "optimizer" in ledger.diagnosis() and "cannot help" in ledger.diagnosis()
    assert set(build_ledger(model, opt, None).lines()) == {"params", "grads", "optimizer"}


def test_ledger_arithmetic_with_allocator_counters():
    model = nn.Linear(256, 256)  # 257 KiB of fp32 params
    params = 256 * 257 * 4
    reading = StepReading(activations=36 * MiB, autocast_copies=4 * MiB, peak_allocated=50 * MiB,
                          peak_reserved=64 * MiB)
    ledger = build_ledger(model, [], reading, capacity=80 * MiB)
    assert ledger.other == 50 * MiB - params - 36 * MiB - 4 * MiB  # the copies are a line of their own
    assert ledger.cache == 14 * MiB and ledger.headroom == 16 * MiB
    assert ledger.dominant() == "activations" and "checkpointing" in ledger.diagnosis()
    assert tuple(ledger.lines()) == LEDGER_LINES
    metrics = ledger.as_metrics(prefix="mem")
    assert metrics["mem/peak_reserved_gib"] == 64 * MiB / GiB
    assert {"mem/other_gib", "mem/cache_gib", "mem/peak_allocated_gib", "mem/autocast_copies_gib"} <= set(metrics)
    assert metrics["mem/autocast_copies_gib"] == 4 * MiB / GiB
    assert "mem/optimizer_master_gib" not in metrics
    # lines that do not peak together never make "other" negative
    tight = build_ledger(model, [], StepReading(activations=50 * MiB, peak_allocated=50 * MiB))
    assert tight.other == 0 and tight.cache is None


def test_dominant_and_printing():
    ledger = Ledger(params=3, grads=3, optimizer=1, activations=2, master=1)
    assert ledger.dominant() == "params"  # ties go to the earlier line
    text = str(ledger)
    assert "params" in text and "(master)" in text
    assert Ledger(params=1, grads=0, optimizer=0, cache=5).dominant() == "cache"
    assert "fragmentation" in Ledger(params=1, grads=0, optimizer=0, cache=5).diagnosis()


def test_allocator_lines_not_comparable_are_left_out_with_the_reason():
    """Under CUDA graphs (``torch.compile(mode="reduce-overhead")``) the allocator's peaks count the graphs' memory
    pools, not the step: the ledger keeps the reason and leaves every allocator-derived line out (peaks, other,
    cache, the per-phase peaks), so no curve shows them as if they were comparable; the model-state lines and the
    activations stay."""
    model = nn.Linear(256, 256)
    reading = StepReading(activations=36 * MiB, autocast_copies=4 * MiB, peak_allocated=50 * MiB,
                          peak_reserved=64 * MiB, phase_peaks={"forward": 50 * MiB, "backward": 40 * MiB})
    note = "torch.compile(mode='reduce-overhead') runs CUDA graphs"
    ledger = build_ledger(model, [], reading, capacity=80 * MiB, allocator_note=note)
    assert ledger.allocator_note == note and not ledger.allocator_comparable
    assert (ledger.peak_allocated, ledger.peak_reserved, ledger.other, ledger.cache) == (None,) * 4
    assert ledger.phase_peaks is None and ledger.headroom is None
    assert set(ledger.as_metrics()) == {f"memory/{k}_gib" for k in
                                        ("params", "grads", "optimizer", "activations", "autocast_copies")}
    assert ledger.with_activations(30 * MiB).allocator_note == note
    comparable = build_ledger(model, [], reading, capacity=80 * MiB)
    assert comparable.allocator_comparable and comparable.allocator_note is None
    assert {"memory/peak_allocated_gib", "memory/peak_forward_gib"} <= set(comparable.as_metrics())
    from lightning_ckpt.decide.report import ledger_report

    report = ledger_report(ledger, "every:2", ("none", "every:2", "all"))
    assert report["allocator_comparable"] is False and report["peak_allocated"] is None
    assert any(note in line for line in report["advice"]) and not report["phases"]
    assert ledger_report(comparable, "every:2", ("none", "every:2", "all"))["allocator_comparable"] is True


def test_the_state_walk_reuses_its_figures_until_the_state_changes_and_always_agrees_with_a_fresh_walk(gpt):
    """A measured step's host cost was mostly this walk (4 ms of the 6 ms a step added on a 12-block GPT): it runs
    again only when the signature changes, and whatever it returns equals a fresh walk."""
    model, idx = gpt
    opt = torch.optim.AdamW(model.parameters())
    walk = ModelStateWalk()

    def check(walks):
        assert walk(model, [opt]) == model_state_bytes(model, [opt]) and walk.walks == walks

    check(1)  # no gradients, no state
    model(idx, idx)[1].backward()
    check(2)  # gradients appeared
    opt.step()
    check(3)  # AdamW created its state
    for _ in range(3):  # steady steps: set_to_none frees the gradients, backward makes new ones of the same sizes
        opt.zero_grad(set_to_none=True)
        _train_step(model, opt, idx)
        check(3)
    opt.zero_grad(set_to_none=True)
    check(4)  # no gradients
    _train_step(model, opt, idx)
    check(5)
    model.lm_head.weight.requires_grad_(False)  # tied with the embedding: frozen, its gradient dropped
    model.lm_head.weight.grad = None
    check(6)
    model.lm_head.weight.requires_grad_(True)
    second = torch.optim.SGD([nn.Parameter(torch.zeros(1000))], lr=0.1)  # an optimizer of its own parameter
    assert walk(model, [opt, second]) == model_state_bytes(model, [opt, second]) and walk.walks == 7
    model.half()  # dtypes changed in place: the same tensors, half the bytes
    check(8)
