"""``offload``: a block's saved activations wait in host memory between its forward and its backward.

Inside an offloaded block a ``saved_tensors_hooks`` pair decides, for each tensor autograd saves, whether moving
it frees device memory, and if so copies it to the host on a side stream:

- **Kept where it is** (moving it would free nothing, or cost more than it saves):

  - parameters and views of parameters (a linear layer saves its weight; ``t._base`` is a parameter, or ``t``
    shares the untyped storage of one of the block's parameters or buffers): they stay alive on the device anyway;
  - autocast's low-precision copies of trainable parameters (a ``_to_copy`` whose ``grad_fn`` leads, through view
    nodes only, to a parameter's ``AccumulateGrad``): they are weight-sized, not token-sized, and autocast's cache
    holds them through the whole forward, so copying them out would only add traffic. A *frozen* parameter's copy
    has no ``grad_fn`` and cannot be told apart from an activation: it is moved (autocast does not cache it, so
    the saved graph is its only holder and moving it does free device memory);
  - tensors whose elements overlap, such as broadcast (stride-0) views like an expanded attention mask: their
    storage is smaller than they look and moving them would materialise nothing useful;
  - tensors already on the host, non-strided (sparse) and nested tensors, tensor subclasses (``DTensor``),
    conjugate/negative views.

- **Moved once per storage.** Views of one storage (``q, k, v = qkv.split(...)``, a transpose) share one host
  copy: the first view of a storage copies the whole storage (or only its own span when that covers less than
  half of it), later views of the same, unmodified storage (same version counter) reuse it, and each view is
  rebuilt on the way back with ``set_(storage, offset, size, stride)``, sharing one device buffer again.

- **Copies overlap compute.** On CUDA every copy runs on one side stream per device: device→host after the side
  stream waited for the compute stream (so the source is complete), with ``record_stream`` so that the caching
  allocator does not reuse the source's memory before its copy ends; host→device on the same stream, into a
  buffer allocated on the compute stream (which frees it, so its memory goes back to the compute stream's pool)
  after the side stream waited for the compute stream, and the compute stream waits on an event of that copy
  before it reads the tensor. **Backward prefetches one block ahead**: the first tensor unpacked in a block's
  backward queues the host→device copies of the block's own tensors not yet on their way, then those of the block
  that ran before it in the forward (the next one in backward), so those copies overlap this block's backward; only
  the first block reached in backward (the last one offloaded) waits for its own copies, and never behind another
  block's. Because both directions share one stream, a host buffer is never written again before the copy that
  reads it has run (stream order is the synchronisation of a non-blocking copy to pinned memory); with several
  devices in one process, whose side streams share the arena, each side stream waits for the others' copies when
  the arena starts over.

- **Bounded pinned memory.** Host copies live in an arena of pinned chunks, at most ``pinned_limit`` bytes (default:
  a quarter of the host memory available, divided among the node's ranks), reused across steps (the arena starts
  over when every copy of the previous forward is gone) and released when the plan leaves ``offload``, when the
  plan is removed, and when ``fit`` ends. A copy that no longer fits in the bound goes to pageable memory instead
  (slower, and copied synchronously with the host: no overlap for it), never to more pinned memory.

- **Refused when the host cannot hold it.** Before each forward's first copy the host memory available is read
  (``MemAvailable``, bounded by the cgroup's limit); a copy that would take this rank's share of the node beyond
  it (the node's memory divided among its ``LOCAL_WORLD_SIZE`` ranks, plus the arena this rank already holds) raises
  :class:`HostMemoryError` naming both figures, before the host starts swapping. The plan-level check of the
  escalation ladder is :func:`lightning_ckpt.decide.escalation.offload_refusal`, fed by :attr:`HostOffload.per_block`.

Everything that touches a device is behind :class:`Transfers` (which tensors are device tensors, how copies and
waits are done) and the host-memory reader is a plain callable, so the whole mechanism runs on the CPU with CPU
tensors treated as device tensors (``configure_offload(plan, transfers=Transfers(is_device=lambda t: True))``).
With the default transfers a block whose first tensor input is on the CPU runs with no hook at all.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ckpt.core.units import MiB, format_bytes

__all__ = [
    "DEFAULT_PINNED_FRACTION",
    "CudaTransfers",
    "HostMemoryError",
    "HostOffload",
    "Transfers",
    "applies",
    "configure_offload",
    "host_memory_available",
    "local_world_size",
    "offload_state",
    "offloaded_call",
    "release_host_memory",
]

DEFAULT_PINNED_FRACTION = 0.25
_STATE_ATTR = "_lightning_ckpt_offload"
_ALIGN = 512  # bytes: a rebuilt view keeps its original alignment modulo the caching allocator's block alignment
_FIRST_CHUNK = MiB
_CHUNK = 64 * MiB  # the arena's usual chunk (a power of two: the pinned allocator rounds every request up to one)
# backward nodes that only re-view their input: autocast's copy of a view of a parameter is still a weight copy
_VIEW_NODES = frozenset({"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "SelectBackward0",
                         "SliceBackward0", "ExpandBackward0", "UnsafeViewBackward0", "AsStridedBackward0",
                         "ReshapeAliasBackward0", "AliasBackward0", "SqueezeBackward0", "SqueezeBackward1",
                         "UnsqueezeBackward0"})


class HostMemoryError(RuntimeError):
    """Host memory cannot hold what ``offload`` would move (the message names both figures)."""


# ------------------------------------------------------------------------------------------------ host figures


def host_memory_available() -> int:
    """Bytes of host memory the system can still give: ``MemAvailable`` of ``/proc/meminfo`` (else ``os.sysconf``),
    bounded by the cgroup v2 limit when the process runs in a container that has one."""
    available = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 0
    try:  # a container's limit is invisible in /proc/meminfo
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as fh:
                available = min(available, max(0, int(limit) - int(fh.read().strip())))
    except (OSError, ValueError):
        pass
    return available


def local_world_size() -> int:
    """Processes on this node that offload as much as this one: ``LOCAL_WORLD_SIZE`` (torchrun), else one per
    visible GPU of an initialised process group, else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            return max(1, min(world, torch.cuda.device_count() or world))
    except Exception:  # noqa: BLE001 - a broken process group only loses the estimate
        pass
    return 1


# ------------------------------------------------------------------------------------------------ transfers


def _first_tensor(args, kwargs) -> Optional[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class Transfers:
    """Which saved tensors live in device memory, and how they are copied out and back.

    This base class copies synchronously, on the calling thread (no stream): with ``is_device=lambda t: True`` it
    treats CPU tensors as device tensors, which is how the CPU tests observe the mechanism. :class:`CudaTransfers`
    is the real thing.

    Args:
        is_device: ``tensor -> bool``: does this tensor live in the memory offload should free? Default: a tensor
            that is not on the CPU (nor meta, nor MPS, whose memory is the host's).
    """

    def __init__(self, is_device: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        self.injected = is_device is not None
        self.is_device = is_device if is_device is not None else _not_host

    def applies(self, args: tuple, kwargs: dict) -> bool:
        """Whether a block called with these inputs needs the hooks at all (the first tensor input decides)."""
        first = _first_tensor(args, kwargs)
        return first is None or self.is_device(first)

    def host_empty(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A flat ``uint8`` host buffer."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())

    def copy_out(self, src: torch.Tensor, host: torch.Tensor) -> None:
        """Copy the device bytes ``src`` into ``host``; ``src``'s memory must not be reused before the copy ends."""
        host.copy_(src)

    def copy_in(self, host: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, Any]:
        """A new device buffer holding ``host``'s bytes, and what the reader must wait for (``None``: nothing)."""
        dev = host.to(device)
        return (dev.clone() if dev is host else dev), None

    def ready(self, dev: torch.Tensor, ticket: Any) -> None:
        """Make the current stream wait for ``ticket`` before it reads ``dev``."""

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (which cannot wait on a side stream's copies)."""
        return False

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""

    def fence(self) -> None:
        """Order every later copy after every copy issued so far, on any stream, without waiting on the host."""

    def empty_cache(self) -> None:
        """Give cached pinned memory back to the system."""


def _not_host(t: torch.Tensor) -> bool:
    return t.device.type not in ("cpu", "meta", "mps")


class _CudaCalls:
    """The CUDA calls :class:`CudaTransfers` makes, in one place so that the CPU tests can replace them with fakes
    that record which stream each allocation, copy and wait happened on."""

    def new_stream(self, index: int) -> Any:
        return torch.cuda.Stream(device=index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> Any:
        """A context manager making ``stream`` the current one."""
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of device memory, from the current stream's pool."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def empty_host_cache(self) -> None:
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


class CudaTransfers(Transfers):
    """CUDA tensors, copied on one side stream per device (see the module docstring for the ordering).

    Args:
        is_device: as for :class:`Transfers` (default: CUDA tensors).
        cuda: the CUDA calls made (default: the real ones); the CPU tests pass fakes.
    """

    def __init__(self, is_device: Optional[Callable[[torch.Tensor], bool]] = None,
                 cuda: Optional[_CudaCalls] = None) -> None:
        super().__init__(is_device)
        if is_device is None:
            self.is_device = _is_cuda
        self.cuda = cuda if cuda is not None else _CudaCalls()
        self.streams: Dict[int, Any] = {}

    def _side(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else self.cuda.current_device()
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = self.cuda.new_stream(index)
        return stream

    def copy_out(self, src: torch.Tensor, host: torch.Tensor) -> None:
        side = self._side(src.device)
        side.wait_stream(self.cuda.current_stream(src.device))  # the source is complete before it is read
        with self.cuda.use(side):
            # non-blocking is safe either way: into pageable memory CUDA returns only once the copy is done
            host.copy_(src, non_blocking=True)
        self.cuda.record_stream(src, side)  # its memory is not handed out again before this copy has run

    def copy_in(self, host: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, Any]:
        side = self._side(device)
        current = self.cuda.current_stream(device)
        # allocated from the compute stream's pool, which frees it: the caching allocator never hands a block freed
        # by one stream to another stream's request, so side-stream buffers would pile up beside the compute pool
        dev = self.cuda.empty(host.numel(), device)
        side.wait_stream(current)  # the block may come from a tensor that compute kernels still queued use
        with self.cuda.use(side):
            # from pageable memory CUDA returns once the bytes are staged: the buffer may be reused at once
            dev.copy_(host, non_blocking=True)
            event = self.cuda.new_event()
            event.record(side)
        self.cuda.record_stream(dev, side)  # freed on the compute stream: not handed out before this copy has run
        return dev, event

    def ready(self, dev: torch.Tensor, ticket: Any) -> None:
        if ticket is not None:
            self.cuda.current_stream(dev.device).wait_event(ticket)

    def capturing(self) -> bool:
        return self.cuda.capturing()

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()

    def fence(self) -> None:
        # one stream is its own order; several devices' streams share the arena, whose chunks are rewritten
        for stream in self.streams.values():
            for other in self.streams.values():
                if other is not stream:
                    stream.wait_stream(other)

    def empty_cache(self) -> None:
        self.cuda.empty_host_cache()


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _default_transfers() -> Transfers:
    return CudaTransfers() if torch.cuda.is_available() else Transfers()


# ------------------------------------------------------------------------------------------------ the host arena


class _Arena:
    """Pinned chunks handed out front to back in each forward and started over when the forward's copies are all
    gone: a step's copies reuse the previous step's memory, and the total stays within ``limit`` bytes."""

    def __init__(self, limit: int, allocate: Callable[[int, bool], torch.Tensor]) -> None:
        self.limit = limit
        self.allocate = allocate
        self.chunks: List[torch.Tensor] = []
        self.pinned = 0  # bytes held in chunks
        self.peak = 0
        self.index = self.offset = 0

    def rewind(self) -> None:
        self.index = self.offset = 0

    def take(self, nbytes: int, cap: int) -> Optional[torch.Tensor]:
        """``nbytes`` of arena memory, or ``None`` when the bound (or ``cap``, the most the arena may hold now)
        leaves no room for it."""
        while self.index < len(self.chunks):
            chunk = self.chunks[self.index]
            if self.offset + nbytes <= chunk.numel():
                view = chunk[self.offset:self.offset + nbytes]
                self.offset += -(-nbytes // _ALIGN) * _ALIGN
                return view
            self.index, self.offset = self.index + 1, 0
        room = min(self.limit, cap) - self.pinned
        size = 1 << max(0, nbytes - 1).bit_length()
        if size > room:
            return None
        # chunks grow geometrically (each as large as all before it, from 1 MiB up to 64 MiB): few chunks for a
        # large model, little slack for a small one
        while size < min(max(self.pinned, _FIRST_CHUNK), _CHUNK) and size * 2 <= room:
            size *= 2
        self.chunks.append(self.allocate(size, True))
        self.pinned += size
        self.peak = max(self.peak, self.pinned)
        self.index, self.offset = len(self.chunks) - 1, 0
        return self.take(nbytes, cap)

    def clear(self) -> None:
        self.chunks = []
        self.pinned = 0
        self.rewind()


# ------------------------------------------------------------------------------------------------ per-plan state


class HostOffload:
    """The offload state of one plan: transfers, the pinned arena, the host-memory guard and the figures.

    Obtained with :func:`offload_state` (created on first use) or replaced with :func:`configure_offload`.

    Args:
        transfers: the :class:`Transfers` (default: :class:`CudaTransfers` when CUDA is available).
        pinned_limit: bytes of pinned host memory this rank may hold (default: ``DEFAULT_PINNED_FRACTION`` of the
            host memory available when the first copy is made, divided by ``local_ranks``).
        host_memory: ``() -> int``, the bytes of host memory available (default :func:`host_memory_available`).
        local_ranks: processes on this node (default :func:`local_world_size`).
        prefetch: start the copies back of the previous block when a block's backward starts.

    Attributes:
        per_block: host bytes each block's last offloaded call moved (this rank), by block index.
        copies_out / bytes_out / copies_in / bytes_in: copies made so far and their bytes.
        kept: tensors left where they were, by reason (``parameter``, ``weight_copy``, ``broadcast``, ``other``).
        reused: saved views served by a copy made for an earlier view of the same storage.
        pageable_bytes: bytes that went to pageable memory because the pinned bound was reached.
    """

    def __init__(self, transfers: Optional[Transfers] = None, pinned_limit: Optional[int] = None,
                 host_memory: Optional[Callable[[], int]] = None, local_ranks: Optional[int] = None,
                 prefetch: bool = True) -> None:
        if pinned_limit is not None and (not isinstance(pinned_limit, int) or pinned_limit < 0):
            raise ValueError(f"pinned_limit={pinned_limit!r} must be a number of bytes (an int >= 0) or None "
                             f"for {DEFAULT_PINNED_FRACTION} of the host memory available.")
        if local_ranks is not None and (not isinstance(local_ranks, int) or local_ranks < 1):
            raise ValueError(f"local_ranks={local_ranks!r} must be an int >= 1 (the processes on this node).")
        self.transfers = transfers if transfers is not None else _default_transfers()
        self.host_memory = host_memory if host_memory is not None else host_memory_available
        self.local_ranks = local_ranks if local_ranks is not None else local_world_size()
        self.prefetch = prefetch
        self._pinned_limit = pinned_limit
        self.arena: Optional[_Arena] = None
        self.per_block: Dict[int, int] = {}
        self.copies_out = self.bytes_out = self.copies_in = self.bytes_in = 0
        self.reused = self.pageable_bytes = 0
        self.kept: Dict[str, int] = {"parameter": 0, "weight_copy": 0, "broadcast": 0, "other": 0}
        self.held = 0  # bytes of live host copies
        self._empty_pending = False  # released while copies were alive: empty the host cache when they are gone
        self._pageable_live = 0
        self._said_pageable = False  # the first copy past the pinned bound is said once
        self._room = 0  # host bytes this rank may hold in this forward
        self._available = 0  # the node's figure read at the start of this forward
        self._own_start = 0  # host bytes this rank held then
        self._copies: Dict[StorageWeakRef, Tuple[StorageWeakRef, "weakref.ref[_HostCopy]"]] = {}
        self._fixed: Dict[int, Tuple[Any, frozenset]] = {}
        self._last_group: Optional["weakref.ref[_Group]"] = None

    # -- figures
    @property
    def pinned_limit(self) -> int:
        if self._pinned_limit is None:
            self._pinned_limit = int(DEFAULT_PINNED_FRACTION * self.host_memory()) // self.local_ranks
        return self._pinned_limit

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes held now (in use or cached in the arena)."""
        return self.arena.pinned if self.arena is not None else 0

    @property
    def pinned_peak(self) -> int:
        return self.arena.peak if self.arena is not None else 0

    # -- the block's parameters and buffers
    def fixed_storages(self, block: nn.Module, index: int) -> frozenset:
        """The data pointers of the block's parameters and buffers: computed again only when the block's first
        tensor is another one or has moved (``.to(device)`` after the plan, FSDP's all-gathered parameters)."""
        first = next(block.parameters(), None)
        if first is None:
            first = next(block.buffers(), None)
        mark = (id(first), _storage_ptr(first)) if first is not None else None
        cached = self._fixed.get(index)
        if cached is not None and cached[0] == mark:
            return cached[1]
        ptrs = frozenset(p for p in map(_storage_ptr, (*block.parameters(), *block.buffers())) if p)
        self._fixed[index] = (mark, ptrs)
        return ptrs

    # -- moving
    def _start_forward(self) -> None:
        """No copy of an earlier forward is alive: the arena starts over and the host's figure is read again."""
        self._copies.clear()
        if self.arena is None:
            self.arena = _Arena(self.pinned_limit, self.transfers.host_empty)
        self.arena.rewind()
        # a chunk read back on one device's side stream may be written next on another's
        self.transfers.fence()
        self._available = self.host_memory()
        # the arena this rank already holds is not in the system's figure but is this rank's to reuse
        self._own_start = self.arena.pinned + self._pageable_live
        self._room = self._available // self.local_ranks + self._own_start

    def _refusal(self, nbytes: int) -> HostMemoryError:
        need = self.arena.pinned + self._pageable_live + nbytes  # what this rank's host memory would hold
        ranks = self.local_ranks
        node = self._available + ranks * self._own_start
        per_rank = f" ({format_bytes(need)} per rank × {ranks} ranks)" if ranks > 1 else ""
        return HostMemoryError(
            "Use policy 'all' (recompute instead of moving), a smaller micro-batch, or free host memory: 'offload' "
            f"would hold at least {format_bytes(need * ranks)} of host memory on this node{per_rank}, and the host "
            f"has {format_bytes(node)} available for it.")

    def copy_out(self, t: torch.Tensor, storage: Any, ptr: int, start: int, end: int) -> "_HostCopy":
        if self.held == 0:
            self._start_forward()
        nbytes = end - start
        # pinned memory grows up to its bound and never beyond this forward's share of the host
        host = self.arena.take(nbytes, self._room - self._pageable_live)
        pinned = host is not None
        if not pinned:
            if self.arena.pinned + self._pageable_live + nbytes > self._room:
                raise self._refusal(nbytes)
            host = self.transfers.host_empty(nbytes, False)
            self._pageable_live += nbytes
            self.pageable_bytes += nbytes
            self._say_pageable()
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (nbytes,))
        self.transfers.copy_out(src, host)
        self.copies_out += 1
        self.bytes_out += nbytes
        self.held += nbytes
        return _HostCopy(self, host, pinned, start, end, ptr, t._version, t.device)

    def _say_pageable(self) -> None:
        """Once: copies past the pinned bound are synchronous with the host, a cost the user should know of."""
        if self._said_pageable:
            return
        self._said_pageable = True
        warnings.warn(f"lightning_ckpt: offload fewer blocks, or raise the pinned bound with configure_offload(plan, "
                      f"pinned_limit=...): its {format_bytes(self.pinned_limit)} of pinned host memory are full, so "
                      "further copies go through pageable memory and wait for the device (no overlap).",
                      RuntimeWarning, stacklevel=2)

    def _released(self, copy: "_HostCopy") -> None:
        self.held -= copy.end - copy.start
        if not copy.pinned:
            self._pageable_live -= copy.end - copy.start
        if self._empty_pending and self.held == 0:  # the last copy that kept a released chunk alive is gone
            self._empty_pending = False
            self.transfers.empty_cache()

    def new_group(self) -> "_Group":
        group = _Group(self._last_group)
        self._last_group = weakref.ref(group)
        return group

    # -- releasing
    def release(self) -> None:
        """Give the pinned arena back (the figures stay): the plan left ``offload``, was removed, or fit ended."""
        if self.arena is not None:
            self.transfers.synchronize()  # no copy still reads or writes a chunk that is freed
            self.arena.clear()
            self.transfers.empty_cache()
            # live host copies (a graph kept by an exception's traceback) still hold chunks: the host allocator
            # caches those when they go, so its cache is emptied again then
            self._empty_pending = self.held > 0
        self._copies.clear()
        self._fixed.clear()
        self._last_group = None


def _storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s storage; 0 for tensors without one of their own (meta, ``DTensor``)."""
    try:
        return t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


class _HostCopy:
    """One storage's bytes ``[start, end)`` in host memory, and its device buffer once fetched back."""

    __slots__ = ("state", "host", "pinned", "start", "end", "ptr", "version", "device", "fetched", "ticket",
                 "__weakref__")

    def __init__(self, state: HostOffload, host: torch.Tensor, pinned: bool, start: int, end: int, ptr: int,
                 version: int, device: torch.device) -> None:
        self.state, self.host, self.pinned = state, host, pinned
        self.start, self.end, self.ptr, self.version, self.device = start, end, ptr, version, device
        self.fetched: Optional[torch.Tensor] = None
        self.ticket: Any = None

    def fetch(self) -> torch.Tensor:
        if self.fetched is None:
            state = self.state
            self.fetched, self.ticket = state.transfers.copy_in(self.host, self.device)
            state.copies_in += 1
            state.bytes_in += self.end - self.start
        return self.fetched

    def __del__(self) -> None:
        self.state._released(self)


class _Group:
    """The copies of one offloaded call, and the call before it (prefetched when this one's backward starts)."""

    __slots__ = ("copies", "previous", "started", "__weakref__")

    def __init__(self, previous: Optional["weakref.ref[_Group]"]) -> None:
        self.copies: List["weakref.ref[_HostCopy]"] = []
        self.previous = previous
        self.started = False

    def start_backward(self, prefetch: bool) -> None:
        """This call's backward begins: its own copies are queued first (the side stream runs in order, so a
        prefetch queued before them would delay the copy needed now), then the previous call's, to overlap this
        backward."""
        self.started = True
        self.fetch_all()
        previous = self.previous() if prefetch and self.previous is not None else None
        if previous is not None and not previous.started:
            previous.fetch_all()

    def fetch_all(self) -> None:
        """Start the copy back of every host copy of this call that is still alive (a no-op for those started)."""
        for ref in self.copies:
            copy = ref()
            if copy is not None:
                copy.fetch()


# ------------------------------------------------------------------------------------------------ the hooks


class _Packer(torch.autograd.graph.saved_tensors_hooks):
    """The hooks of one offloaded call of one block."""

    def __init__(self, state: HostOffload, block: nn.Module, index: int) -> None:
        self.state = state
        self.index = index
        self.is_device = state.transfers.is_device
        self.fixed = state.fixed_storages(block, index)
        self.group = state.new_group()
        self.moved = 0
        super().__init__(self.pack, _unpack)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.state.per_block[self.index] = self.moved

    def pack(self, t: torch.Tensor) -> Any:
        if not self.is_device(t):
            return t
        kept = self.state.kept
        base = t._base
        root = t if base is None else base
        if type(root) is not torch.Tensor or type(t) is not torch.Tensor:  # a parameter, a view of one, a DTensor
            kept["parameter" if isinstance(root, nn.Parameter) else "other"] += 1
            return t
        # before touching the storage: a sparse tensor has none, a nested one has no single size to rebuild it with
        if t.layout is not torch.strided or t.is_nested:
            kept["other"] += 1
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.fixed:  # shares a parameter's or buffer's storage
            kept["parameter"] += 1
            return t
        fn = root.grad_fn
        if fn is not None and type(fn).__name__ == "ToCopyBackward0" and _copies_a_parameter(fn):
            kept["weight_copy"] += 1
            return t
        numel = t.numel()
        if not numel or (t.is_complex() and (t.is_conj() or t.is_neg())):
            kept["other"] += 1
            return t
        size, stride = t.size(), t.stride()
        extent = 1
        for n, s in zip(size, stride):
            extent += (n - 1) * s
        if extent < numel:  # elements overlap (stride 0): the storage is smaller than the tensor
            kept["broadcast"] += 1
            return t
        es = t.element_size()
        first, last = t.storage_offset() * es, (t.storage_offset() + extent) * es
        state = self.state
        key = StorageWeakRef(storage)
        entry = state._copies.get(key)
        copy = entry[1]() if entry is not None and not entry[0].expired() else None
        if (copy is None or copy.ptr != ptr or copy.version != t._version or first < copy.start
                or last > copy.end or (first - copy.start) % es):
            whole = storage.nbytes()
            start, end = (0, whole) if 2 * (last - first) >= whole else (first - first % _ALIGN, last)
            copy = state.copy_out(t, storage, ptr, start, end)
            state._copies[key] = (key, weakref.ref(copy))
            self.group.copies.append(weakref.ref(copy))
            self.moved += end - start
        else:
            state.reused += 1
        return copy, self.group, t.dtype, (first - copy.start) // es, size, stride


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    copy, group, dtype, offset, size, stride = packed
    if not group.started:
        group.start_backward(copy.state.prefetch)
    dev = copy.fetch()
    copy.state.transfers.ready(dev, copy.ticket)
    return torch.empty(0, dtype=dtype, device=dev.device).set_(dev.untyped_storage(), offset, size, stride)


def _copies_a_parameter(fn: Any) -> bool:
    """``fn`` (a ``ToCopyBackward0``) casts a parameter, possibly through view nodes: autocast's weight copy."""
    for _ in range(8):
        nexts = fn.next_functions
        if len(nexts) != 1 or nexts[0][0] is None:
            return False
        fn = nexts[0][0]
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return isinstance(fn.variable, nn.Parameter)
        if name not in _VIEW_NODES:
            return False
    return False


# ------------------------------------------------------------------------------------------------ entry points


def _owner(plan_or_owner: Any) -> Any:
    return getattr(plan_or_owner, "shared", plan_or_owner)


def offload_state(plan_or_owner: Any, create: bool = True) -> Optional[HostOffload]:
    """The :class:`HostOffload` of a :class:`~lightning_ckpt.core.wrap.CheckpointPlan` (created on first use;
    ``create=False``: ``None`` when there is none yet)."""
    owner = _owner(plan_or_owner)
    state = owner.__dict__.get(_STATE_ATTR)
    if state is None and create:
        state = HostOffload()
        setattr(owner, _STATE_ATTR, state)
    return state


def configure_offload(plan_or_owner: Any, **kwargs: Any) -> HostOffload:
    """Give the plan a new :class:`HostOffload` built from ``kwargs`` (its arguments); the old one is released."""
    owner = _owner(plan_or_owner)
    release_host_memory(owner)
    state = HostOffload(**kwargs)
    setattr(owner, _STATE_ATTR, state)
    return state


def release_host_memory(plan_or_owner: Any) -> None:
    """Free the plan's pinned host memory (a no-op without offload state)."""
    state = offload_state(plan_or_owner, create=False)
    if state is not None:
        state.release()


def applies(owner: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an offloaded block called with these inputs needs hooks. Cheap and traceable by dynamo: without
    configured transfers it only looks at the first tensor input's device."""
    state = getattr(owner, _STATE_ATTR, None)
    if state is None:
        first = _first_tensor(args, kwargs)
        return first is None or _not_host(first)
    return state.transfers.applies(args, kwargs)


def offloaded_call(owner: Any, block: nn.Module, index: int, run: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
    """``run(*args, **kwargs)`` with the block's saved tensors offloaded (see the module docstring)."""
    state = offload_state(owner)
    if state.transfers.capturing():
        return run(*args, **kwargs)  # a CUDA graph being captured cannot wait on another stream's copies
    with _Packer(state, block, index):
        return run(*args, **kwargs)
