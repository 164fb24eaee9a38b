"""Step time and throughput of :class:`lightning_ckpt.measure.monitor.StepMonitor` on an asynchronous device.

On CUDA a step's time comes from CUDA events recorded at the step's start and end and is read (one
``event.synchronize()``) only on steps whose figures are read. On the CPU the same code runs with a fake event
clock (:class:`FakeDevice`): the device runs the work the host enqueued at its own pace, an event completes when
the device reaches it, reading an unfinished event is an error (as ``cudaEventElapsedTime`` is), and every
synchronization is counted. The GPU-marked tests check the real events against a synchronized host timing.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_ckpt.measure.clock import EventClock, HostClock, clock_for
from lightning_ckpt.measure.monitor import StepMonitor, StepResult


class FakeDevice:
    """A device that runs enqueued work in order, ``seconds`` of device time per piece, while the host runs ahead."""

    def __init__(self) -> None:
        self.queued_until = 0.0  # device time at which all enqueued work is done
        self.done_until = 0.0  # what the host has waited for so far
        self.synchronizations = 0
        self.events = 0

    def run(self, seconds: float) -> None:
        self.queued_until += seconds

    def event(self) -> "FakeEvent":
        self.events += 1
        return FakeEvent(self)


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on a :class:`FakeDevice`."""

    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at = device, None

    def record(self, stream=None) -> None:
        self.at = self.device.queued_until

    def synchronize(self) -> None:
        self.device.synchronizations += 1
        self.device.done_until = max(self.device.done_until, self.at)

    def query(self) -> bool:
        return self.at <= self.device.done_until

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")  # what CUDA says for an unfinished event
        return (end.at - self.at) * 1e3


def _monitor(device: FakeDevice, capturing=lambda: False) -> StepMonitor:
    clock = EventClock("cuda", new_event=device.event, stream=lambda: None, capturing=capturing)
    return StepMonitor("cpu", clock=clock)


def _step(monitor: StepMonitor, device: FakeDevice, seconds: float, read: bool) -> StepResult:
    monitor.begin_step(measure=False, tokens=read)
    monitor.add_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    device.run(seconds)  # the step's kernels: enqueued in no host time, run later on the device
    return monitor.end_step(nn.Linear(1, 1), [], 0)


def test_step_time_is_the_devices_and_read_only_on_steps_whose_figures_are_read():
    """The device takes 0.5 s per step while the host enqueues in microseconds: a host interval of one step (the old
    ``perf_counter`` figure) would read microseconds; the event interval reads 0.5 s. Quiet steps record no event
    and synchronize nothing; a read step records two (its start and end) and synchronizes once."""
    device = FakeDevice()
    monitor = _monitor(device)
    kinds = [False, False, True, False, True, True]
    results = []
    for read in kinds:
        before = device.synchronizations
        results.append(_step(monitor, device, 0.5, read))
        assert device.synchronizations - before == (1 if read else 0)
    for read, result in zip(kinds, results):
        if read:
            assert result.step_s == pytest.approx(0.5, abs=1e-12)
            assert result.tokens == 16 and result.tokens_per_sec == pytest.approx(32.0)
            assert result.metrics()["time/step_s"] == pytest.approx(0.5, abs=1e-12)
        else:  # not read: no figure, rather than a host figure that looks like one
            assert result.step_s is None and result.tokens is None
            assert "time/step_s" not in result.metrics() and "throughput/tokens_per_sec" not in result.metrics()
    assert device.events == 2 * sum(kinds)


def test_an_image_step_logs_samples_per_second_and_no_tokens_per_second():
    """Image batches have no tokens (:mod:`lightning_ckpt.measure.tokens`): the step logs samples/s only, and
    ``tokens_fn`` brings tokens/s back."""
    for tokens_fn, tokens in ((None, None), (lambda batch: 196 * len(batch[0]), 2 * 196 * 4)):
        device = FakeDevice()
        monitor = _monitor(device)
        monitor.tokens_fn = tokens_fn
        monitor.begin_step(measure=False, tokens=True)
        for _ in range(2):  # two micro-batches of 4 images
            monitor.add_batch((torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))))
        device.run(0.5)
        result = monitor.end_step(nn.Linear(1, 1), [], 0)
        metrics = result.metrics()
        assert result.tokens == tokens and result.samples == 8
        assert metrics["throughput/samples_per_sec"] == pytest.approx(16.0)
        assert metrics["time/step_s"] == pytest.approx(0.5, abs=1e-12)
        if tokens is None:
            assert "throughput/tokens_per_sec" not in metrics
        else:
            assert metrics["throughput/tokens_per_sec"] == pytest.approx(tokens / 0.5)


@pytest.mark.parametrize("read_before", [False, True])
def test_what_runs_between_two_steps_is_no_step_s_time(read_before):
    """Between two steps a checkpoint is saved (``ModelCheckpoint`` runs after the callback's batch end) and
    validation runs (paused or not): 2 s of device time that are the next step's on the old code, which timed a step
    from the previous step's end (2.5 s read for a 0.5 s step)."""
    device = FakeDevice()
    monitor = _monitor(device)
    _step(monitor, device, 0.5, read=read_before)
    device.run(1.5)  # the save
    monitor.pause()
    device.run(0.5)  # validation between the steps
    monitor.resume()
    assert _step(monitor, device, 0.5, read=True).step_s == pytest.approx(0.5, abs=1e-12)


def test_pauses_inside_a_step_are_cut_out_on_the_device_timeline():
    """Validation inside an accumulation window: the paused intervals are cut, read after the same one wait; a pause
    still open when the step ends is cut up to its end."""
    device = FakeDevice()
    monitor = _monitor(device)
    monitor.begin_step(measure=False, tokens=True)
    device.run(0.1)  # the first micro-batch
    monitor.pause()
    device.run(3.0)  # validation
    monitor.resume()
    device.run(0.2)  # the second micro-batch
    monitor.pause()
    device.run(1.0)  # a second pause in the same step
    monitor.resume()
    device.run(0.4)
    before = device.synchronizations
    result = monitor.end_step(nn.Linear(1, 1), [], 0)
    assert device.synchronizations - before == 1
    assert result.step_s == pytest.approx(0.7, abs=1e-12)
    monitor.begin_step(measure=False, tokens=True)
    device.run(0.5)
    monitor.pause()
    device.run(5.0)
    assert monitor.end_step(nn.Linear(1, 1), [], 0).step_s == pytest.approx(0.5, abs=1e-12)


def test_an_instrumented_step_owes_its_figures_to_the_next_ordinary_one():
    """An exact reference step (the first of its key) or a step run eagerly for block hooks is ``instrumented``;
    with ``owed`` set, the next step counts and is timed though it is not a logging step."""
    model = nn.Linear(4, 4)
    monitor = StepMonitor("cpu")
    monitor.watch(model)
    for kwargs, instrumented in (({"key": "k"}, True), ({"key": "k"}, False), ({"eager": True}, True)):
        monitor.begin_step(measure=True, tokens=True, **kwargs)
        monitor.add_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        result = monitor.end_step(model, [], 0)
        assert result.instrumented is instrumented and result.step_s is not None
        assert result.reading.exact is (kwargs.get("key") == "k" and instrumented)
    quiet = _step(monitor, FakeDevice(), 0.5, read=False)
    assert quiet.step_s is None and quiet.tokens is None and not quiet.instrumented
    monitor.owed = True
    owed = _step(monitor, FakeDevice(), 0.5, read=False)  # not a logging step, timed for the owed figures
    assert owed.step_s is not None and owed.tokens == 16 and not owed.instrumented


def test_a_step_recorded_while_the_stream_is_capturing_has_no_time():
    """Inside a CUDA graph capture an event record would become part of the graph: no mark, and no step time."""
    device = FakeDevice()
    capturing = {"now": False}
    monitor = _monitor(device, capturing=lambda: capturing["now"])
    _step(monitor, device, 0.5, read=False)
    capturing["now"] = True
    assert _step(monitor, device, 0.5, read=True).step_s is None
    capturing["now"] = False
    assert _step(monitor, device, 0.5, read=True).step_s == pytest.approx(0.5, abs=1e-12)  # its own start


def test_the_default_clock_is_the_host_on_the_cpu_and_events_on_cuda():
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), EventClock)  # built without touching CUDA
    host = _monitor_host()
    host.begin_step(measure=False, tokens=True)
    time.sleep(0.02)
    result = host.end_step(nn.Linear(1, 1), [], 0)
    assert result.step_s >= 0.02


def _monitor_host() -> StepMonitor:
    return StepMonitor("cpu")


def test_abort_forgets_the_open_interval():
    device = FakeDevice()
    monitor = _monitor(device)
    _step(monitor, device, 0.5, read=False)
    device.run(4.0)  # an exception, handled outside any step
    monitor.abort()
    assert _step(monitor, device, 0.5, read=True).step_s == pytest.approx(0.5, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------- GPU


_CYCLES_PER_MS = []


def _busy(ms: float) -> None:
    """About ``ms`` milliseconds of device time in one kernel (``torch.cuda._sleep`` spins for a cycle count, here
    calibrated once against a synchronized host clock)."""
    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(50_000_000)
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(50_000_000 / ((time.perf_counter() - t0) * 1e3))
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


@pytest.mark.gpu
def test_event_timed_steps_agree_with_a_synchronized_host_timing_on_cuda():
    """Each step is one ~30 ms kernel the host enqueues in microseconds. The host timing synchronizes before and after
    each step; the monitor's event figure must agree with it (within 10 % + 2 ms: both include whatever else runs
    on a busy GPU), while the host interval of the unsynchronized enqueue (what ``perf_counter`` read before) is a
    small part of it."""
    _busy(1)  # calibrated outside the timed steps
    monitor = StepMonitor("cuda")
    host, enqueue, events = [], [], []
    torch.cuda.synchronize()
    monitor.begin_step(measure=False, tokens=True)  # a first step outside the timed ones
    monitor.end_step(nn.Linear(1, 1), [], 0)
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        monitor.begin_step(measure=False, tokens=True)
        _busy(30)
        t1 = time.perf_counter()
        result = monitor.end_step(nn.Linear(1, 1), [], 0)
        torch.cuda.synchronize()
        host.append(time.perf_counter() - t0)
        enqueue.append(t1 - t0)
        events.append(result.step_s)
    for h, e, q in zip(host, events, enqueue):
        assert abs(e - h) <= 0.1 * h + 2e-3, (e, h)
        assert q < 0.5 * e, (q, e)


@pytest.mark.gpu
def test_quiet_steps_never_synchronize_on_cuda(monkeypatch):
    """``set_sync_debug_mode("error")`` on quiet steps (no blocking copy, no ``.item()``), and no event waited for
    (``Event.synchronize`` counted: the debug mode does not see event waits); a read step waits once."""
    waits = {"n": 0}
    original = torch.cuda.Event.synchronize

    def counted(self):
        waits["n"] += 1
        return original(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    monitor = StepMonitor("cuda")
    x = torch.randn(1024, 1024, device="cuda")
    for read in (False, False, True, False):
        before = waits["n"]
        torch.cuda.set_sync_debug_mode("default" if read else "error")
        try:
            monitor.begin_step(measure=False, tokens=read)
            monitor.add_batch({"input_ids": x})
            for _ in range(20):
                x = x @ x / 1024
            result = monitor.end_step(nn.Linear(1, 1), [], 0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert waits["n"] - before == (1 if read else 0)
        assert (result.step_s is not None) == read


def test_steady_measured_steps_reuse_the_model_state_walk(monkeypatch):
    """Each ledger used to walk every parameter, gradient and optimizer tensor (most of a measured step's host
    time); steady steps now reuse the walk and the ledgers still read the exact model state."""
    import lightning_ckpt.measure.ledger as ledger

    calls = []
    walk = ledger.model_state_bytes
    monkeypatch.setattr(ledger, "model_state_bytes", lambda *a, **k: calls.append(1) or walk(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters())
    monitor = StepMonitor("cpu")
    ledgers = []
    for _ in range(6):
        monitor.begin_step(measure=True)
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        ledgers.append(monitor.end_step(model, [opt], 0).ledger)
    assert len(calls) == 1  # a ledger is read after the optimizer step: AdamW's state is there from the first
    state = walk(model, [opt])
    assert state.optimizer > 0 and state.grads > 0
    assert all((lg.params, lg.grads, lg.optimizer) == (state.params, state.grads, state.optimizer) for lg in ledgers)
