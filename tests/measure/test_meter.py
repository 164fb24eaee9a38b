import statistics
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

from lightning_ckpt.core.replay import register_replay_hook, replay_hooks_active
from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.demos.gpt import GPT, GPTConfig
from lightning_ckpt.measure.meter import StepMeter, StepReading, cuda_peaks, device_capacity
from lightning_ckpt.measure.tokens import count_tokens

MiB = 2**20
GiB = 2**30
# small enough for MemTracker on a CPU in about a second per policy; the benchmark-size check is in the report
CFG = GPTConfig.tiny(n_layer=4, n_embd=64, n_head=4, vocab_size=96, block_size=64)
B, T = 2, 64


def _gpt(policy, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    apply_policy(model, policy)
    idx = torch.randint(0, CFG.vocab_size, (B, T))
    return model, idx


def _fwd_bwd(model, idx):
    loss = model(idx, idx)[1]  # logits die here, as in a training_step that returns the loss
    loss.backward()


def _measure(policy, exact=False, steps=2):
    model, idx = _gpt(policy)
    meter = StepMeter("cpu", model=model)
    readings = []
    for _ in range(steps):
        meter.start_step(exact=exact)
        _fwd_bwd(model, idx)
        readings.append(meter.stop_step())
        model.zero_grad(set_to_none=True)
    return readings


def _memtracker_act_peak(policy, attribute_replays=False):
    """Maximum over the step of MemTracker's ACT line (it only snapshots ACT at the *total* peak, so we watch it).

    ``attribute_replays``: MemTracker marks a replay as ACT only inside submodule calls it sees; our blocks
    replay their body directly, so ops in the body itself (residual adds) land in TEMP. This flags the whole
    replay as AC recomputation, which is what MemTracker's ACT is documented to count.
    """
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    if not hasattr(mem_tracker, "_MemRefType") or not hasattr(mem_tracker.MemTracker, "_update_peak_stats"):
        pytest.skip("this torch's MemTracker internals differ")

    class ActPeak(mem_tracker.MemTracker):
        act_peak = 0

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                self.act_peak = max(self.act_peak, snap.get(mem_tracker._MemRefType.ACT, 0))

    model, idx = _gpt(policy)
    mt = ActPeak()
    if not hasattr(mt, "_in_ac") or not hasattr(mt, "_ac_mod"):
        pytest.skip("this torch's MemTracker has no AC-region flags")
    mt.track_external(model, idx)

    def flag_replay(owner, fn, args, kwargs):
        block = owner.members[0].block if hasattr(owner, "members") else owner.block
        saved = mt._in_ac, mt._ac_mod
        mt._in_ac, mt._ac_mod = True, weakref.ref(block)
        try:
            return fn(*args, **kwargs)
        finally:
            mt._in_ac, mt._ac_mod = saved

    handle = register_replay_hook(flag_replay) if attribute_replays else None
    try:
        with mt:
            _fwd_bwd(model, idx)
    finally:
        if handle is not None:
            handle.remove()
    return mt.act_peak


# ------------------------------------------------------------------------------------ accuracy vs MemTracker


@pytest.mark.parametrize("policy", ["none", "every:2", "all"])
def test_default_figure_within_10_percent_of_memtracker(policy):
    reference = _memtracker_act_peak(policy)
    reading = _measure(policy)[-1]
    assert reading.activations is not None
    error = reading.activations / reference - 1
    print(f"{policy}: meter {reading.activations / MiB:.3f} MiB, MemTracker ACT {reference / MiB:.3f} MiB, "
          f"error {error:+.1%}")
    assert abs(error) <= 0.10


@pytest.mark.parametrize("policy", ["none", "every:2", "all", "group:2", "selective"])
def test_exact_mode_equals_memtracker_with_replays_attributed(policy):
    reference = _memtracker_act_peak(policy, attribute_replays=True)
    reading = _measure(policy, exact=True)[-1]
    assert reading.exact and reading.activations == reading.activations_exact
    assert reading.activations == pytest.approx(reference, rel=0.01)


@pytest.mark.parametrize("policy", ["all", "group:2"])
def test_default_adds_the_replay_interior(policy):
    """With replays attributed to ACT, the only gap left is forward transients, which are not at the peak."""
    reference = _memtracker_act_peak(policy, attribute_replays=True)
    default = _measure(policy)[-1].activations
    assert default == pytest.approx(reference, rel=0.02)


def test_without_the_replay_interior_the_figure_would_be_far_off():
    reading = _measure("all")[-1]
    saved_only = _measure_saved_only("all")
    assert reading.replays == CFG.n_layer
    assert saved_only < 0.7 * reading.activations


def _measure_saved_only(policy):
    model, idx = _gpt(policy)
    meter = StepMeter("cpu", model=model)
    meter.start_step()
    meter._replay_handle.remove()  # what the figure would be without the replay hook
    _fwd_bwd(model, idx)
    return meter.stop_step().activations


def test_figure_falls_with_checkpointing():
    none, every2, all_ = (_measure(p)[-1].activations for p in ("none", "every:2", "all"))
    assert none > every2 > all_ > 0


def test_calibration_happens_once_then_is_reused():
    model, idx = _gpt("all")
    meter = StepMeter("cpu", model=model)
    readings = []
    for _ in range(3):
        meter.start_step()
        _fwd_bwd(model, idx)
        readings.append(meter.stop_step())
    assert [r.replays for r in readings] == [CFG.n_layer] * 3
    assert [r.calibrations for r in readings] == [CFG.n_layer, 0, 0]
    assert len({r.activations for r in readings}) == 1
    assert meter.calibrated_regions == CFG.n_layer
    # new input shapes: measured again
    meter.start_step()
    _fwd_bwd(model, idx[:, : T // 2])
    half = meter.stop_step()
    assert half.calibrations == CFG.n_layer
    assert half.activations < readings[0].activations
    meter.forget_calibration()
    assert meter.calibrated_regions == 0


def test_group_region_is_one_replay():
    reading = _measure("group:2")[-1]
    assert reading.replays == CFG.n_layer // 2


# ------------------------------------------------------------------------------------- exactness, small cases


class _TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.register_buffer("scale", torch.full((32,), 2.0))

    def forward(self, x):
        h = torch.relu(self.fc1(x))  # relu saves its output (4x32 fp32 = 512 B)
        h = h * self.scale  # mul saves the buffer (excluded) and h (already counted)
        return self.fc2(h)  # fc2 saves its input (the product: 512 B); weights are parameters


def test_saved_bytes_are_exact_deduplicated_and_exclude_parameters_and_buffers():
    torch.manual_seed(0)
    model = _TwoLayer()
    x = torch.randn(4, 16)  # input without grad: fc1 saves it for the weight gradient (256 B)
    meter = StepMeter("cpu", model=model)
    meter.start_step()
    model(x).sum().backward()
    reading = meter.stop_step()
    assert reading.activations == 256 + 512 + 512
    # without watching the model, the buffer counts
    meter = StepMeter("cpu")
    meter.start_step()
    model(x).sum().backward()
    assert meter.stop_step().activations == 256 + 512 + 512 + 128


def test_live_total_drops_as_backward_frees():
    model, idx = _gpt("none")
    meter = StepMeter("cpu", model=model)
    meter.start_step()
    loss = model(idx, idx)[1]
    after_forward = meter._saved.live
    loss.backward()
    del loss
    after_backward = meter._saved.live
    reading = meter.stop_step()
    assert reading.activations == after_forward > 0
    assert after_backward <= idx.numel() * idx.element_size()  # only the batch the caller still holds


def test_gradient_accumulation_peaks_over_micro_batches():
    model, idx = _gpt("every:2")
    meter = StepMeter("cpu", model=model)
    one = _measure("every:2")[-1].activations
    meter.start_step()
    for _ in range(3):  # sequential micro-batches: the peak is one micro-batch's
        _fwd_bwd(model, idx)
    sequential = meter.stop_step()
    meter.start_step()
    losses = [model(idx, idx)[1] for _ in range(2)]  # both graphs alive at once
    sum(losses).backward()
    together = meter.stop_step()
    assert sequential.activations == one
    assert together.activations == pytest.approx(2 * one, rel=0.02)


def test_exact_mode_ignores_the_optimizer_step():
    model, idx = _gpt("all")
    opt = torch.optim.Adam(model.parameters())
    meter = StepMeter("cpu", model=model)
    figures = []
    for _ in range(2):
        meter.start_step(exact=True)
        _fwd_bwd(model, idx)
        opt.step()  # creates Adam's state on the first call: not an activation
        opt.zero_grad(set_to_none=True)
        figures.append(meter.stop_step().activations)
    assert figures[0] == figures[1]


# ---------------------------------------------------------------------------------------------- lifecycle


def _hooks_clean():
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None and not replay_hooks_active()


def test_no_fake_zeros_on_cpu():
    reading = _measure("none", steps=1)[0]
    assert reading.peak_allocated is None and reading.peak_reserved is None and reading.cache is None
    assert reading.activations > 0 and reading.activations_exact is None and not reading.exact


def test_hooks_are_removed_after_stop_and_on_error():
    model, idx = _gpt("all")
    meter = StepMeter("cpu", model=model)
    meter.start_step()
    assert not _hooks_clean()
    _fwd_bwd(model, idx)
    meter.stop_step()
    assert _hooks_clean()
    with pytest.raises(ZeroDivisionError):
        with meter.step(exact=True):
            model(idx, idx)
            raise ZeroDivisionError
    assert _hooks_clean() and not meter.is_open
    with meter.step() as box:
        _fwd_bwd(model, idx)
    assert isinstance(box.reading, StepReading) and box.reading is meter.last
    assert _hooks_clean()


def test_activations_off_installs_nothing():
    model, idx = _gpt("all")
    meter = StepMeter("cpu", model=model)
    meter.start_step(activations=False)
    assert _hooks_clean()
    _fwd_bwd(model, idx)
    reading = meter.stop_step()
    assert reading.activations is None and reading.replays == 0


def test_start_twice_warns_and_stop_without_start_raises():
    meter = StepMeter("cpu")
    meter.start_step()
    with pytest.warns(RuntimeWarning, match="discarded"):
        meter.start_step()
    meter.stop_step()
    assert _hooks_clean()
    with pytest.raises(RuntimeError, match="start_step"):
        meter.stop_step()
    with pytest.raises(TypeError, match="exact"):
        StepMeter("cpu", exact="yes")


def test_replay_hook_sees_replays_only():
    model, idx = _gpt("every:2")
    seen = []

    def hook(owner, fn, args, kwargs):
        seen.append((owner.index, owner.mode))
        return fn(*args, **kwargs)

    with register_replay_hook(hook):
        loss = model(idx, idx)[1]
        assert seen == []  # the first forward of a region is not a replay
        loss.backward()
    assert sorted(seen) == [(0, "recompute"), (2, "recompute")]
    assert not replay_hooks_active()
    with pytest.raises(TypeError, match="not callable"):
        register_replay_hook(42)


def test_meter_overhead_is_reported(record_property):
    """Alternating steps with and without the default meter; the ratio is recorded, never asserted (CI noise)."""
    model, idx = _gpt("every:2")
    meter = StepMeter("cpu", model=model)

    def step(measure):
        t = time.process_time()
        if measure:
            meter.start_step()
        _fwd_bwd(model, idx)
        reading = meter.stop_step() if measure else None
        model.zero_grad(set_to_none=True)
        return time.process_time() - t, reading

    step(True)  # calibration
    on, off, figures = [], [], set()
    for i in range(20):
        order = (True, False) if i % 2 else (False, True)
        for measure in order:
            dt, reading = step(measure)
            (on if measure else off).append(dt)
            if reading is not None:
                figures.add(reading.activations)
    ratio = statistics.median(on) / statistics.median(off)
    record_property("meter_overhead_ratio", round(ratio, 4))
    print(f"default meter: median step {statistics.median(off) * 1e3:.2f} ms without, ratio {ratio:.3f} with")
    assert len(figures) == 1  # every measured step read the same activation peak


# ----------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_peaks_are_the_allocator_peaks_of_the_step():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    apply_policy(model, "all")
    idx = torch.randint(0, CFG.vocab_size, (B, T), device=device)
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=device)  # an earlier peak the reset must forget
    del big
    meter = StepMeter(device, model=model)
    meter.start_step()
    _fwd_bwd(model, idx)
    reading = meter.stop_step()
    assert reading.peak_allocated == torch.cuda.max_memory_allocated(device)
    assert reading.peak_reserved == torch.cuda.max_memory_reserved(device)
    assert (reading.peak_allocated, reading.peak_reserved) == cuda_peaks(device)
    assert 0 < reading.peak_allocated < 256 * MiB
    assert reading.cache == reading.peak_reserved - reading.peak_allocated >= 0
    assert 0 < reading.activations < reading.peak_allocated
    assert reading.replays == CFG.n_layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask = torch.ones(B, T, dtype=torch.long, device=device)
        tokens = count_tokens({"input_ids": idx, "attention_mask": mask})
    assert isinstance(tokens, torch.Tensor) and int(tokens) == B * T  # counted on the device, no sync


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("policy", ["none", "all"])
def test_phase_peaks_equal_memtracker_per_phase(policy, foreach):
    """Steady state (second step; moments exist, last step's gradients live through the forward, as in Lightning,
    whose zero_grad runs between training_step and backward): each phase's peak equals MemTracker's Total."""
    from _independent import benchmark_common

    from lightning_ckpt.measure.ledger import state_tensors

    model, idx = _gpt(policy)
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    held = {}

    def forward():
        held["loss"] = model(idx, idx)[1]
        opt.zero_grad(set_to_none=True)

    def backward():
        held.pop("loss").backward()

    for _ in range(2):
        forward(), backward(), opt.step()
    reference = benchmark_common().measure_phase_peaks(
        [("forward", forward), ("backward", backward), ("optimizer", opt.step)], external=(model, opt, idx))
    meter = StepMeter("cpu", model=model)
    meter.start_step(exact=True, state=[*state_tensors(model, [opt]), idx])
    forward()
    meter.phase("backward")
    backward()
    meter.phase("optimizer")
    opt.step()
    reading = meter.stop_step()
    assert reading.phase_peaks == reference
    # without checkpointing the step peaks in the forward; with it, backward (replay + gradients) overtakes the
    # forward, and foreach AdamW's temporaries make the optimizer step the highest
    expected = "forward" if policy == "none" else "optimizer" if foreach else "backward"
    assert max(reading.phase_peaks, key=reading.phase_peaks.get) == expected


def test_phase_peaks_are_reused_from_the_reference_step_of_the_key():
    model, idx = _gpt("all")
    meter = StepMeter("cpu", model=model)
    readings = []
    for _ in range(2):
        meter.start_step(key="k", state=list(model.parameters()))
        loss = model(idx, idx)[1]
        meter.phase("backward")
        loss.backward()
        del loss
        readings.append(meter.stop_step())
        model.zero_grad(set_to_none=True)
    assert readings[0].reference and set(readings[0].phase_peaks) == {"forward", "backward"}
    assert readings[1].phase_peaks == readings[0].phase_peaks
    params = sum(p.numel() * 4 for p in model.parameters())
    # the activation peak is the replay in backward, where it sits on top of the parameters
    assert readings[0].phase_peaks["backward"] >= params + readings[0].activations


def test_without_phase_boundaries_there_are_no_phase_peaks():
    model, idx = _gpt("all")
    meter = StepMeter("cpu", model=model)
    with meter.step(exact=True, state=list(model.parameters())) as box:
        _fwd_bwd(model, idx)
    assert box.reading.phase_peaks is None and box.reading.activations > 0


def test_a_step_with_recompute_hidden_in_compiled_graphs_reports_its_reference_figure():
    """``hidden_recompute`` (blocks under the compiler's own budget): the saved-tensor figure would miss the recompute
    inside the compiled backward, so the step reports its reference step's (eager) figure and says so."""
    model, idx = _gpt("none")
    meter = StepMeter("cpu", model=model)
    readings = []
    for hidden in (False, False, True):
        with meter.step(key="k", hidden_recompute=hidden) as box:
            _fwd_bwd(model, idx)
        readings.append(box.reading)
    reference, seen, hidden = readings
    assert reference.reference and reference.eager_figure  # exact steps run eagerly
    assert not seen.reference and not seen.eager_figure
    assert seen.activations == seen.activations_estimate + reference.activations - reference.activations_estimate
    assert hidden.eager_figure and hidden.activations == reference.activations


def test_the_allocator_counter_is_left_holding_the_last_phase_after_a_step(monkeypatch):
    """The meter restarts the allocator's peak counters at each phase boundary but not when the step stops, so
    ``torch.cuda.max_memory_allocated()`` read after a step is the step's last phase (the whole step when no phase
    was marked): what tools and tests reading torch's own counter compare with (CUDA counters faked on the CPU)."""
    from lightning_ckpt.measure import meter as meter_module

    counter = {"allocated": 0, "reserved": 0, "resets": 0}

    def reset(device=None):
        counter.update(allocated=0, reserved=0, resets=counter["resets"] + 1)

    monkeypatch.setattr(meter_module, "_has_allocator_counters", lambda device: True)
    monkeypatch.setattr(meter_module, "cuda_peaks", lambda device: (counter["allocated"], counter["reserved"]))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    meter = StepMeter("cpu")

    def allocate(peak):
        counter["allocated"] = max(counter["allocated"], peak)
        counter["reserved"] = max(counter["reserved"], peak + 1)

    meter.start_step(activations=False)
    allocate(7)
    reading = meter.stop_step()
    assert reading.peak_allocated == 7 and counter["allocated"] == 7 and counter["resets"] == 1

    meter.start_step(activations=False)
    allocate(5)
    meter.phase("backward")
    allocate(9)
    meter.phase("optimizer")
    allocate(3)
    reading = meter.stop_step()
    assert reading.phase_peaks == {"forward": 5, "backward": 9, "optimizer": 3}
    assert reading.peak_allocated == 9 and reading.peak_reserved == 10
    assert counter["allocated"] == 3  # the optimizer phase's peak, not reset by stop_step
    assert counter["resets"] == 1 + 3  # start, two boundaries


# ------------------------------------------------------------------------------- replay interiors: grad mode only


class _GatheringBlock(nn.Module):
    """A block whose forward holds a buffer made under ``no_grad`` until it returns, as FSDP2's all-gathered
    parameters are inside a sharded block: memory of the block's weights, not activations."""

    def __init__(self, held: int) -> None:
        super().__init__()
        self.a, self.b, self.held = nn.Linear(32, 64), nn.Linear(64, 32), held

    def forward(self, x):
        if self.held:
            with torch.no_grad():
                gathered = torch.ones(self.held)  # noqa: F841 - alive (a local) until the block returns
        return x + self.b(torch.relu(self.a(x)))


class _Stack(nn.Module):
    def __init__(self, held: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_GatheringBlock(held) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _replay_interior(held: int, exact: bool):
    torch.manual_seed(0)
    model = _Stack(held)
    apply_policy(model, "all", blocks=_GatheringBlock)
    x = torch.randn(8, 32, requires_grad=True)
    meter = StepMeter("cpu", model=model)
    readings = []
    for _ in range(2):  # a calibration step, then one that reuses the interiors
        meter.start_step(exact=exact)
        model(x).sum().backward()
        readings.append(meter.stop_step())
    assert [r.replays for r in readings] == [2, 2]
    return meter.largest_replay_interior, [r.activations for r in readings]


@pytest.mark.parametrize("exact", [False, True])
def test_a_replay_interior_leaves_out_what_the_block_allocates_under_no_grad(exact):
    """A 4 MiB buffer made under ``no_grad`` inside each replayed block is not part of the replay's interior, nor of
    the activation figure: both are the same as for the same block without it (on the old code the interior, which
    counted every storage the replay created, was 4 MiB larger)."""
    plain_interior, plain = _replay_interior(0, exact)
    held_interior, held = _replay_interior(2**20, exact)
    assert 0 < plain_interior < 4 * MiB
    assert held_interior == plain_interior
    assert held == plain


# -------------------------------------------------------------------------------------------- device capacity


class _FakeCudaMemory:
    """The CUDA queries ``device_capacity`` makes, with figures chosen by the test."""

    def __init__(self, total, free, reserved, fraction):
        self.total, self.free, self.reserved, self.fraction = total, free, reserved, fraction
        self.asked = []

    def mem_get_info(self, index):
        self.asked.append(("mem_get_info", index))
        return self.free, self.total

    def memory_reserved(self, index):
        self.asked.append(("memory_reserved", index))
        return self.reserved

    def memory_fraction(self, index):
        self.asked.append(("memory_fraction", index))
        return self.fraction



@pytest.mark.parametrize(("total", "free", "reserved", "fraction", "want"), [
    (80 * GiB, 70 * GiB, 6 * GiB, 0.5, 40 * GiB),  # the fraction binds
    (80 * GiB, 70 * GiB, 6 * GiB, 1.0, 76 * GiB),  # the CUDA context and other processes hold 4 GiB
    (80 * GiB, 20 * GiB, 6 * GiB, 0.9, 26 * GiB),  # another process holds most of the card
    (80 * GiB, 70 * GiB, 6 * GiB, None, 76 * GiB),  # a torch without the fraction API: free + reserved
])
def test_capacity_is_the_smaller_of_the_fraction_of_total_and_free_plus_reserved(total, free, reserved, fraction,
                                                                                  want):
    """Before, ``device_capacity`` was the card's total memory, whatever the context, NCCL, other processes or a
    memory fraction left (the first three rows would read 80 GiB)."""
    queries = _FakeCudaMemory(total, free, reserved, fraction)
    assert device_capacity(torch.device("cuda", 3), queries=queries) == want
    assert {index for _, index in queries.asked} == {3}
    assert device_capacity("cpu", queries=queries) is None


@pytest.mark.gpu
def test_capacity_follows_the_per_process_memory_fraction_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    plain = device_capacity(device)
    # the CUDA context alone holds memory outside the allocator: what the run can use is below the card's total
    assert torch.cuda.memory_reserved(device) <= plain < torch.cuda.get_device_properties(device).total_memory
    assert plain <= free + torch.cuda.memory_reserved(device) + 64 * MiB  # allow for others' allocations in between
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        pytest.skip("this torch cannot read the memory fraction back (device_capacity then uses free + reserved)")
    torch.cuda.set_per_process_memory_fraction(0.25, device)
    try:
        limited = device_capacity(device)
        free, total = torch.cuda.mem_get_info(device)
        assert limited <= int(0.25 * total)
        assert abs(limited - min(int(0.25 * total), free + torch.cuda.memory_reserved(device))) <= 64 * MiB
        # the allocator refuses what the capacity says is not there
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(limited + 256 * MiB, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------ a step started over (a retried step)


def _fake_allocator(monkeypatch):
    """CUDA's peak counters, faked on the CPU: ``allocate(peak)`` raises the running peaks."""
    from lightning_ckpt.measure import meter as meter_module

    counter = {"allocated": 0, "reserved": 0}
    monkeypatch.setattr(meter_module, "_has_allocator_counters", lambda device: True)
    monkeypatch.setattr(meter_module, "cuda_peaks", lambda device: (counter["allocated"], counter["reserved"]))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: counter.update(allocated=0,
                                                                                                   reserved=0))

    def allocate(peak):
        counter["allocated"] = max(counter["allocated"], peak)
        counter["reserved"] = max(counter["reserved"], peak + 1)

    return allocate


def test_a_restarted_step_reports_the_retry_alone_under_its_new_key(monkeypatch):
    """A step that failed in its backward and is started over: the failed attempt's allocator and phase peaks are
    gone, the retry's forward is the forward phase again, its saved-tensor count is the retry's, and it is the
    reference step of the key it was restarted under, never of the one it started with."""
    allocate = _fake_allocator(monkeypatch)
    model, idx = _gpt("all")
    meter = StepMeter("cpu", model=model)
    meter.start_step(key="old plan")
    loss = model(idx, idx)[1]
    allocate(900)
    meter.phase("backward")
    allocate(1000)  # the failed attempt's backward: its peak must not be the retry's
    del loss
    meter.restart_step(key="new plan")
    assert meter.key == "new plan" and meter._phase == "forward"
    allocate(500)
    loss = model(idx, idx)[1]
    meter.phase("backward")
    allocate(600)
    loss.backward()
    reading = meter.stop_step()
    assert reading.phase_peaks == {"forward": 500, "backward": 600}
    assert (reading.peak_allocated, reading.peak_reserved) == (600, 601)
    assert reading.reference and meter.has_reference("new plan") and not meter.has_reference("old plan")
    model.zero_grad(set_to_none=True)
    with meter.step(key="new plan") as box:  # the same plan again, measured cheaply: the same figure
        _fwd_bwd(model, idx)
    assert box.reading.activations == reading.activations and not box.reading.reference


class _FailingMLP(nn.Module):
    """Wraps a block's MLP: raises out-of-memory once while ``armed`` and replayed (grad on, in backward)."""

    def __init__(self, mlp):
        super().__init__()
        self.inner, self.armed = mlp, False

    def forward(self, x):
        if self.armed and torch.is_grad_enabled() and torch._C._current_autograd_node() is not None:
            self.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected in a replay)")
        return self.inner(x)


def test_a_restarted_step_measures_again_the_replay_interiors_an_error_cut_short():
    """An error inside a replay being calibrated stores the part of the interior it reached (the replay hook's
    ``finally`` cannot tell it from checkpoint's early stop); started over, the step measures its interiors
    again, so the next step's figure is a clean run's."""

    def run(fail: bool):
        model, idx = _gpt("all")
        last = model.transformer.h[-1]
        last.mlp = _FailingMLP(last.mlp)
        meter = StepMeter("cpu", model=model)
        readings = []
        meter.start_step()  # a default-mode step: the interiors are calibrated on their first replay
        if fail:
            last.mlp.armed = True
            with pytest.raises(torch.OutOfMemoryError):
                _fwd_bwd(model, idx)
            model.zero_grad(set_to_none=True)
            partial = meter.largest_replay_interior
            meter.restart_step()
        _fwd_bwd(model, idx)
        readings.append(meter.stop_step())
        model.zero_grad(set_to_none=True)
        with meter.step() as box:  # reuses the interiors
            _fwd_bwd(model, idx)
        readings.append(box.reading)
        return readings, (partial if fail else meter.largest_replay_interior)

    (clean, clean_next), interior = run(False)
    (retried, retried_next), partial = run(True)
    assert partial < interior  # the error left a partial interior behind
    assert retried.activations == clean.activations and retried.calibrations == clean.calibrations
    assert retried_next.activations == clean_next.activations


def test_a_graph_never_backpropagated_is_freed_while_the_meter_counts():
    """The meter's pack hook keeps a detached alias of a saved tensor with history: kept as it is, a saved output
    (``exp``) holds its own autograd node, a cycle only its backward breaks, so a forward that ran out of memory
    (or a grad-enabled computation for a log) would never be freed while measured. Still counted while the graph
    holds it."""
    meter = StepMeter("cpu")
    x = torch.randn(1000, requires_grad=True)
    meter.start_step()
    y = (x * 2).exp()  # exp saves its output
    held = y.sum()
    ref = weakref.ref(y)
    del y
    assert meter.live_saved_bytes() == 4000  # y's storage, held by the graph for exp's backward
    del held
    assert ref() is None and meter.live_saved_bytes() == 0  # the graph is gone, without gc and without backward
    y = (x * 2).exp()
    y.sum().backward()  # the alias is what backward unpacks: the gradient is exp's
    torch.testing.assert_close(x.grad, 2 * (2 * x).exp().detach())
    meter.stop_step()
