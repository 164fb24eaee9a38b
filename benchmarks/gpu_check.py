"""The prepared GPU check: everything the CPU cannot show, in one run on a lent CUDA machine, as it is.

Run from the repository root (``bash benchmarks/gpu_check.sh`` sets ``PYTHONPATH=.`` and ``PYTHONUNBUFFERED=1``)::

    bash benchmarks/gpu_check.sh                 # every part, core first; log and JSON under $OUT (or ./gpu_check_out)
    bash benchmarks/gpu_check.sh --only oom      # one part alone (comma-separated for several)
    bash benchmarks/gpu_check.sh --budget-s 300  # the whole run's wall-clock budget (default 560, under a 600 s call)
    python benchmarks/gpu_check.py --smoke-cpu   # every part's code path on the CPU, tiny sizes (development only)

It installs nothing: it runs with the ``python3`` it finds (the lent machine has torch, lightning, transformers,
tensorboard, rich, pyyaml, pytest, timm and no package registry). Each part runs in its own process session with its
own timeout, so a hang or a CUDA error in one part cannot take the others with it, and a timeout kills the part with
everything it started; a part prints ``CHECK <name>: PASS`` or ``FAIL`` lines with the figures behind each verdict.

The run fits one call: ``--budget-s`` caps each part's timeout at the time left, and a part that cannot start with a
useful amount left is reported as SKIP with the reason. The JSON summary (``gpu_check.json``) is rewritten before and
after every part and the summary table is appended to the log after every part, so an outer kill keeps what
finished; SIGTERM or SIGINT kills the running part and writes the summary. The core parts run first (``tests``, the
pytest run, last among them); the rest (compile, the 1.3B model, the overhead) take the time left.

Without CUDA (and without ``--smoke-cpu``) it says so in one line and exits with status 2 within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

__all__ = ["PARTS", "Context", "Part", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, os.path.join(ROOT, "tests"), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

MiB, GiB = 2**20, 2**30


# ------------------------------------------------------------------------------------------------ framework


@dataclass
class Part:
    """One part of the check, run in its own process.

    Attributes:
        tier: ``"core"`` (under 4 minutes together, run first), ``"rest"``, or ``"selftest"`` (the driver's own
            tests: run only when named with ``--only``).
        timeout_s: the part's own limit; the run's ``--budget-s`` caps it at the time left.
        start_s: the least time worth starting the part with; with less left of the budget it is skipped.
        env: extra environment for the part's process.
    """

    name: str
    tier: str
    timeout_s: int
    run: Callable[["Context"], None]
    doc: str
    start_s: int
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class Context:
    """What a part gets: its device, whether this is a CPU smoke run, its deadline, and the check recorder.

    Every check rewrites the part's result file (``finished: false`` until the part returns), so a part that hangs
    or is killed later still shows the checks it finished.
    """

    device: Any
    smoke: bool
    out: str
    deadline: float = math.inf  # time.monotonic() at which the driver kills this part
    result_path: Optional[str] = None
    checks: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def check(self, name: str, ok: bool, **figures: Any) -> bool:
        """Record one verdict with the figures behind it; on a CPU smoke run a CUDA-only verdict is informative."""
        shown = ", ".join(f"{k}={_show(v)}" for k, v in figures.items())
        verdict = "PASS" if ok else "FAIL"
        print(f"CHECK {name}: {verdict}  {shown}", flush=True)
        self.checks.append({"name": name, "ok": bool(ok), "figures": {k: _plain(v) for k, v in figures.items()}})
        self.save(finished=False)
        return ok

    def note(self, text: str) -> None:
        print(f"  {text}", flush=True)

    def save(self, finished: bool, error: Optional[str] = None, seconds: Optional[float] = None) -> None:
        """Write the checks so far to the part's result file (nothing when the context has none)."""
        if self.result_path is None:
            return
        name = os.path.basename(self.result_path).removesuffix(".json")
        _write_json(self.result_path, {"part": name, "finished": finished, "checks": self.checks, "error": error,
                                       "seconds": seconds})


def _write_json(path: str, data: Dict[str, Any]) -> None:
    """Write ``data`` as JSON in one step (a reader or a kill never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


PARTS: Dict[str, Part] = {}


def part(tier: str, timeout_s: int, start_s: Optional[int] = None, env: Optional[Dict[str, str]] = None):
    """Register a part; ``start_s`` defaults to a third of its timeout (less left than that and it cannot finish)."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        name = fn.__name__.removeprefix("part_")
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        PARTS[name] = Part(name, tier, timeout_s, fn, doc, timeout_s // 3 if start_s is None else start_s,
                           dict(env or {}))
        return fn

    return register


def _listed_parts() -> List[str]:
    """The parts a user may name (the driver's self-tests are left out of messages)."""
    return [n for n, p in PARTS.items() if p.tier != "selftest"]


def _run_streamed(cmd: List[str], deadline: float) -> tuple:
    """Run ``cmd`` with its output streamed into this part's output (so the log shows it even if it hangs), killed
    at ``deadline``; returns (exit status, or ``None`` on the timeout, its last 200 lines).

    The command stays in this part's process group: whatever it leaves behind after a kill, the driver kills with
    the group when the part ends.
    """
    import collections

    tail: collections.deque = collections.deque(maxlen=200)

    def sink(line: str) -> None:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line)

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    finished = _pump(proc, deadline, sink)
    if not finished:
        proc.kill()
    rc = proc.wait()
    proc.stdout.close()
    return (rc if finished else None), list(tail)


# ----------------------------------------------------------------------------------------------- helpers


def _gpt(ctx: Context, seed: int = 0, **overrides):
    """The demo GPT on the part's device (small on a CPU smoke run)."""
    import torch

    from lightning_ckpt.demos.gpt import GPT, GPTConfig

    base = dict(vocab_size=512, n_layer=4, n_head=8, n_embd=512, block_size=512, dropout=0.0)
    if ctx.smoke:
        base.update(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=96)
        overrides = {k: v for k, v in overrides.items() if k in ("dropout", "bias")}
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**base, **overrides})).to(ctx.device)


def _tokens(ctx: Context, model, batch: int, seq: int, seed: int = 0):
    import torch

    if ctx.smoke:
        batch, seq = min(batch, 2), min(seq, model.config.block_size)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(ctx.device)


def _grads(model) -> Dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    if set(a) != set(b):
        return math.inf
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


def _bitwise(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _fwd_bwd(model, idx, seed: int = 1, autocast: Optional[Any] = None):
    """One forward and backward from a fixed RNG state; returns (loss, grads)."""
    import torch

    torch.manual_seed(seed)
    if idx.is_cuda:
        torch.cuda.manual_seed_all(seed)
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(idx.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with ctx:
        _, loss = model(idx, idx)
    loss.backward()
    return loss.detach().float().item(), _grads(model)


def _sync(ctx: Context) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize()


def _reset_peak(ctx: Context, empty_cache: bool = False) -> None:
    """Reset the allocator's peaks; with ``empty_cache`` also return its cached blocks first, so that the next
    reserved peak is the next step's own."""
    import torch

    if ctx.cuda:
        if empty_cache:
            gc.collect()
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(ctx: Context) -> int:
    return _peaks(ctx)[0]


def _peaks(ctx: Context) -> tuple:
    """The allocator's (allocated, reserved) peaks since the last reset, once the device is done."""
    import torch

    if not ctx.cuda:
        return 0, 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _allocated(ctx: Context) -> int:
    import torch

    return torch.cuda.memory_allocated() if ctx.cuda else 0


def _trainer(ctx: Context, root: str, callbacks, **overrides):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    kwargs = dict(default_root_dir=root, accelerator="gpu" if ctx.cuda else "cpu", devices=1, max_steps=3,
                  limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, log_every_n_steps=1, logger=CSVLogger(root, name="csv"))
    kwargs.update(overrides)
    return Trainer(callbacks=callbacks, **kwargs)


def _module(ctx: Context, seed: int = 0, lr: float = 1e-3, **overrides):
    """The demo GPT as a LightningModule (small on a CPU smoke run)."""
    from lightning.pytorch import seed_everything

    from lightning_ckpt.demos import GPTLightningModule

    base = dict(vocab_size=512, n_layer=4, n_head=8, n_embd=512, block_size=512, dropout=0.0)
    if ctx.smoke:
        base.update(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=96)
        overrides = {k: v for k, v in overrides.items() if k in ("dropout", "bias")}
    seed_everything(seed, verbose=False)
    return GPTLightningModule(**{**base, **overrides}, lr=lr)


def _loader(module, batch: int, seq: int, steps: int, smoke: bool):
    from torch.utils.data import DataLoader

    if smoke:
        batch, seq = min(batch, 2), min(seq, module.max_seq_len)
    one = module.example_batch(batch, seq)
    one = {k: v.cpu() for k, v in one.items()}
    return DataLoader([one] * steps, batch_size=None)


def _weights(module) -> Dict[str, Any]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


# -------------------------------------------------------------------------------------------------- parts


@part("core", 150)
def part_tests(ctx: Context) -> None:
    """The GPU-marked tests (pytest -m gpu), with the project's pytest configuration where its plugins exist."""
    # pyproject's addopts carries --timeout (pytest-timeout): override addopts where that plugin is missing
    have_timeout = importlib.util.find_spec("pytest_timeout") is not None
    opts = ["-o", "addopts=-rA --durations=15" + " --timeout=120" * have_timeout]
    ctx.note(f"pytest-timeout {'present' if have_timeout else 'missing: addopts overridden'}")
    # -v names each test as it starts, so the streamed log shows which one a timeout stopped
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", *opts, "tests"]
    if ctx.smoke:  # no CUDA: the tests would all skip; collecting them proves they import here
        cmd.append("--collect-only")
    # a few seconds under the part's own limit: the part then reports what ran instead of being killed silently
    limit_s = ctx.deadline - time.monotonic() - 10
    rc, tail = _run_streamed(cmd, time.monotonic() + limit_s)
    summary = next((line.strip() for line in reversed(tail) if line.strip()), "")
    if rc is None:
        summary = f"pytest timed out after {limit_s:.0f} s (its output so far is in the log); last line: {summary}"
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|selected|deselected)", summary)}
    ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if ctx.smoke:
        ctx.check("gpu tests collect", rc == 0, summary=summary)
        return
    ctx.check("gpu tests", rc == 0 and ran > 0, summary=summary, rc=rc)


def _keyword_model(ctx: Context):
    import torch
    from torch import nn

    class KeywordBlock(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(width, width), nn.Dropout(0.3)

        def forward(self, *, hidden: torch.Tensor) -> torch.Tensor:
            return hidden + self.drop(torch.relu(self.fc(hidden)))

    class KeywordNet(nn.Module):
        def __init__(self, width: int, depth: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(KeywordBlock(width) for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(hidden=x)
            return x

    torch.manual_seed(0)
    width = 64 if ctx.smoke else 1024
    return KeywordNet(width, 4).to(ctx.device), width


@part("core", 90)
def part_rng(ctx: Context) -> None:
    """Replay draws the forward's random numbers: a keyword-only block with dropout, and selective over SDPA with
    dropout followed by residual dropout, both bitwise equal to the un-checkpointed model."""
    import torch

    from lightning_ckpt import apply_policy, remove_checkpointing

    # 1. the accelerator's RNG is saved for tensors that reach a block by keyword only
    model, width = _keyword_model(ctx)
    x = torch.randn(8, 256, width, device=ctx.device)

    def run(policy: str):
        apply_policy(model, policy)
        torch.manual_seed(3)
        if ctx.cuda:
            torch.cuda.manual_seed_all(3)
        model.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        model(xi).square().mean().backward()
        out = _grads(model)
        out["input"] = xi.grad.detach().clone()
        remove_checkpointing(model)
        return out

    plain, again, checkpointed = run("none"), run("none"), run("all")
    ctx.check("rng keyword-only block (all vs none)", _bitwise(plain, checkpointed),
              max_abs_diff=_max_diff(plain, checkpointed), plain_rerun_diff=_max_diff(plain, again))

    # 2. selective keeps SDPA only when it draws no random numbers: with dropout_p > 0 the replay must recompute it,
    # or the residual dropout after it would replay with a shifted stream
    for dtype in (torch.float32, torch.bfloat16):
        gpt = _gpt(ctx, dropout=0.1, n_layer=4, n_embd=512, n_head=8)
        idx = _tokens(ctx, gpt, 8, 512)
        autocast = dtype if dtype != torch.float32 else None
        apply_policy(gpt, "none")
        loss_a, plain = _fwd_bwd(gpt, idx, autocast=autocast)
        # the kernels' own nondeterminism (atomics in the fused attention backward): the largest of three reruns
        floor = max(_max_diff(plain, _fwd_bwd(gpt, idx, autocast=autocast)[1]) for _ in range(3))
        apply_policy(gpt, "selective")
        loss_b, selective = _fwd_bwd(gpt, idx, autocast=autocast)
        diff = _max_diff(plain, selective)
        ok = _bitwise(plain, selective) or (floor > 0 and diff <= 4 * floor)
        label = f"dropout 0.1 + residual dropout ({str(dtype).removeprefix('torch.')})"
        ctx.check(f"rng selective over SDPA {label}", ok, bitwise=_bitwise(plain, selective), max_abs_diff=diff,
                  plain_rerun_diff=floor, loss_plain=loss_a, loss_selective=loss_b)
        # the control: the old list policy (keeps SDPA whatever its dropout_p) must be visibly wrong here, far above
        # the kernels' noise, or the check above could not have caught the defect
        diff_old = _old_list_selective_diff(gpt, idx, plain, autocast)
        meaningful = diff_old >= 100 * floor and diff_old > 0
        ctx.check(f"rng control: the old policy is visibly wrong over SDPA {label}", meaningful or not ctx.cuda,
                  old_policy_max_abs_diff=diff_old, plain_rerun_diff=floor, needed=f">= 100 x {floor:.3g}",
                  control_meaningful=meaningful)
        remove_checkpointing(gpt)
        del gpt


def _old_list_selective_diff(gpt, idx, plain, autocast) -> float:
    """Gradients' distance from ``plain`` when SAC keeps every listed op (the policy before the fix)."""
    import functools

    import torch
    import torch.utils.checkpoint as cp

    from lightning_ckpt.core.policy import SELECTIVE_ALIASES
    from lightning_ckpt.core.wrap import get_plan

    names = [n for alias in ("mm", "sdpa") for n in SELECTIVE_ALIASES[alias] if hasattr(torch.ops.aten, n)]
    ops = [getattr(getattr(torch.ops.aten, n), o) for n in names for o in getattr(torch.ops.aten, n).overloads()]
    shared = get_plan(gpt).shared
    original = shared.checkpoint_kwargs

    def old_kwargs(mode):
        kwargs = original(mode)
        if mode == "selective":
            kwargs["context_fn"] = functools.partial(cp.create_selective_checkpoint_contexts, ops)
        return kwargs

    shared.checkpoint_kwargs = old_kwargs
    try:
        _, grads = _fwd_bwd(gpt, idx, autocast=autocast)
    finally:
        del shared.checkpoint_kwargs
    return _max_diff(plain, grads)


def _offload_step(model, idx):
    """Forward and backward under the math attention kernel (the fused kernels' backward may accumulate with atomics,
    which is not bitwise repeatable), from a fixed RNG state; returns the gradients."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.MATH):
        _, loss = model(idx, idx)
        loss.backward()
    if idx.is_cuda:
        torch.cuda.synchronize()
    return _grads(model)


def _copy_overlap(ctx: Context, model, idx) -> Dict[str, Any]:
    """From a profiler trace of one step: the device-to-host copies' streams, the kernels' streams, and the share of
    the copies' time that overlaps a kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _offload_step(model, idx)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    kernels = sorted((k["ts"], k["ts"] + k["dur"]) for k in events if _is_kernel(k))
    overlapped = total = 0.0
    for c in copies:
        start, end = c["ts"], c["ts"] + c["dur"]
        total += end - start
        overlapped += sum(max(0.0, min(end, b) - max(start, a)) for a, b in kernels if a < end and b > start)
    return {"copies": len(copies), "copy_streams": sorted({str(c["args"].get("stream")) for c in copies}),
            "kernel_streams": sorted({str(e["args"].get("stream")) for e in events if _is_kernel(e)}),
            "overlap": overlapped / total if total else 0.0}


def _is_kernel(event: Dict[str, Any]) -> bool:
    return event.get("cat") == "kernel"


@part("core", 90)
def part_offload(ctx: Context) -> None:
    """``offload``: gradients equal to ``off``, lower peaks allocated and reserved, no parameter moved, copies on a side
    stream overlapping compute, pinned memory bounded over 20 steps and released."""
    from lightning_ckpt import apply_policy
    from lightning_ckpt.core.offload import CudaTransfers, Transfers, configure_offload

    model = _gpt(ctx, n_layer=6, n_embd=1024, n_head=16, block_size=1024, vocab_size=8192)
    idx = _tokens(ctx, model, 8, 1024)
    plan = apply_policy(model, "none")
    _offload_step(model, idx)
    _reset_peak(ctx, empty_cache=True)
    off = _offload_step(model, idx)
    peak_off, reserved_off = _peaks(ctx)

    base = CudaTransfers if ctx.cuda else Transfers

    class Recording(base):
        def __init__(self) -> None:
            super().__init__()
            if not ctx.cuda:  # the CPU smoke run: CPU tensors play the device's
                self.is_device = lambda t: True
            self.sources: set = set()

        def copy_out(self, src, host):
            self.sources.add(src.untyped_storage().data_ptr())
            super().copy_out(src, host)

    plan.retarget("offload")
    transfers = Recording()
    state = configure_offload(plan, transfers=transfers)
    _offload_step(model, idx)  # the arena is allocated in the first offloaded step
    _reset_peak(ctx, empty_cache=True)
    offloaded = _offload_step(model, idx)
    peak_offload, reserved_offload = _peaks(ctx)
    per_step = state.bytes_out // 2  # two offloaded steps so far (read before the profiled step adds a third)
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    ctx.check("offload gradients bitwise equal to off", _bitwise(off, offloaded), max_abs_diff=_max_diff(off,
                                                                                                           offloaded))
    ctx.check("offload moves no parameter or view of one", not transfers.sources & params,
              storages_moved=len(transfers.sources), kept=dict(state.kept), bytes_out_mib=state.bytes_out / MiB)
    if ctx.cuda:
        # a tensor freed while its copy is pending leaves allocated at once but its block stays reserved until the
        # copy's stream passes it: only a lower reserved peak shows memory that would not run out
        saved, saved_reserved = peak_off - peak_offload, reserved_off - reserved_offload
        ctx.check("offload lowers max_memory_allocated and max_memory_reserved",
                  saved >= per_step // 4 and saved_reserved >= per_step // 4, off_mib=peak_off / MiB,
                  offload_mib=peak_offload / MiB, reserved_off_mib=reserved_off / MiB,
                  reserved_offload_mib=reserved_offload / MiB, moved_per_step_mib=per_step / MiB,
                  needed_saving_mib=per_step / 4 / MiB)
        overlap = _copy_overlap(ctx, model, idx)
        ctx.check("offload copies on a side stream, overlapping compute",
                  overlap["copies"] > 0 and not set(overlap["copy_streams"]) & set(overlap["kernel_streams"]),
                  **overlap)
    limit = max(per_step // 2, 1)
    state = configure_offload(plan, pinned_limit=limit, transfers=Recording())
    pinned = []
    for _ in range(20 if ctx.cuda else 3):
        _offload_step(model, idx)
        pinned.append(state.pinned_bytes)
    ctx.check("offload pinned memory bounded over the steps", max(pinned) <= limit and len(set(pinned)) == 1,
              limit_mib=limit / MiB, pinned_mib=sorted({p / MiB for p in pinned}),
              pageable_mib=state.pageable_bytes / MiB)
    plan.retarget("all")
    ctx.check("offload pinned memory released when the plan leaves offload", state.pinned_bytes == 0,
              pinned_after=state.pinned_bytes)


_FUSED_OPS = {"_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_flash_attention": "flash",
              "_scaled_dot_product_efficient_attention": "efficient"}


def _sdpa_run(ctx: Context, case, gpu, forecast: bool):
    """One SDPA call (forward and backward) on the part's device, or on the CPU under the planner's CUDA semantics
    for ``gpu`` (``forecast``): returns the rule's backend for these very tensors, the backend that ran and the bytes
    autograd saved (unique storages)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_ckpt.forecast.cuda import choose_sdpa, cuda_semantics

    dtype, head_dim, mask, dropout, causal = case
    device = "cpu" if forecast else ctx.device
    torch.manual_seed(0)
    b, h, length = 2, 8, 256
    q, k, v = (torch.randn(b, h, length, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    elif mask == "float":
        attn_mask = torch.zeros(b, 1, length, length, dtype=dtype, device=device)
    rule = choose_sdpa(q, k, v, attn_mask, dropout, causal, gpu=gpu).backend
    saved: Dict[Any, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.nbytes():
            saved[(t.device, st.data_ptr() or id(st))] = st.nbytes()
        return t

    class Seen(TorchDispatchMode):
        names: List[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    semantics = cuda_semantics("auto", gpu=gpu) if forecast else contextlib.nullcontext()
    with semantics, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Seen() as seen:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=causal)
    if not forecast:
        out.float().sum().backward()
    fused = [_FUSED_OPS[n] for n in seen.names if n in _FUSED_OPS]
    return rule, (fused[0] if fused else "math"), sum(saved.values())


@part("core", 60)
def part_attention(ctx: Context) -> None:
    """The planner's attention backend (PyTorch's selection order for this GPU, cuDNN and torch) and its saved bytes
    against what real CUDA SDPA runs and saves."""
    import torch

    from lightning_ckpt.forecast.sdpa import resolve_gpu

    gpu = resolve_gpu() if ctx.cuda else resolve_gpu("H100")
    ctx.note(f"target: {gpu.describe()}")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [(bf16, 64, None, 0.0, True), (bf16, 128, "bool", 0.0, False), (fp16, 64, None, 0.1, True),
             (bf16, 64, None, 0.125, True), (bf16, 256, None, 0.0, True), (bf16, 96, "float", 0.0, False),
             (fp32, 64, None, 0.0, True), (fp32, 6, None, 0.1, False)]
    for case in cases:
        dtype, head_dim, mask, dropout, causal = case
        label = f"{str(dtype).removeprefix('torch.')} d{head_dim} mask={mask} p={dropout} causal={causal}"
        rule, _, forecast_bytes = _sdpa_run(ctx, case, gpu, forecast=True)
        if not ctx.cuda:
            ctx.check(f"attention {label}: the rule decides and the forecast counts", forecast_bytes > 0,
                      rule=rule, forecast_bytes=forecast_bytes)
            continue
        rule, ran, real_bytes = _sdpa_run(ctx, case, gpu, forecast=False)
        ctx.check(f"attention {label}", ran == rule and abs(real_bytes - forecast_bytes) <= 64, rule=rule, ran=ran,
                  saved_bytes=real_bytes, forecast_bytes=forecast_bytes)


def _plain_loop_peaks(ctx: Context, model, opt, idx, meter=None) -> Dict[str, Any]:
    """One training step in Lightning's order (forward, zero_grad, backward, optimizer step). Without ``meter``,
    each phase's peak is read from torch's counters with a synchronize and a reset at every boundary; with it, the
    meter does its own reading (no sync) and the same step is run under it."""
    out: Dict[str, Any] = {}
    if meter is None:
        _reset_peak(ctx)
    else:
        _sync(ctx)
        meter.start_step(key=("gpu_check", tuple(idx.shape)))
    start = _allocated(ctx)
    _, loss = model(idx, idx)
    if meter is None:
        out["forward"] = _peak(ctx)
        out["end_of_forward"] = _allocated(ctx) - start
        _reset_peak(ctx)
    else:
        meter.phase("backward")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    del loss
    if meter is None:
        out["backward"] = _peak(ctx)
        _reset_peak(ctx)
    else:
        meter.phase("optimizer")
    opt.step()
    if meter is None:
        out["optimizer"] = _peak(ctx)
    else:
        reading = meter.stop_step()
        _sync(ctx)
        out.update(reading.phase_peaks or {}, activations=reading.activations, reading=reading)
    return out


@part("core", 90)
def part_ledger(ctx: Context) -> None:
    """The activation line and the phase peaks against a synchronized plain loop (torch's own counters, reset at
    each phase boundary), on the same model, batch and step order; then through a Trainer."""
    import torch

    from lightning_ckpt import ActivationCheckpointing, apply_policy
    from lightning_ckpt.measure.meter import StepMeter

    model = _gpt(ctx, n_layer=8, n_embd=1024, n_head=16, block_size=1024, vocab_size=8192)
    apply_policy(model, "every:2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = _tokens(ctx, model, 8, 1024)
    meter = StepMeter(ctx.device, model=model)
    for _ in range(2):  # AdamW's state exists from the second step on
        _plain_loop_peaks(ctx, model, opt, idx)
    plain = [_plain_loop_peaks(ctx, model, opt, idx) for _ in range(2)]
    metered = [_plain_loop_peaks(ctx, model, opt, idx, meter) for _ in range(3)]  # reference step, then default
    for phase in ("forward", "backward", "optimizer"):
        want = max(p[phase] for p in plain)
        got = [m[phase] for m in metered]
        ok = all(abs(g - want) <= max(MiB, 0.005 * want) for g in got) if ctx.cuda else True
        ctx.check(f"ledger phase peak {phase} (meter vs synchronized loop)", ok, loop_mib=want / MiB,
                  meter_mib=[g / MiB for g in got])
    want = max(p["end_of_forward"] for p in plain)
    got = [m["activations"] for m in metered]
    ok = all(abs(g - want) <= 0.05 * want for g in got) if ctx.cuda else all(g and g > 0 for g in got)
    ctx.check("ledger activation line (meter vs bytes the forward left alive)", ok, loop_mib=want / MiB,
              meter_mib=[g / MiB for g in got], reference=[m["reading"].reference for m in metered])
    loop_phases = {phase: max(p[phase] for p in plain) for phase in ("forward", "backward", "optimizer")}
    del model, opt, meter, plain, metered
    gc.collect()

    # through a Trainer: the same figures as logged
    module = _module(ctx, n_layer=8, n_embd=1024, n_head=16, block_size=1024, vocab_size=8192, lr=1e-4)
    cb = ActivationCheckpointing(policy="every:2")
    with tempfile.TemporaryDirectory() as root:
        _trainer(ctx, root, [cb], max_steps=4).fit(module, train_dataloaders=_loader(module, 8, 1024, 4, ctx.smoke))
    reading = cb.last_result.reading
    phases = reading.phase_peaks or {}
    for phase, want in loop_phases.items():
        got = phases.get(phase, 0)
        # Lightning's loop adds a few small tensors (the logged loss, its progress-bar copy)
        ok = abs(got - want) <= max(8 * MiB, 0.02 * want) if ctx.cuda else got > 0
        ctx.check(f"ledger phase peak {phase} (Trainer vs plain loop)", ok, loop_mib=want / MiB, trainer_mib=got / MiB)
    ctx.check("ledger metrics logged", all(k in cb.last_metrics for k in (
        "memory/activations_gib", "memory/peak_forward_gib", "time/step_s", "throughput/tokens_per_sec")),
        activations_gib=cb.last_metrics.get("memory/activations_gib"), step_s=cb.last_metrics.get("time/step_s"))


_OOM_MODEL = dict(n_layer=8, n_embd=1024, n_head=16, block_size=2048, vocab_size=32768)


class _FirstGrads:
    """A Lightning callback (built lazily) keeping the gradients of the first optimizer step."""

    @staticmethod
    def make():
        from lightning.pytorch import Callback

        class FirstGrads(Callback):
            grads: Optional[Dict[str, Any]] = None

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                if self.grads is None:
                    self.grads = {n: p.grad.detach().float().cpu().clone()
                                  for n, p in pl_module.named_parameters() if p.grad is not None}

        return FirstGrads()


def _recorded(cb) -> List[str]:
    """The engine's info lines, kept (the out-of-memory retries announce themselves there)."""
    engine, lines = cb._engine, []
    original = engine.info

    def info(message: str) -> None:
        lines.append(message)
        original(message)

    engine.info = info
    return lines


def _loop_phase_peaks(ctx: Context, policy: str, batch: int, seq: int) -> Dict[str, int]:
    """Peak allocated per phase of a plain loop's steady-state step under ``policy`` (synchronized, reset)."""
    import torch

    from lightning_ckpt import apply_policy

    model = _gpt(ctx, **_OOM_MODEL)
    apply_policy(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = _tokens(ctx, model, batch, seq)
    for _ in range(2):
        peaks = _plain_loop_peaks(ctx, model, opt, idx)
    del model, opt, idx
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return peaks


def _capped(ctx: Context, capacity: Optional[int]):
    """Limit this process's CUDA memory to ``capacity`` bytes (``None``: lift the limit)."""
    import torch

    if not ctx.cuda:
        return
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if capacity is None else min(1.0, capacity / total), ctx.device)


@part("core", 120)
def part_oom(ctx: Context) -> None:
    """A real out-of-memory error (a per-process memory fraction) in the forward and in the backward, escalated:
    the run completes, the retried step's gradients equal a clean run's, memory returns to its baseline."""
    import torch

    from lightning_ckpt import ActivationCheckpointing

    batch, seq = 8, 2048
    none = _loop_phase_peaks(ctx, "none", batch, seq)
    every = _loop_phase_peaks(ctx, "every:2", batch, seq)
    full = _loop_phase_peaks(ctx, "all", batch, seq)
    step_peak = {name: max(p["forward"], p["backward"], p["optimizer"]) for name, p in
                 (("none", none), ("every:2", every), ("all", full))}
    ctx.note("loop peaks MiB: " + ", ".join(f"{k} {v / MiB:.0f}" for k, v in step_peak.items())
             + f"; none forward {none['forward'] / MiB:.0f}, backward {none['backward'] / MiB:.0f}")
    cases = {
        # below none's forward, above every rung that checkpoints: the forward dies, the retry fits
        "forward": max(step_peak["all"], step_peak["every:2"]) + 512 * MiB,
        # between none's forward and its backward: the forward fits, the backward dies
        "backward": (none["forward"] + none["backward"]) // 2,
    }
    for phase, capacity in cases.items():
        feasible = none["forward"] > capacity if phase == "forward" else \
            none["forward"] < capacity < none["backward"] and step_peak["all"] < capacity
        if ctx.cuda and not feasible:
            ctx.check(f"oom in the {phase} (capacity {capacity / MiB:.0f} MiB)", False,
                      reason="this model's phase peaks leave no capacity that fails there only", **{
                          k: v / MiB for k, v in none.items() if isinstance(v, int)})
            continue
        gc.collect()
        baseline = _allocated(ctx)
        module = _module(ctx, **_OOM_MODEL, lr=1e-4)
        cb = ActivationCheckpointing(policy="none", on_oom="escalate")
        lines, grads = _recorded(cb), _FirstGrads.make()
        _capped(ctx, capacity)
        try:
            with tempfile.TemporaryDirectory() as root:
                trainer = _trainer(ctx, root, [cb, grads], max_steps=3)
                trainer.fit(module, train_dataloaders=_loader(module, batch, seq, 3, ctx.smoke))
        finally:
            _capped(ctx, None)
        retried = [line for line in lines if "out of memory" in line]
        final, steps = cb.plan.spec, trainer.global_step
        peak = cb.last_result.reading.peak_allocated if cb.last_result and cb.last_result.reading else None
        del trainer, module, cb
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
        leaked = _allocated(ctx) - baseline
        clean_module = _module(ctx, **_OOM_MODEL, lr=1e-4)
        clean_grads = _FirstGrads.make()
        with tempfile.TemporaryDirectory() as root:
            _trainer(ctx, root, [ActivationCheckpointing(policy=final), clean_grads], max_steps=1).fit(
                clean_module, train_dataloaders=_loader(clean_module, batch, seq, 1, ctx.smoke))
        del clean_module
        gc.collect()
        scale = max((g.abs().max().item() for g in clean_grads.grads.values()), default=1.0)
        diff = _max_diff(grads.grads, clean_grads.grads)
        said = any(f"in the {phase}" in line for line in retried)
        ok = steps == 3 and diff <= 1e-5 * scale and leaked <= MiB
        if ctx.cuda:  # the CPU has no memory fraction: nothing runs out there
            ok = ok and final != "none" and said and peak is not None and peak <= capacity
        ctx.check(f"oom in the {phase} escalated (capacity {capacity / MiB:.0f} MiB)", ok, steps=steps,
                  final_plan=final, retries=len(retried), phase_named=said,
                  retried_step_peak_mib=None if peak is None else peak / MiB, grad_max_abs_diff=diff,
                  grad_scale=scale, leaked_bytes=leaked)


@part("core", 120)
def part_budget(ctx: Context) -> None:
    """``budget:`` on a card just above ``all``'s peak: the calibration (whose stages keep blocks off) completes
    without failing the run, and the chosen plan fits."""
    from lightning_ckpt import ActivationCheckpointing

    batch, seq = 8, 2048
    full = _loop_phase_peaks(ctx, "all", batch, seq)
    capacity = max(full["forward"], full["backward"], full["optimizer"]) + 768 * MiB
    module = _module(ctx, **_OOM_MODEL, lr=1e-4)
    # the activation budget: what the card leaves after the model state (AdamW: weights, gradients, two moments)
    state = 4 * sum(p.numel() * p.element_size() for p in module.parameters())
    budget = max(capacity - state - 256 * MiB, MiB)
    cb = ActivationCheckpointing(policy=f"budget:{budget}", on_oom="escalate", capacity=capacity)
    lines = _recorded(cb)
    _capped(ctx, capacity)
    steps = 0
    error = ""
    try:
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(ctx, root, [cb], max_steps=14)
            trainer.fit(module, train_dataloaders=_loader(module, batch, seq, 14, ctx.smoke))
            steps = trainer.global_step
    except Exception as err:  # noqa: BLE001 - the verdict reports it
        error = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        _capped(ctx, None)
    calibration = cb.calibration
    chosen = calibration.chosen if calibration is not None else None
    ok = not error and steps == 14 and calibration is not None and calibration.done and chosen is not None
    ok = ok and calibration.measured is not None and calibration.measured <= budget
    ctx.check("budget calibrates and fits on a card just above all's peak", ok, capacity_mib=capacity / MiB,
              budget_mib=budget / MiB, steps=steps, plan=None if chosen is None else list(chosen.modes),
              predicted_mib=None if chosen is None else chosen.predicted_peak / MiB,
              measured_mib=None if calibration is None or calibration.measured is None else calibration.measured / MiB,
              retries=sum("out of memory" in line for line in lines), model_state_mib=state / MiB,
              error=error)


def _sharded_module(ctx: Context, **sizes):
    """The demo GPT sharded with FSDP2 in ``configure_model``: each block, then the root (the FSDP2 recipe)."""
    from lightning_ckpt.demos import GPTLightningModule

    class Sharded(GPTLightningModule):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"] if self.device_mesh.mesh_dim_names else self.device_mesh
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            # the root is the GPT the training step calls (the LightningModule's own forward is never called)
            fully_shard(self.model, mesh=mesh)

    base = _module(ctx, **sizes)
    module = Sharded(**dict(base.hparams))
    module.load_state_dict(base.state_dict())
    return module


@part("rest", 120)
def part_fsdp2(ctx: Context) -> None:
    """FSDP2 (``fully_shard`` per block, Lightning's ModelParallelStrategy) on one GPU with the callback: it trains,
    logs the activation line, and the first step's gradients equal the unsharded model's."""
    sizes = dict(n_layer=4, n_embd=512, n_head=8, block_size=512, vocab_size=4096)
    try:
        results = _fsdp2_runs(ctx, sizes)
    finally:
        _destroy_process_group()
    steps, metrics, sharded, blocks = results["fsdp2"]
    plain = results["plain"][2]
    scale = max((g.abs().max().item() for g in plain.values()), default=1.0)
    diff = _max_diff({k.replace("_orig_mod.", ""): v for k, v in sharded.items()}, plain)
    ok = steps == 3 and blocks > 0 and metrics.get("memory/activations_gib", 0) > 0 and diff <= 1e-5 * scale
    ctx.check("fsdp2 on one device", ok, steps=steps, checkpointed_blocks=blocks,
              activations_gib=metrics.get("memory/activations_gib"), grad_max_abs_diff=diff, grad_scale=scale)


def _fsdp2_runs(ctx: Context, sizes: Dict[str, int]) -> Dict[str, tuple]:
    """The plain and the sharded run: (steps, logged metrics, first-step gradients, checkpointed blocks) each."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_ckpt import ActivationCheckpointing

    results = {}
    for name in ("plain", "fsdp2"):
        module = _module(ctx, **sizes) if name == "plain" else _sharded_module(ctx, **sizes)
        cb, grads = ActivationCheckpointing(policy="all"), _FirstGrads.make()
        extra = {"strategy": ModelParallelStrategy()} if name == "fsdp2" else {}
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(ctx, root, [cb, grads], max_steps=3, **extra)
            trainer.fit(module, train_dataloaders=_loader(module, 8, 512, 3, ctx.smoke))
        grads_full = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.grads.items()}
        results[name] = (trainer.global_step, dict(cb.last_metrics), grads_full, cb.plan.num_checkpointed)
        del trainer, module
        gc.collect()
    return results


def _destroy_process_group() -> None:
    """Lightning's strategies leave the process group up; an NCCL group alive at exit can abort or hang the exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _StepTimes:
    """A Lightning callback (built lazily) timing each optimizer step, synchronized on CUDA."""

    @staticmethod
    def make(ctx: Context):
        from lightning.pytorch import Callback

        class StepTimes(Callback):
            def __init__(self) -> None:
                self.stamps: List[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                _sync(ctx)
                self.stamps.append(time.perf_counter())

            def steps(self, warmup: int) -> List[float]:
                return [b - a for a, b in zip(self.stamps[warmup:], self.stamps[warmup + 1:])]

        return StepTimes()


# the recording symbolizes C++ frames; addr2line (the default mode) can take minutes on a big binary
@part("rest", 180, env={"TORCH_SYMBOLIZE_MODE": "fast"})
def part_snapshot(ctx: Context) -> None:
    """``snapshot_on_oom=True``'s cost: the allocator recording its history (bounded) on every step, against the same
    run without it, in interleaved rounds; and that the recording is really on (the history has events)."""
    import statistics

    from lightning_ckpt import ActivationCheckpointing

    steps, warmup, rounds = (6, 1, 1) if ctx.smoke else (14, 3, 3)
    times: Dict[bool, List[float]] = {False: [], True: []}
    traced = 0
    for _ in range(rounds):
        for on in (False, True):
            module, timer = _module(ctx), _StepTimes.make(ctx)
            cb = ActivationCheckpointing(policy="none", snapshot_on_oom=on)
            # the history the run recorded, read after its last step, before the callback stops recording
            probe = _HistoryProbe.make(steps) if on and ctx.cuda else None
            with tempfile.TemporaryDirectory() as root, warnings_silenced():
                trainer = _trainer(ctx, root, [cb, timer, *[probe] * (probe is not None)], max_steps=steps)
                trainer.fit(module, train_dataloaders=_loader(module, 8, 512, steps, ctx.smoke))
            traced = max(traced, probe.events if probe is not None else 0)
            times[on].extend(timer.steps(warmup))
            del trainer, module, cb
            gc.collect()
    off_s, on_s = statistics.median(times[False]), statistics.median(times[True])
    ratio = on_s / off_s
    ok = len(times[True]) == len(times[False]) == rounds * (steps - warmup - 1) and (traced > 0 or not ctx.cuda)
    ctx.check("snapshot_on_oom recording cost (median step time, on / off)", ok, ratio=ratio,
              off_ms=off_s * 1e3, on_ms=on_s * 1e3, steps_each=len(times[True]), history_events=traced)


class _HistoryProbe:
    """A Lightning callback (built lazily) reading how many events the allocator's history holds after the last of
    ``steps`` steps (after the last timestamp: reading the history is not part of any timed step)."""

    @staticmethod
    def make(steps: int):
        from lightning.pytorch import Callback

        class HistoryProbe(Callback):
            events = 0

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                import torch

                if batch_idx != steps - 1:
                    return
                traces = torch.cuda.memory._snapshot().get("device_traces") or [[]]
                self.events = sum(len(t) for t in traces)

        return HistoryProbe()


@contextlib.contextmanager
def warnings_silenced():
    """``snapshot_on_oom`` warns on a CPU smoke run that it does nothing there: expected."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _StepGrads:
    """A Lightning callback (built lazily) keeping the gradients of optimizer step ``step`` (counting from 1) and the
    checkpointing callback's reading of that step."""

    @staticmethod
    def make(step: int, checkpointing):
        from lightning.pytorch import Callback

        class StepGrads(Callback):
            grads: Optional[Dict[str, Any]] = None
            reading: Any = None

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                if trainer.global_step == step - 1:
                    self.grads = {n: p.grad.detach().float().cpu().clone()
                                  for n, p in pl_module.named_parameters() if p.grad is not None}

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                # listed after the checkpointing callback, whose own hook has read the step by now
                if trainer.global_step == step and checkpointing.last_result is not None:
                    self.reading = checkpointing.last_result.reading

        return StepGrads()


# the step whose gradients compiled and eager runs compare: the meter makes the first step of each key exact, and
# exact steps run compiled code eagerly; the key changes once, when the optimizer state appears, so steps 1 and 2
# are eager in both runs (the weights entering step 3 are equal) and step 3 is the first compiled one
_COMPILED_STEP = 3


@part("rest", 240)
def part_compile(ctx: Context) -> None:
    """``compile_blocks=True`` with inductor: it trains, its first compiled step's gradients match eager's to float
    rounding, the graphs stay within dynamo's recompile limit, and compiled ``all`` holds eager ``all``'s memory
    (±5 %)."""
    import torch

    from lightning_ckpt import ActivationCheckpointing

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        ctx.check("compile_blocks needs a C compiler", False, reason="install gcc (or put cc on PATH): inductor "
                  "builds Triton's launcher and its CPU kernels with it; no cc or gcc was found on PATH")
        return
    sizes = dict(n_layer=6, n_embd=1024, n_head=16, block_size=1024, vocab_size=8192)
    rows = {}
    for name in ("eager", "compiled"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        module = _module(ctx, **sizes)
        cb = ActivationCheckpointing(policy="all", compile_blocks=name == "compiled")
        grads = _StepGrads.make(_COMPILED_STEP, cb)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(ctx, root, [cb, grads], max_steps=4)
            trainer.fit(module, train_dataloaders=_loader(module, 8, 1024, 4, ctx.smoke))
        reading = cb.last_result.reading
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        rows[name] = dict(steps=trainer.global_step, grads=grads.grads, compared=grads.reading,
                          peak=reading.peak_allocated, activations=reading.activations, graphs=graphs,
                          seconds=time.perf_counter() - t0)
        del trainer, module
        gc.collect()
    eager, compiled = rows["eager"], rows["compiled"]
    compared = compiled["compared"]
    ctx.check(f"compile_blocks step {_COMPILED_STEP} ran compiled (its reading is not an exact, eager step)",
              compared is not None and not compared.exact, read=compared is not None,
              exact=None if compared is None else compared.exact, compiler=compiler)
    scale = max((g.abs().max().item() for g in (eager["grads"] or {}).values()), default=1.0)
    diff = _max_diff({k.replace("_orig_mod.", ""): v for k, v in (compiled["grads"] or {}).items()},
                     eager["grads"] or {})
    ctx.check(f"compile_blocks trains, step {_COMPILED_STEP}'s gradients match eager's",
              compiled["steps"] == 4 and diff <= 2e-3 * scale, grad_max_abs_diff=diff, grad_scale=scale,
              fit_s=compiled["seconds"])
    limit = torch._dynamo.config.recompile_limit if hasattr(torch._dynamo.config, "recompile_limit") else \
        torch._dynamo.config.cache_size_limit
    ctx.check("compile_blocks graphs within the recompile limit", 0 < compiled["graphs"] <= limit or ctx.smoke,
              unique_graphs=compiled["graphs"], limit=limit)
    if ctx.cuda:
        ratio = compiled["peak"] / eager["peak"]
        ctx.check("compiled all's peak allocated vs eager all's (within ±5 %)", abs(ratio - 1) <= 0.05, ratio=ratio,
                  eager_mib=eager["peak"] / MiB, compiled_mib=compiled["peak"] / MiB)


_SEED = dict(n_layer=24, n_embd=2048, n_head=16, block_size=2048, vocab_size=50304)


def _seed_module(**overrides):
    from lightning_ckpt.demos import GPTLightningModule

    return GPTLightningModule(**{**_SEED, **overrides})


@part("rest", 240)
def part_seed(ctx: Context) -> None:
    """The seed's worked example: 1.3B parameters, hidden 2048, 24 blocks, micro-batch 2 × 2048 tokens. The
    planner's numbers for the seed's dtypes, then the closest Lightning configuration (``bf16-true`` with AdamW)
    forecast per phase and measured."""
    import torch

    from lightning_ckpt import ActivationCheckpointing
    from lightning_ckpt.forecast.numbers import ForecastInputs, forecast_from_numbers
    from lightning_ckpt.forecast.trace import forecast_model

    seed = forecast_from_numbers(ForecastInputs(params=1.3e9, param_dtype="bf16", grad_dtype="bf16", optimizer="adam",
                                                moment_dtype="fp32", master_dtype="fp32", layers=24, hidden=2048,
                                                micro_batch=2, seq_len=2048, act_dtype="bf16", tensors_per_block=6,
                                                policies=("none", "all")))
    want = dict(params=2.42, grads=2.42, optimizer=9.69, master=4.84, model_state=19.37)
    got = {k: getattr(seed, k) / GiB for k in want}
    ctx.check("seed arithmetic: the ledger lines (GiB)", all(abs(got[k] - v) < 0.01 for k, v in want.items()),
              **{k: round(v, 3) for k, v in got.items()})
    ctx.check("seed arithmetic: one hidden-width tensor, retained and boundary activations",
              seed.hidden_tensor == 16 * MiB and seed.boundary_all == 384 * MiB
              and 24 * 6 * seed.hidden_tensor == 2304 * MiB,
              hidden_tensor_mib=seed.hidden_tensor / MiB, boundaries_mib=seed.boundary_all / MiB,
              retained_6_per_block_mib=24 * 6 * seed.hidden_tensor / MiB)

    sizes = {} if not ctx.smoke else dict(n_layer=2, n_embd=64, n_head=4, block_size=128, vocab_size=512)
    batch, seq = (2, 2048) if not ctx.smoke else (2, 128)
    precision = "bf16-true" if ctx.cuda else "32-true"
    forecast = forecast_model(_seed_module, sizes, micro_batch=batch, seq_len=seq, policies=("none", "all"),
                              precision=precision, device="cuda" if ctx.cuda else "cpu", optimizer="adamw")
    ctx.note(f"forecast ({precision}, AdamW): params {forecast.params / GiB:.2f} GiB, grads "
             f"{forecast.grads / GiB:.2f}, optimizer {forecast.optimizer / GiB:.2f}, master "
             f"{forecast.master / GiB:.2f}; under bf16-true the parameters, gradients and AdamW's moments are all "
             "bf16 and there is no master copy")
    for policy in ("none", "all"):
        with torch.device(ctx.device):
            module = _seed_module(**sizes)
        cb = ActivationCheckpointing(policy=policy)
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(ctx, root, [cb], max_steps=3, precision=precision)
            trainer.fit(module, train_dataloaders=_loader(module, batch, seq, 3, ctx.smoke))
        reading = cb.last_result.reading
        measured = reading.phase_peaks or {}
        predicted = forecast.phase_peaks[policy]
        ratios = {phase: measured.get(phase, 0) / predicted[phase] for phase in predicted if predicted[phase]}
        ok = all(abs(r - 1) <= 0.10 for r in ratios.values()) if ctx.cuda else bool(measured)
        ctx.check(f"seed model {policy}: forecast per phase vs measured (within ±10 %)", ok,
                  predicted_gib={k: round(v / GiB, 3) for k, v in predicted.items()},
                  measured_gib={k: round(v / GiB, 3) for k, v in measured.items()},
                  ratios={k: round(v, 3) for k, v in ratios.items()},
                  activations_predicted_gib=round(forecast.activations[policy] / GiB, 3),
                  activations_measured_gib=None if reading.activations is None else round(reading.activations / GiB, 3))
        del trainer, module, cb
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


@part("rest", 300)
def part_overhead(ctx: Context) -> None:
    """The measurement's overhead on a GPU-bound model (every step measured and logged vs none): at most 1 %."""
    out = os.path.join(ctx.out, "overhead.json")
    args = ["--accelerator", "gpu", "--layers", "12", "--width", "1536", "--vocab", "32768", "--batch", "8", "--seq",
            "1024", "--precision", "bf16-mixed", "--rounds", "6", "--json", out]
    if ctx.smoke:
        args = ["--quick", "--rounds", "1", "--json", out]
    # streamed, and stopped a few seconds under the part's limit, so a slow benchmark still reports what it printed
    rc, _ = _run_streamed([sys.executable, os.path.join(HERE, "overhead.py"), *args], ctx.deadline - 10)
    result = json.load(open(out)) if os.path.exists(out) else {}
    ok = rc == 0 and bool(result.get("passed")) if not ctx.smoke else rc == 0
    ctx.check("measurement overhead on a GPU-bound model (<= 1.01)", ok, median_ratio=result.get("ratio"),
              ratios=result.get("ratios"), rc="timeout" if rc is None else rc)


@part("selftest", 30, start_s=3)
def part_selftest(ctx: Context) -> None:
    """The driver's own test (tests/test_gpu_check.py): one passing check, then a thread that would hold the exit."""
    # a non-daemon thread keeps a normal interpreter exit waiting; the part's process must end anyway
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    ctx.check("selftest passes", True)


@part("selftest", 60, start_s=3)
def part_selftest_hang(ctx: Context) -> None:
    """The driver's own test (tests/test_gpu_check.py): a check, then a grandchild, half a line, and a hang."""
    ctx.check("selftest before the hang", True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.path.join(ctx.out, "selftest_grandchild.pid"), "w") as fh:
        fh.write(str(child.pid))
    print("selftest: half a line", end="", flush=True)
    time.sleep(3600)


# --------------------------------------------------------------------------------------------------- driver


def _environment() -> List[str]:
    import torch

    lines = [f"python {platform.python_version()} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
             f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}"]
    for name in ("lightning", "transformers"):
        try:
            lines[0] += f" | {name} {__import__(name).__version__}"
        except ImportError:
            lines[0] += f" | {name} not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU {props.name} | SM {props.major}.{props.minor} | {props.total_memory / GiB:.1f} GiB | "
                     f"{torch.cuda.device_count()} device(s)")
    return lines


def _run_part(name: str, smoke: bool, out: str, timeout_s: float) -> int:
    """The child: run one part, its checks written to ``out/<name>.json`` after each one and once it returns."""
    device = None
    if PARTS[name].tier != "selftest":  # the driver's self-tests need no torch, and start faster without it
        import torch

        device = torch.device("cuda", 0) if not smoke else torch.device("cpu")
        if smoke:
            torch.set_num_threads(1)
    ctx = Context(device=device, smoke=smoke, out=out, deadline=time.monotonic() + timeout_s,
                  result_path=os.path.join(out, f"{name}.json"))
    ctx.save(finished=False)
    error = None
    t0 = time.perf_counter()
    try:
        PARTS[name].run(ctx)
    except Exception:  # noqa: BLE001 - a part's crash is its verdict, with the traceback in the log
        error = traceback.format_exc()
        print(error, flush=True)
    ctx.save(finished=True, error=error, seconds=time.perf_counter() - t0)
    return 0 if error is None and all(c["ok"] for c in ctx.checks) else 1


class _Interrupted(Exception):
    """The driver was told to stop (SIGTERM, SIGINT, SIGHUP); ``row`` is the part it was running, if any."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.row: Optional[Dict[str, Any]] = None


def _on_signal(signum: int, frame: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # one stop is enough: let the cleanup finish
        signal.signal(sig, signal.SIG_IGN)
    raise _Interrupted(signum)


def _default_order() -> List[str]:
    """Every part, the core ones first. Among them ``tests`` runs last: its pytest run repeats much of what the
    other core parts check, and it is the one most likely to run long, so it must not take the time of the parts
    whose figures nothing else gives; it still runs before the rest."""
    core = [n for n, p in PARTS.items() if p.tier == "core" and n != "tests"]
    return core + ["tests"] * ("tests" in PARTS) + [n for n, p in PARTS.items() if p.tier == "rest"]


def _drive(names: List[str], run: Dict[str, Any], emit: Callable[[str], None], log) -> None:
    """Run ``names`` in order within the budget, appending a row per part to ``run["parts"]`` and writing the JSON
    summary (and the table into the log) after every part, so an outer kill keeps what finished."""
    rows = run["parts"]
    end = run["start"] + run["budget_s"]
    for i, name in enumerate(names):
        p = PARTS[name]
        left = end - time.monotonic()
        run.update(running=name, pending=names[i + 1:])
        if left < p.start_s:
            reason = (f"skipped: give a larger --budget-s or run it alone (--only {name}); {max(left, 0):.0f} s were "
                      f"left of --budget-s {run['budget_s']:g}, under the {p.start_s} s it needs to be worth starting")
            row = _row(p, "SKIP", 0.0, 0.0, [], reason)
        else:
            timeout_s = min(float(p.timeout_s), left)
            emit(f"==== {name} ({p.tier}, timeout {timeout_s:.0f} s): {p.doc}\n")
            _write_summary(run)
            try:
                row = _run_child(p, run["smoke_cpu"], run["out"], timeout_s, emit)
            except _Interrupted as err:
                rows.extend([err.row] * (err.row is not None))
                raise
        rows.append(row)
        run.update(running=None)
        emit(f"==== {name}: {row['verdict']} {row['passed']}/{row['checks']} in {row['seconds']:.1f} s"
             + (f"  {_why(row)}" if _why(row) else "") + "\n")
        _write_summary(run)
        if i < len(names) - 1:
            log.write("\n".join(["---- summary so far", *_summary(run), ""]) + "\n")
            log.flush()


def _run_child(p: Part, smoke: bool, out: str, timeout_s: float, emit: Callable[[str], None]) -> Dict[str, Any]:
    """Run one part in its own session (its process group holds whatever it starts), streaming its output, and kill
    the group when it ends: at the timeout, on an interruption, and after a normal exit (what it left behind)."""
    path = os.path.join(out, f"{p.name}.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--part", p.name, "--out", out, "--timeout-s",
           f"{timeout_s:.1f}"] + ["--smoke-cpu"] * smoke
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **p.env))
    stopped, interrupted = None, None  # why the driver ended the part, if it did
    try:
        if not _pump(proc, t0 + timeout_s, emit):
            stopped = f"timeout after {timeout_s:.0f} s"
    except _Interrupted as err:
        stopped, interrupted = f"interrupted by {err}", err
    finally:
        _kill_group(proc.pid)
        rc = proc.wait()
        proc.stdout.close()
    row = _finished_row(p, path, stopped, rc, time.monotonic() - t0, timeout_s)
    if interrupted is not None:
        interrupted.row = row
        raise interrupted
    return row


def _kill_group(pgid: int) -> None:
    """Kill a part's process group: the part and its descendants (pytest workers, a benchmark)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass


def _finished_row(p: Part, path: str, stopped: Optional[str], rc: Optional[int], seconds: float,
                  timeout_s: float) -> Dict[str, Any]:
    """A part's row from its result file, whenever the file exists: a part that finished its checks keeps their
    verdict even if its process then hung or died; one that did not finish fails with the checks it recorded."""
    result: Dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as fh:
            result = json.load(fh)
        os.remove(path)
    checks = result.get("checks", [])
    ended = stopped or (f"exit {rc}" if rc not in (0, 1) else None)
    if result.get("finished"):
        error, note = result.get("error"), ended and f"{ended} after the part had written its result"
    else:
        error, note = f"{ended or 'no result written'} ({len(checks)} checks recorded before)", None
    verdict = "PASS" if error is None and checks and all(c["ok"] for c in checks) else "FAIL"
    return _row(p, verdict, seconds, timeout_s, checks, error, note)


def _row(p: Part, verdict: str, seconds: float, timeout_s: float, checks: List[Dict[str, Any]],
         error: Optional[str], note: Optional[str] = None) -> Dict[str, Any]:
    return {"part": p.name, "tier": p.tier, "verdict": verdict, "seconds": round(seconds, 1),
            "timeout_s": round(timeout_s, 1), "passed": sum(c["ok"] for c in checks), "checks": len(checks),
            "error": error, "note": note, "details": checks}


def _pump(proc: subprocess.Popen, deadline: float, emit: Callable[[str], None]) -> bool:
    """Copy ``proc``'s output to ``emit`` line by line until it exits (``True``) or ``deadline`` passes (``False``).

    The pipe is read with ``os.read`` after ``select``: no line waits in a reader's buffer, a partial line cannot
    block past the deadline, and what is left of one is emitted at the end. A process that exited while something
    it started still holds the pipe open counts as ended once its output stops.
    """
    fd, pending = proc.stdout.fileno(), b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                if proc.poll() is not None:
                    return True
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return True
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                emit(line.decode(errors="replace") + "\n")
    finally:
        if pending:
            emit(pending.decode(errors="replace") + "\n")


def _why(row: Dict[str, Any]) -> str:
    failed = [c["name"] for c in row["details"] if not c["ok"]]
    text = "; ".join(failed) or (str(row["error"]).strip().splitlines()[-1] if row["error"] else "") or \
        (row.get("note") or "")
    return text


def _summary(run: Dict[str, Any]) -> List[str]:
    rows = run["parts"]
    lines = [f"{'part':<13} {'tier':<5} {'verdict':<8} {'checks':>7} {'seconds':>8}  failed checks / error"]
    for r in rows:
        lines.append(f"{r['part']:<13} {r['tier']:<5} {r['verdict']:<8} {r['passed']:>3}/{r['checks']:<3} "
                     f"{r['seconds']:>8.1f}  {_why(r)[:110]}")
    for name in [run["running"]] * bool(run.get("running")) + run.get("pending", []):
        lines.append(f"{name:<13} {PARTS[name].tier:<5} {'not run':<8}")
    by_tier = {t: sum(r["seconds"] for r in rows if r["tier"] == t) for t in ("core", "rest")}
    verdicts = [r["verdict"] for r in rows]
    skipped = f", {verdicts.count('SKIP')} SKIP" if "SKIP" in verdicts else ""
    lines.append(f"core {by_tier['core']:.0f} s (target < 240), rest {by_tier['rest']:.0f} s (target < 480), "
                 f"{time.monotonic() - run['start']:.0f} s of the {run['budget_s']:g} s budget; "
                 f"{verdicts.count('PASS')}/{len(rows) + len(run.get('pending', []))} parts PASS{skipped}")
    return lines


def _write_summary(run: Dict[str, Any]) -> None:
    """The JSON summary as it stands: the finished parts, the one running (if any) and those still to run."""
    data = {k: run.get(k) for k in ("environment", "smoke_cpu", "budget_s", "running", "pending", "interrupted")}
    data.update(seconds=round(time.monotonic() - run["start"], 1), parts=run["parts"])
    _write_json(os.path.join(run["out"], "gpu_check.json"), data)


def main(argv: Optional[List[str]] = None) -> int:
    start = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help=f"comma-separated parts: {','.join(_listed_parts())}")
    p.add_argument("--smoke-cpu", action="store_true", help="run every part's code path on the CPU (development)")
    p.add_argument("--out", default="", help="folder for the log and the JSON summary (default $OUT, else "
                                             "./gpu_check_out)")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="wall-clock seconds for the whole run (default 560, under a 600 s call): each part's timeout "
                        "is capped at the time left, and a part that cannot start with enough left is skipped")
    p.add_argument("--part", default="", help=argparse.SUPPRESS)  # the child process of one part
    p.add_argument("--timeout-s", type=float, default=math.inf, help=argparse.SUPPRESS)  # the child's limit
    args = p.parse_args(argv)
    out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out")
    os.makedirs(out, exist_ok=True)
    if args.part:
        code = _run_part(args.part, args.smoke_cpu, out, args.timeout_s)
        # the result is written: end here, whatever threads, process groups or atexit hooks would hold the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if not args.budget_s > 0:
        p.error(f"--budget-s {args.budget_s!r}: give a positive number of seconds, e.g. --budget-s 560")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or _default_order()
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: unknown part; choose among {','.join(_listed_parts())}")
    try:
        import torch
    except ImportError:
        print(f"gpu_check: {sys.executable} has no torch; run it with the python3 that has torch (PYTHON=...).")
        return 2
    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}); run it on "
              "the lent GPU machine, or pass --smoke-cpu to exercise the parts on the CPU.")
        return 2
    return _check(names, args.smoke_cpu, out, args.budget_s, start)


def _check(names: List[str], smoke: bool, out: str, budget_s: float, start: float) -> int:
    """The driver: the header, every part within the budget, the summary; a stop signal ends it with the summary."""
    run: Dict[str, Any] = dict(environment=_environment(), smoke_cpu=smoke, out=out, budget_s=budget_s,
                               start=start, parts=[], running=None, pending=list(names), interrupted=None)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    with open(os.path.join(out, "gpu_check.log"), "w") as log:

        def emit(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
            log.write(text)
            log.flush()

        for line in run["environment"]:
            emit(line + "\n")
        code = 0
        try:
            _drive(names, run, emit, log)
        except _Interrupted as err:
            run.update(interrupted=str(err))
            code = 128 + err.signum
        done = [r["part"] for r in run["parts"]]
        run.update(running=None, pending=[n for n in names if n not in done])
        _write_summary(run)
        emit("\n" + "\n".join(_summary(run)) + "\n")
    if code:
        return code
    return 0 if all(r["verdict"] == "PASS" for r in run["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
