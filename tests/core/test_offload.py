"""``offload`` moves what frees device memory, once per storage, within a bounded pinned arena, and is refused when
the host cannot hold it.

On the CPU the mechanism runs with CPU tensors treated as device tensors (an injected :class:`Transfers` whose copies
are recorded); the gpu-marked tests check the real thing on CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import warnings

import pytest
import torch
from torch import nn

from lightning_ckpt import apply_policy
from lightning_ckpt.core import offload
from lightning_ckpt.core.offload import (
    CudaTransfers,
    HostMemoryError,
    Transfers,
    configure_offload,
    offload_state,
)
from lightning_ckpt.core.units import KiB, format_bytes
from lightning_ckpt.demos.gpt import GPT, GPTConfig


class Recording(Transfers):
    """Every CPU tensor counts as a device tensor; each copy out is recorded as (storage pointer, bytes)."""

    def __init__(self) -> None:
        super().__init__(is_device=lambda t: True)
        self.out = []

    def copy_out(self, src, host):
        self.out.append((src.untyped_storage().data_ptr(), src.numel()))
        super().copy_out(src, host)


class Wrapper(nn.Module):
    """A model around one kind of block, so that the block finder selects the blocks."""

    def __init__(self, make, n=2, width=8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def _offloaded(model, **kwargs):
    plan = apply_policy(model, "offload", "blocks.*" if isinstance(model, Wrapper) else None)
    transfers = kwargs.pop("transfers", None) or Recording()
    return plan, configure_offload(plan, transfers=transfers, **kwargs)


def _step(model, *inputs, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(*inputs)
    loss = out[1] if isinstance(out, tuple) else out.float().pow(2).mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gpt(**overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(**overrides))


def _param_storages(model):
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


# ------------------------------------------------------------------------------------------------ what moves


def test_parameters_and_views_of_parameters_are_never_moved():
    model = _gpt()
    idx = torch.randint(0, 96, (2, 16))
    plan, state = _offloaded(model)
    _step(model, idx, idx)
    assert state.transfers.out, "nothing was offloaded"
    assert not {ptr for ptr, _ in state.transfers.out} & _param_storages(model)
    assert state.kept["parameter"] >= 4 * 4  # each block's four linear layers save their weight (a view of it)


class Scaled(nn.Module):
    """Saves its parameter itself (``x * w``), a view of it (``w[0]``) and a buffer."""

    def __init__(self, width=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))
        self.register_buffer("scale", torch.randn(width))

    def forward(self, x):
        return torch.tanh(x) * self.w + x * self.w.view(1, -1)[0] + x.sin() * self.scale


def test_a_saved_parameter_its_view_and_a_buffer_stay_and_the_activations_move():
    model = Wrapper(Scaled)
    x = torch.randn(3, 8)
    _, state = _offloaded(model)
    _step(model, x)
    assert not {ptr for ptr, _ in state.transfers.out} & _param_storages(model)
    assert state.kept["parameter"] == 2 * 3  # per block: w, its view, the buffer
    # per block the tanh output (saved by tanh and by the first product) and x (saved twice): each storage once
    assert state.copies_out == 2 * 2 and state.bytes_out == 2 * 2 * (3 * 8 * 4)


def test_autocasts_copies_of_trainable_weights_stay_on_the_device():
    model = Wrapper(lambda: nn.Linear(8, 8, bias=False))
    x = torch.randn(4, 8)
    _, state = _offloaded(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _step(model, x)
    # each block saves its bf16 input (moved: 4 x 8 x 2 bytes) and the bf16 copy of its weight (kept)
    assert state.kept["weight_copy"] == 2
    assert state.bytes_out == 2 * 4 * 8 * 2


def test_a_frozen_weights_copy_is_moved_as_documented():
    model = Wrapper(lambda: nn.Linear(8, 8, bias=False))
    for block in model.blocks:
        block.weight.requires_grad_(False)
    _, state = _offloaded(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _step(model, torch.randn(4, 8))
    assert state.kept["weight_copy"] == 0  # not cached by autocast, held by the saved graph only
    # the input is not saved (no weight gradient); the bf16 copy of each block's weight is moved
    assert state.bytes_out == 2 * 8 * 8 * 2


class Masked(nn.Module):
    """Multiplies by a mask broadcast to the activation's full size (stride 0), like an expanded attention mask."""

    def forward(self, x):
        keep = (x[:, :1, :1] > -10).to(x.dtype)  # [B, 1, 1]: made inside the block
        return torch.tanh(x) * keep.expand(-1, x.shape[1], x.shape[2])


def test_broadcast_views_stay_where_they_are():
    model = Wrapper(Masked, width=16)
    x = torch.randn(2, 16, 16)
    reference = copy.deepcopy(model)
    _, state = _offloaded(model)
    grads = _step(model, x)
    assert state.kept["broadcast"] == 2
    # per block only the tanh output is moved; the [2, 16, 16] expanded mask (2 KiB) is not materialised
    assert state.bytes_out == 2 * (2 * 16 * 16 * 4)
    assert all(torch.equal(g, r) for g, r in zip(grads.values(), _step(reference, x).values()))


class SparseMix(nn.Module):
    """Mixes rows with a sparse matrix made inside the block: ``torch.sparse.mm`` saves it for the backward."""

    def forward(self, x):
        mix = (torch.eye(x.shape[0]) * 2).to_sparse()
        return torch.sparse.mm(mix, torch.tanh(x))


class Nested(nn.Module):
    """Runs ``sin`` on a nested tensor of two halves of the batch: ``sin`` saves its nested input."""

    def forward(self, x):
        half = x.shape[0] // 2
        nested = torch.nested.as_nested_tensor([x[:half], x[half:]])
        return torch.nested.to_padded_tensor(nested.sin(), 0.0).reshape(x.shape)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("make", [SparseMix, Nested])
def test_sparse_and_nested_saved_tensors_stay_where_they_are(make):
    model = Wrapper(make)
    x = torch.randn(4, 8)
    reference = copy.deepcopy(model)
    _, state = _offloaded(model)
    grads = _step(model, x)
    assert state.kept["other"] >= 2  # one per block, left before its storage is touched
    assert all(torch.equal(g, r) for g, r in zip(grads.values(), _step(reference, x).values()))


class Split(nn.Module):
    """q, k, v views of one projection's output, each saved by two products (six saved views, one storage)."""

    def __init__(self, width=8):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.width = width

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.width, dim=-1)
        return x + q * k + k * v + v.transpose(-1, -2).mT * q


def test_views_of_one_storage_are_moved_once():
    model = Wrapper(Split)
    x = torch.randn(2, 5, 8)
    reference = copy.deepcopy(model)
    _, state = _offloaded(model)
    grads = _step(model, x)
    qkv_bytes = 2 * 5 * 24 * 4
    qkv_copies = [n for _, n in state.transfers.out if n == qkv_bytes]
    assert len(qkv_copies) == 2  # one per block, for the six views of it
    assert state.reused >= 2 * 5
    assert all(torch.equal(g, r) for g, r in zip(grads.values(), _step(reference, x).values()))


class Views(nn.Module):
    """Returns a product whose saved operand is a transposed, offset view of a larger tensor."""

    def forward(self, x):
        base = torch.tanh(x)  # [4, 6]
        view = base.t()[1:4]  # [3, 4], strides (1, 6), offset 1
        return view * view.exp()


def test_saved_views_come_back_with_their_offset_strides_and_shared_storage():
    block = Views()
    model = Wrapper(lambda: block, n=1, width=6)
    _, state = _offloaded(model)
    x = torch.randn(4, 6)
    out = model(x)
    expected = torch.tanh(model.inp(x)).t()[1:4]
    saved = out.grad_fn._saved_self  # unpacked through the offload hooks
    assert torch.equal(saved, expected)
    assert (saved.stride(), saved.storage_offset(), saved.shape) == (expected.stride(), expected.storage_offset(),
                                                                   expected.shape)
    assert state.copies_out == 2  # the tanh output's storage (whole, once) and exp's output
    assert state.copies_in == 2  # the block's first tensor unpacked brings back all of its copies
    again = out.grad_fn._saved_self
    assert again.untyped_storage().data_ptr() == saved.untyped_storage().data_ptr()  # one device buffer
    assert state.copies_in == 2


@pytest.mark.parametrize("precision", ["32", "bf16-autocast"])
def test_gradients_are_bitwise_equal_to_off(precision):
    model = _gpt(dropout=0.1)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 96, (2, 16))
    _, state = _offloaded(model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "32")
    for seed in range(2):
        with autocast:
            grads, ref = _step(model, idx, idx, seed=seed), _step(reference, idx, idx, seed=seed)
        assert grads.keys() == ref.keys()
        for name in grads:
            assert torch.equal(grads[name], ref[name]), name
    assert state.copies_out > 0 and state.copies_in == state.copies_out
    assert state.held == 0  # every host copy was freed by the backward


def test_backward_prefetches_the_block_before():
    model = _gpt(n_layer=4)
    idx = torch.randint(0, 96, (2, 16))
    _, state = _offloaded(model)
    seen = []
    start = offload._Group.start_backward

    def spy(group, prefetch):
        alive = [c() for c in group.copies if c() is not None]
        seen.append(all(c.fetched is not None for c in alive))
        start(group, prefetch)

    offload._Group.start_backward = spy
    try:
        _step(model, idx, idx)
    finally:
        offload._Group.start_backward = start
    # the last block is fetched on demand; each earlier one was already on its way when its backward started
    assert seen == [False, True, True, True]


class RecordingIn(Recording):
    """Also records the host buffer of each copy back, in the order the copies are issued."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched = []

    def copy_in(self, host, device):
        self.fetched.append(host.data_ptr())
        return super().copy_in(host, device)


def _groups_in_backward_order(state):
    """The host buffers of each offloaded call's copies, the last call first (the order backward reaches them)."""
    groups, ref = [], state._last_group
    while ref is not None and ref() is not None:
        group = ref()
        groups.append({c().host.data_ptr() for c in group.copies if c() is not None})
        ref = group.previous
    return groups


def test_a_blocks_own_copies_are_queued_before_the_prefetch_of_the_next():
    model = Wrapper(Scaled, n=3)
    _, state = _offloaded(model, transfers=RecordingIn())
    out = model(torch.randn(3, 8))
    groups = _groups_in_backward_order(state)
    assert len(groups) == 3 and all(groups)
    out.pow(2).mean().backward()
    # each copy back labelled by its call's place in backward: the side stream runs them in this order
    order = [next(i for i, g in enumerate(groups) if ptr in g) for ptr in state.transfers.fetched]
    assert order == sorted(order) and set(order) == {0, 1, 2}, order


def test_the_bytes_moved_per_block_are_measured():
    model = _gpt(n_layer=3)
    idx = torch.randint(0, 96, (2, 16))
    _, state = _offloaded(model)
    _step(model, idx, idx)
    assert sorted(state.per_block) == [0, 1, 2]
    assert sum(state.per_block.values()) == state.bytes_out


def test_blocks_on_the_cpu_run_without_hooks_by_default(monkeypatch):
    model = _gpt()
    plan = apply_policy(model, "offload")

    def fail(*args, **kwargs):
        raise AssertionError("offload hooks installed for a block on the CPU")

    monkeypatch.setattr(offload._Packer, "__init__", fail)
    _step(model, torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8)))
    assert offload_state(plan, create=False) is None


# ------------------------------------------------------------------------------------------------ pinned memory


def test_pinned_memory_is_bounded_over_20_steps_reused_and_released():
    model = _gpt(dropout=0.1)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 96, (2, 16))
    limit = 256 * KiB  # about half of what one step moves (4 x 129 KiB)
    plan, state = _offloaded(model, pinned_limit=limit)
    pinned, chunks, pageable = [], [], []
    for step in range(20):
        grads = _step(model, idx, idx, seed=step)
        pinned.append(state.pinned_bytes)
        pageable.append(state.pageable_bytes - sum(pageable))
        chunks.append([id(c) for c in state.arena.chunks])
        assert state.held == 0
        if step in (0, 19):
            ref = _step(reference, idx, idx, seed=step)
            assert all(torch.equal(grads[n], ref[n]) for n in grads)
    assert max(pinned) <= limit and state.pinned_peak <= limit
    assert all(c == chunks[0] for c in chunks)  # the first step's chunks serve every later step
    per_step = state.bytes_out // 20
    assert len(set(pageable)) == 1 and pageable[0] >= per_step - limit  # beyond the bound: pageable, every step
    plan.retarget("all")  # the plan leaves offload: the arena goes back
    assert state.pinned_bytes == 0
    plan.retarget("offload")
    _step(model, idx, idx)
    assert state.pinned_bytes > 0
    plan.remove()
    assert state.pinned_bytes == 0


class CountingEmpties(Recording):
    """Counts the calls that give cached pinned memory back to the system."""

    def __init__(self) -> None:
        super().__init__()
        self.empties = 0

    def empty_cache(self):
        self.empties += 1


def test_a_release_while_copies_are_alive_empties_the_host_cache_again_when_they_go():
    model = _gpt()
    idx = torch.randint(0, 96, (2, 16))
    plan, state = _offloaded(model, transfers=CountingEmpties())
    out = model(idx, idx)  # its graph holds the host copies, as an exception's traceback would
    assert state.held > 0
    offload.release_host_memory(plan)
    assert state.pinned_bytes == 0 and state.transfers.empties == 1
    del out
    gc.collect()
    assert state.held == 0
    assert state.transfers.empties == 2  # the chunks the copies kept went back to the cache, and were freed
    offload.release_host_memory(plan)  # nothing alive: emptied at once, nothing left pending
    _step(model, idx, idx)
    assert state.transfers.empties == 3


def test_a_bad_pinned_limit_is_refused():
    with pytest.raises(ValueError, match=r"pinned_limit='1GiB' must be a number of bytes"):
        offload.HostOffload(transfers=Recording(), pinned_limit="1GiB")


# ------------------------------------------------------------------------------------------------ host memory


def test_offload_is_refused_when_the_node_cannot_hold_what_it_moves():
    model = _gpt()
    idx = torch.randint(0, 96, (2, 16))
    available = 600 * KiB  # one step moves 516 KiB per rank: two ranks need 1.0 MiB
    _, state = _offloaded(model, host_memory=lambda: available, local_ranks=2)
    with pytest.raises(HostMemoryError) as caught:
        _step(model, idx, idx)
    text = str(caught.value)
    assert text.startswith("Use policy 'all'")
    assert f"the host has {format_bytes(available)} available" in text
    assert "per rank × 2 ranks" in text
    del caught  # its traceback holds the failed forward's frames
    gc.collect()
    assert state.held == 0  # the failed forward's copies are gone with its graph
    # with one rank on the node the same step fits
    _, state = _offloaded(model, host_memory=lambda: available, local_ranks=1)
    _step(model, idx, idx)
    assert state.pageable_bytes > 0  # a quarter of 600 KiB pinned, the rest pageable


def test_the_host_figures_are_read_from_the_system():
    assert offload.host_memory_available() > 0
    assert offload.local_world_size() == 1


def test_local_world_size_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert offload.local_world_size() == 4


# ------------------------------------------------------------------------------------------------ CUDA on the CPU


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.stream))

    def synchronize(self):
        self.log.append(("synchronize", self.name))


class FakeEvent:
    stream = None

    def record(self, stream):
        self.stream = stream.name


class FakeCuda:
    """The CUDA calls of :class:`CudaTransfers` on CPU tensors: streams are names, and each allocation, wait and
    ``record_stream`` is logged with the stream current then."""

    def __init__(self):
        self.log = []
        self.now = FakeStream(self.log, "compute")

    def new_stream(self, index):
        return FakeStream(self.log, f"side{index}")

    def current_device(self):
        return 0

    def current_stream(self, device):
        return self.now

    @contextlib.contextmanager
    def use(self, stream):
        before, self.now = self.now, stream
        try:
            yield
        finally:
            self.now = before

    def new_event(self):
        return FakeEvent()

    def empty(self, nbytes, device):
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.log.append(("empty", self.now.name, t.data_ptr()))
        return t

    def record_stream(self, t, stream):
        self.log.append(("record_stream", t.data_ptr(), stream.name))

    def empty_host_cache(self):
        self.log.append(("empty_host_cache",))

    def capturing(self):
        return False


def test_cuda_copies_back_are_allocated_on_the_compute_stream_and_guarded_for_the_side_stream():
    model = Wrapper(Scaled)
    x = torch.randn(3, 8)
    reference = copy.deepcopy(model)
    cuda = FakeCuda()
    _, state = _offloaded(model, transfers=CudaTransfers(is_device=lambda t: True, cuda=cuda))
    grads = _step(model, x)
    assert all(torch.equal(g, r) for g, r in zip(grads.values(), _step(reference, x).values()))
    allocations = [(i, entry) for i, entry in enumerate(cuda.log) if entry[0] == "empty"]
    assert len(allocations) == state.copies_in > 0
    for i, (_, stream, ptr) in allocations:
        # from the pool of the stream that frees it, filled after the side stream waited for that stream's kernels
        assert stream == "compute", cuda.log
        assert cuda.log[i + 1] == ("wait", "side0", "compute")
        assert ("record_stream", ptr, "side0") in cuda.log[i + 2:]
    # the compute stream reads a buffer (once per saved tensor unpacked) only after an event of the side stream
    waits = [e for e in cuda.log if e[0] == "wait_event"]
    assert len(waits) >= state.copies_in and set(waits) == {("wait_event", "compute", "side0")}


def test_with_two_devices_each_side_stream_waits_for_the_other_before_the_arena_is_rewritten():
    model = Wrapper(Scaled)
    cuda = FakeCuda()
    transfers = CudaTransfers(is_device=lambda t: True, cuda=cuda)
    for index in (0, 1):  # both devices' side streams, used by earlier calls
        transfers._side(torch.device("cuda", index))
    _offloaded(model, transfers=transfers)
    for step in range(2):
        del cuda.log[:]
        _step(model, torch.randn(3, 8))
        first_copy = cuda.log.index(("wait", "side0", "compute"))
        # the arena starts over: copies into it are ordered after every stream's earlier copies back out of it
        assert {("wait", "side0", "side1"), ("wait", "side1", "side0")} <= set(cuda.log[:first_copy]), step


# ------------------------------------------------------------------------------------------------ CUDA


def _cuda_gpt(n_layer=6):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, n_layer=n_layer, n_head=4, n_embd=128, block_size=512,
                         dropout=0.1)).cuda()


def _cuda_step(model, idx):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    # the math kernel: the fused attention kernels' backward may accumulate with atomics (not bitwise repeatable)
    with sdpa_kernel(SDPBackend.MATH):
        _, loss = model(idx, idx)
        loss.backward()
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class _RecordingCuda(CudaTransfers):
    def __init__(self):
        super().__init__()
        self.sources = set()
        self.streams_used = set()

    def copy_out(self, src, host):
        self.sources.add(src.untyped_storage().data_ptr())
        self.streams_used.add(self._side(src.device).stream_id)
        super().copy_out(src, host)


@pytest.mark.gpu
def test_cuda_offload_matches_off_with_a_lower_peak_and_no_parameter_moved():
    model = _cuda_gpt()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 256, (8, 512), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    ref = _cuda_step(reference, idx)
    peak_off = torch.cuda.max_memory_allocated()
    del reference
    plan = apply_policy(model, "offload")
    transfers = _RecordingCuda()
    state = configure_offload(plan, transfers=transfers)
    _cuda_step(model, idx)  # the arena is allocated in the first step
    torch.cuda.reset_peak_memory_stats()
    grads = _cuda_step(model, idx)
    peak_offload = torch.cuda.max_memory_allocated()
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name
    # without prefetch slack all moved bytes would be off the device; at least a quarter of them must be
    assert peak_off - peak_offload >= state.bytes_out // 2 // 4, (peak_off, peak_offload, state.bytes_out)
    assert not transfers.sources & _param_storages(model)
    assert torch.cuda.current_stream().stream_id not in transfers.streams_used
    assert state.pinned_bytes > 0 and state.pageable_bytes == 0


@pytest.mark.gpu
def test_cuda_pinned_memory_stays_bounded_over_20_steps_and_is_released():
    model = _cuda_gpt(n_layer=4)
    idx = torch.randint(0, 256, (4, 512), device="cuda")
    plan = apply_policy(model, "offload")
    probe = configure_offload(plan)
    _cuda_step(model, idx)
    per_step = probe.bytes_out
    limit = per_step // 2
    state = configure_offload(plan, pinned_limit=limit)
    pinned = []
    for _ in range(20):
        _cuda_step(model, idx)
        pinned.append(state.pinned_bytes)
    assert max(pinned) <= limit and len(set(pinned)) == 1
    assert state.pageable_bytes > 0
    plan.retarget("all")
    assert state.pinned_bytes == 0


@pytest.mark.gpu
def test_cuda_copies_run_on_a_side_stream_and_overlap_compute(tmp_path):
    """The device-to-host copies are on another stream than the kernels; their overlap with compute is measured
    from the profiler's trace and printed (the verdict is the stream, not the timing)."""
    from torch.profiler import ProfilerActivity, profile

    model = _cuda_gpt()
    idx = torch.randint(0, 256, (8, 512), device="cuda")
    plan = apply_policy(model, "offload")
    configure_offload(plan)
    _cuda_step(model, idx)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _cuda_step(model, idx)
    trace = os.path.join(tmp_path, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert copies and kernels
    copy_streams = {e["args"].get("stream") for e in copies}
    kernel_streams = {e["args"].get("stream") for e in kernels}
    assert not copy_streams & kernel_streams, (copy_streams, kernel_streams)
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    overlapped = total = 0.0
    for c in copies:
        start, end = c["ts"], c["ts"] + c["dur"]
        total += end - start
        overlapped += sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans if a < end and b > start)
    print(f"offload: {len(copies)} device-to-host copies, {overlapped / max(total, 1e-9):.0%} of their time "
          "overlapped with compute kernels")


@pytest.mark.gpu
def test_cuda_copies_back_leave_no_memory_in_the_side_streams_pool():
    """Buffers filled on the side stream are allocated from the compute stream's pool: after a few steps no segment
    of the caching allocator belongs to a side stream (it would be memory compute can never reuse)."""
    torch.cuda.empty_cache()
    model = _cuda_gpt(n_layer=4)
    idx = torch.randint(0, 256, (4, 512), device="cuda")
    state = configure_offload(apply_policy(model, "offload"))
    for _ in range(3):
        _cuda_step(model, idx)
    sides = {stream.cuda_stream for stream in state.transfers.streams.values()}
    segments = {segment["stream"] for segment in torch.cuda.memory_snapshot()}
    assert state.copies_in > 0 and sides
    assert not segments & sides, (segments, sides)


def test_copies_past_the_pinned_bound_are_said_once_with_the_fix():
    """The first copy that goes to pageable memory (synchronous with the host on CUDA) warns once per run, naming
    the bound and how to raise it; the old code said nothing."""
    model = _gpt()
    idx = torch.randint(0, 96, (2, 16))
    plan, state = _offloaded(model, pinned_limit=64 * KiB)  # under what one step moves
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(model, idx, idx, seed=step)
    said = [str(w.message) for w in caught if "pinned_limit" in str(w.message)]
    assert state.pageable_bytes > 0 and len(said) == 1, said
    assert said[0].startswith("lightning_ckpt: offload fewer blocks") and "64.0 KiB" in said[0], said
