"""Profile a LightningModule's training step per policy, micro-batch and sequence length; recommend one.

``lightning-ckpt profile pkg.module:Class`` (or :func:`profile`) follows the seed's "What to do on Monday
morning": a representative step (the module's own ``training_step`` and ``configure_optimizers``), warm-up
first, then several identical measured steps; one dimension varied at a time (micro-batch at a fixed length,
length at a fixed micro-batch), each under every policy, plus the gradient-accumulation baseline (micro-batch 1 ×
k steps, no checkpointing). The step runs in plain PyTorch, without a Trainer::

    optimizer.zero_grad(set_to_none=True)
    for each micro-batch:  loss = module.training_step(batch, 0); (loss / k).backward()
    optimizer.step()

Every configuration starts from the module's initial weights and a fresh optimizer (the state dict is reloaded
and ``configure_optimizers()`` called again), with the same seed, so configurations never contaminate each other.
An out-of-memory error (``torch.OutOfMemoryError`` or anything :func:`lightning_ckpt.oom.is_out_of_memory`
recognises) is a *result*: the configuration is reported with ``"oom": true`` and the run goes on.

**The batch hook.** The module provides ``example_batch(micro_batch: int, seq_len: int) -> batch``: a batch its
``training_step`` accepts, on the module's device, holding ``micro_batch`` sequences of ``seq_len`` tokens (the
demos' :class:`~lightning_ckpt.demos.GPTLightningModule` and :class:`~lightning_ckpt.demos.HFCausalLMModule` have
it). It must not move the global RNG (use a private ``torch.Generator``). Without the hook, pass a datamodule
(``datamodule=`` / ``--datamodule pkg.module:Class``, arguments from ``--datamodule-args`` JSON or the ``data:``
section of ``--config``): its own ``example_batch`` hook if it has one, else it is built with ``batch_size`` and
``seq_len`` (or ``seq_length``/``max_length``/``block_size``/``sequence_length``) set to the configuration,
``setup("fit")`` and the first batch of ``train_dataloader()`` is used.

**Injecting an out-of-memory configuration** (to test a report, or a pipeline around it): any module whose
``training_step`` (or ``example_batch``) raises ``torch.OutOfMemoryError`` for some sizes is reported that way,
e.g. ``if batch["input_ids"].numel() > limit: raise torch.OutOfMemoryError("CUDA out of memory (injected)")``.

**What is recorded** per configuration (medians over the measured steps; bytes as ``int``): ``activations`` (the
activation peak from :class:`~lightning_ckpt.meter.StepMeter`, default mode), ``peak_allocated`` and
``peak_reserved`` over the whole step, optimizer step included (CUDA only, else ``None``), ``model_state``
(parameters + gradients + optimizer state, from :func:`~lightning_ckpt.ledger.model_state_bytes`), ``peak`` (the
figure compared with the budget: ``peak_reserved`` on CUDA, ``model_state + activations`` elsewhere; ``peak_source``
says which), ``forward_s``, ``backward_s``, ``optimizer_s``, ``step_s``, ``tokens_per_step``, ``tokens_per_sec``,
``fits``, ``oom``, ``error``.

**Outputs** (under ``out``): ``profile.json``, ``profile.md``, ``profile.png`` (activation peak vs tokens per step,
and tokens/s vs tokens per step, per policy), ``tb/<configuration>/`` (one TensorBoard run per configuration,
scalars ``memory/activations_gib``, ``memory/peak_allocated_gib``, ``memory/peak_reserved_gib``,
``memory/model_state_gib``, ``throughput/tokens_per_sec``, ``time/step_s``, ``time/forward_s``,
``time/backward_s`` per measured step, and a text summary), and on the terminal a progress bar and a ``rich`` table.

**The recommendation** is the configuration with the highest tokens/s whose ``peak`` fits the budget (``budget``,
else ``capacity``, else the device's memory; on a CPU without either, every configuration that ran is eligible).
**The reading of the slopes** (:func:`read_slopes`), on the ``none`` policy (the first policy when ``none`` was not
profiled): the peak against tokens in the micro-batch sweep (barely changes → activations are not the problem;
grows → checkpointing is a credible target), and the log-log exponent of the activation peak against length in
the length sweep (≈1: linear; ≈2: grows with the square of length → attention is materialized).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_ckpt.report import loglog_slope
from lightning_ckpt.units import format_bytes

__all__ = [
    "DEFAULT_POLICIES",
    "PRECISIONS",
    "ProfileReport",
    "ProfileResult",
    "profile",
    "read_slopes",
    "recommend",
]

DEFAULT_POLICIES = ("none", "selective", "every:2", "all")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
_POLICY_NAMES = frozenset({"none", "all", "every", "first", "blocks", "group", "selective", "offload", "budget",
                           "modes"})
_SEQ_KWARGS = ("seq_len", "seq_length", "max_length", "block_size", "sequence_length")
_BATCH_KWARGS = ("batch_size", "micro_batch")
GiB, MiB = 1024**3, 1024**2


# ------------------------------------------------------------------------------------------------- results


@dataclass
class ProfileResult:
    """One configuration's measurements (see the module docstring); bytes are ``int``, ``None`` = not measured."""

    name: str
    policy: str
    micro_batch: int
    seq_len: int
    accumulate: int = 1
    sweep: str = ""
    tokens_per_step: int = 0
    oom: bool = False
    error: Optional[str] = None
    activations: Optional[int] = None
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    model_state: Optional[int] = None
    peak: Optional[int] = None
    peak_source: str = ""
    forward_s: Optional[float] = None
    backward_s: Optional[float] = None
    optimizer_s: Optional[float] = None
    step_s: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    fits: Optional[bool] = None
    loss: Optional[float] = None

    @property
    def ok(self) -> bool:
        return not self.oom and self.error is None


@dataclass
class ProfileReport:
    """Everything :func:`profile` measured and concluded; ``as_json()`` is what ``profile.json`` holds."""

    model: str
    device: str
    settings: Dict[str, Any]
    results: List[ProfileResult]
    recommendation: Optional[Dict[str, Any]]
    reading: Dict[str, Any]
    outputs: Dict[str, str] = field(default_factory=dict)

    def as_json(self) -> Dict[str, Any]:
        return {"version": 1, "model": self.model, "device": self.device, "settings": self.settings,
                "results": [asdict(r) for r in self.results], "recommendation": self.recommendation,
                "reading": self.reading, "outputs": self.outputs}

    def result(self, policy: str, micro_batch: int, seq_len: int, accumulate: int = 1) -> ProfileResult:
        for r in self.results:
            if (r.policy, r.micro_batch, r.seq_len, r.accumulate) == (policy, micro_batch, seq_len, accumulate):
                return r
        raise KeyError((policy, micro_batch, seq_len, accumulate))


# -------------------------------------------------------------------------------------------- conclusions


def recommend(results: Sequence[ProfileResult], budget: Optional[int]) -> Optional[Dict[str, Any]]:
    """The configuration with the highest tokens/s that ran and whose ``peak`` fits ``budget`` (``None``: any)."""
    eligible = [r for r in results if r.ok and r.tokens_per_sec is not None
                and (budget is None or (r.peak is not None and r.peak <= budget))]
    if not eligible:
        ran = [r for r in results if r.ok and r.peak is not None]
        smallest = min(ran, key=lambda r: r.peak) if ran else None
        text = "no configuration fits the budget"
        if budget is not None:
            text += f" of {format_bytes(budget)}"
        if smallest is not None:
            text += (f"; the smallest peak was {smallest.name} at {format_bytes(smallest.peak)} — shrink the model "
                     "state (precision, sharding, optimizer) or the micro-batch")
        return {"name": None, "text": text + "."}
    best = max(eligible, key=lambda r: (r.tokens_per_sec, -(r.peak or 0)))
    fits = (f"peak {format_bytes(best.peak)} ({best.peak_source}) within the budget of {format_bytes(budget)}"
            if budget is not None else "no budget given, so every configuration that ran was eligible")
    shape = f"micro-batch {best.micro_batch}" + (f" × {best.accumulate} accumulation steps" if best.accumulate > 1
                                                  else "")
    text = (f"{best.name}: policy {best.policy!r}, {shape}, sequence length {best.seq_len} — "
            f"{best.tokens_per_sec:,.0f} tokens/s, {fits}.")
    return {"name": best.name, "policy": best.policy, "micro_batch": best.micro_batch, "seq_len": best.seq_len,
            "accumulate": best.accumulate, "tokens_per_sec": best.tokens_per_sec, "peak": best.peak,
            "budget": budget, "text": text}


def read_slopes(results: Sequence[ProfileResult], micro_batch: int, seq_len: int,
                policy: Optional[str] = None) -> Dict[str, Any]:
    """The seed's reading of how memory responds to tokens and to length (pure; see the module docstring).

    Args:
        results: the profiled configurations.
        micro_batch: the micro-batch held fixed in the length sweep.
        seq_len: the length held fixed in the micro-batch sweep.
        policy: which policy to read (default ``none``, else the first one present).

    Returns:
        ``{"policy", "tokens": {...}, "length": {...}, "text": [...]}``; ``tokens.verdict`` is ``"flat"`` or
        ``"grows"``, ``length.verdict`` one of ``"flat"``, ``"linear"``, ``"superlinear"``, ``"quadratic"``
        (``None`` when a sweep has fewer than two points that ran).
    """
    policies = [r.policy for r in results]
    if policy is None:
        policy = "none" if "none" in policies else (policies[0] if policies else "none")
    rows = [r for r in results if r.policy == policy and r.accumulate == 1 and r.ok]
    out: Dict[str, Any] = {"policy": policy, "tokens": {"verdict": None}, "length": {"verdict": None}, "text": []}

    by_mb = sorted((r for r in rows if r.seq_len == seq_len and r.peak), key=lambda r: r.tokens_per_step)
    if len(by_mb) >= 2 and by_mb[-1].tokens_per_step > by_mb[0].tokens_per_step:
        lo, hi = by_mb[0], by_mb[-1]
        ratio = hi.tokens_per_step / lo.tokens_per_step
        growth = hi.peak / lo.peak - 1
        elasticity = loglog_slope([r.tokens_per_step for r in by_mb], [r.peak for r in by_mb])
        share = (hi.activations / hi.peak) if hi.activations is not None and hi.peak else None
        verdict = "flat" if elasticity is not None and elasticity < 0.1 else "grows"
        out["tokens"] = {"verdict": verdict, "token_ratio": ratio, "peak_growth": growth, "elasticity": elasticity,
                         "activation_share": share}
        share_txt = f"; activations are {share:.0%} of it at {hi.tokens_per_step} tokens" if share is not None else ""
        if verdict == "flat":
            out["text"].append(
                f"Peak barely changes with tokens (+{growth:.1%} for ×{ratio:g} tokens per step{share_txt}): "
                "activations are not the problem — the model state is; checkpointing will not rescue a run "
                "that does not fit (look at precision, sharding or the optimizer's state).")
        else:
            out["text"].append(
                f"Peak grows with tokens (+{growth:.1%} for ×{ratio:g} tokens per step{share_txt}): activations "
                "are a credible target for checkpointing.")

    by_len = sorted((r for r in rows if r.micro_batch == micro_batch and r.activations), key=lambda r: r.seq_len)
    if len(by_len) >= 2 and by_len[-1].seq_len > by_len[0].seq_len:
        k = loglog_slope([r.seq_len for r in by_len], [r.activations for r in by_len])
        lo, hi = by_len[0], by_len[-1]
        ratio = hi.seq_len / lo.seq_len
        growth = hi.activations / lo.activations
        if k is None or k < 0.5:
            verdict, text = "flat", "the activation peak barely changes with length"
        elif k < 1.15:
            verdict, text = "linear", ("the activation peak grows linearly with length: no attention matrix is "
                                       "materialized (a memory-efficient attention kernel is in use)")
        elif k < 1.5:
            verdict, text = "superlinear", ("the activation peak grows faster than length: part of it grows with the "
                                            "square of length — attention is probably materialized; profile the "
                                            "attention kernel before checkpointing")
        else:
            verdict, text = "quadratic", ("the activation peak grows with the square of length: attention is "
                                          "materialized — switch to a fused / memory-efficient attention kernel "
                                          "first")
        out["length"] = {"verdict": verdict, "exponent": k, "length_ratio": ratio, "activation_ratio": growth}
        out["text"].append(f"Length ×{ratio:g} → activation peak ×{growth:.2f} (log-log exponent {k:.2f}): {text}.")
    return out


# ---------------------------------------------------------------------------------------------- the batch


class _BatchSource:
    """``make(micro_batch, seq_len)``: the module's hook or a datamodule (see the module docstring)."""

    def __init__(self, module: nn.Module, datamodule: Any = None, datamodule_args: Optional[Dict[str, Any]] = None):
        self.module = module
        self.hook = getattr(module, "example_batch", None)
        self.datamodule = datamodule
        self.datamodule_args = dict(datamodule_args or {})
        if callable(self.hook):
            self.kind = "example_batch"
        elif datamodule is not None:
            self.kind = "datamodule"
            self._check_datamodule()
        else:
            raise ValueError(
                f"{type(module).__name__} has no example_batch(micro_batch, seq_len) hook and no datamodule was "
                "given; add the hook (see lightning_ckpt.profile) or pass --datamodule pkg.module:DataModule.")

    def _check_datamodule(self) -> None:
        dm = self.datamodule
        if callable(getattr(dm, "example_batch", None)):
            return
        if not inspect.isclass(dm):
            raise ValueError(f"--datamodule={dm!r} is an instance without an example_batch(micro_batch, seq_len) hook; "
                             "pass its class so it can be built per configuration, or add the hook.")
        params = inspect.signature(dm.__init__).parameters
        if not any(k in params for k in _BATCH_KWARGS) or not any(k in params for k in _SEQ_KWARGS):
            raise ValueError(f"--datamodule={dm.__qualname__!r} takes neither a batch size ({'/'.join(_BATCH_KWARGS)}) "
                             f"and a length ({'/'.join(_SEQ_KWARGS)}) nor has an example_batch hook, so it cannot make "
                             "a batch of a given shape; add the hook.")

    def make(self, micro_batch: int, seq_len: int, device: torch.device) -> Any:
        if self.kind == "example_batch":
            batch = self.hook(micro_batch, seq_len)
        else:
            dm = self.datamodule
            if callable(getattr(dm, "example_batch", None)):
                batch = dm.example_batch(micro_batch, seq_len)
            else:
                params = inspect.signature(dm.__init__).parameters
                kwargs = dict(self.datamodule_args)
                kwargs[next(k for k in _BATCH_KWARGS if k in params)] = micro_batch
                kwargs[next(k for k in _SEQ_KWARGS if k in params)] = seq_len
                try:
                    instance = dm(**kwargs)
                except TypeError as err:
                    raise ValueError(f"--datamodule={dm.__qualname__!r} rejected {kwargs!r}: {err}") from None
                instance.setup("fit")
                batch = next(iter(instance.train_dataloader()))
        from lightning.fabric.utilities.apply_func import move_data_to_device

        return move_data_to_device(batch, device)


# --------------------------------------------------------------------------------------------- validation


def _positive_ints(values: Union[str, Sequence[int]], arg: str) -> Tuple[int, ...]:
    if isinstance(values, str):
        parts = [v.strip() for v in values.split(",") if v.strip()]
        try:
            out = tuple(int(v) for v in parts)
        except ValueError:
            raise ValueError(f"{arg}={values!r} must be a comma-separated list of positive integers, e.g. '1,2,4'.") \
                from None
    else:
        out = tuple(values)
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(f"{arg}={values!r} must be a non-empty list of positive integers, e.g. '1,2,4'.")
    return tuple(dict.fromkeys(out))


def _size(value: Any, arg: str) -> Optional[int]:
    from lightning_ckpt.units import parse_size

    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9.]+\s*", value):
        raise ValueError(f"{arg}={value!r} needs a unit, e.g. '18GiB' or '512MiB'.")
    return parse_size(value, name=arg)


def _policies(values: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    from lightning_ckpt.policy import parse_policy

    items = [v.strip() for v in values.split(",")] if isinstance(values, str) else list(values)
    # a comma also separates the arguments of blocks:/selective: — re-join pieces that are not policies alone
    merged: List[str] = []
    for item in items:
        if not item:
            continue
        if merged and item.split(":", 1)[0].strip().lower() not in _POLICY_NAMES:
            merged[-1] += "," + item
        else:
            merged.append(item)
    if not merged:
        raise ValueError(f"--policies={values!r} is empty; pass e.g. 'none,selective,every:2,all'.")
    for p in merged:
        parsed = parse_policy(p)
        if parsed.name == "budget":
            raise ValueError(f"--policies: {p!r} needs measurements first; profile concrete policies "
                             "(none, selective, every:N, all, ...) and read the recommendation instead.")
    return tuple(dict.fromkeys(merged))


def _module_label(model: Any) -> str:
    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):
        return type(model).__qualname__
    return getattr(model, "__qualname__", repr(model))


def _seq_default(module: nn.Module) -> Optional[Tuple[int, ...]]:
    longest = getattr(module, "max_seq_len", None)
    if not isinstance(longest, int):
        hp = getattr(module, "hparams", {}) or {}
        longest = next((hp[k] for k in ("block_size", "n_positions", "max_seq_len", "seq_len") if k in hp), None)
    if not isinstance(longest, int) or longest < 2:
        return None
    return (longest // 2, longest)


# ------------------------------------------------------------------------------------------- the profiler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slug(policy: str, micro_batch: int, seq_len: int, accumulate: int) -> str:
    p = re.sub(r"[^A-Za-z0-9]+", "-", policy).strip("-")
    return f"{p}_mb{micro_batch}" + (f"x{accumulate}" if accumulate > 1 else "") + f"_seq{seq_len}"


def _configurations(policies, micro_batches, seq_lens, fixed_mb, fixed_seq, accumulate):
    configs: Dict[Tuple[str, int, int, int], str] = {}
    for policy in policies:
        for mb in micro_batches:
            configs.setdefault((policy, mb, fixed_seq, 1), "micro_batch")
        for s in seq_lens:
            key = (policy, fixed_mb, s, 1)
            if key in configs and configs[key] == "micro_batch":
                configs[key] = "both"
            configs.setdefault(key, "seq_len")
    if accumulate and accumulate > 1:
        configs.setdefault(("none", 1, fixed_seq, accumulate), "accumulation")
    return configs


def profile(
    model: Any,
    init_args: Union[str, Dict[str, Any], None] = None,
    *,
    config: Optional[str] = None,
    datamodule: Any = None,
    datamodule_args: Union[str, Dict[str, Any], None] = None,
    policies: Union[str, Sequence[str]] = DEFAULT_POLICIES,
    micro_batches: Union[str, Sequence[int]] = (1, 2),
    seq_lens: Union[str, Sequence[int], None] = None,
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    steps: int = 3,
    warmup: int = 1,
    accumulate: Optional[int] = None,
    budget: Union[str, int, None] = None,
    capacity: Union[str, int, None] = None,
    device: Union[str, torch.device, None] = None,
    precision: str = "32-true",
    out: Union[str, os.PathLike] = "profile_out",
    progress: bool = True,
    tensorboard: bool = True,
    plot: bool = True,
    seed: int = 0,
    console: Any = None,
) -> ProfileReport:
    """Profile ``model`` (see the module docstring) and write the outputs under ``out``.

    Args:
        model: a LightningModule (or any ``nn.Module`` with ``training_step``/a loss-returning forward and
            ``example_batch``) as an import path ``pkg.module:Class``, a class, or an instance.
        init_args: keyword arguments (dict or JSON text) for the class; merged over ``config``'s.
        config: a LightningCLI-style YAML (``model: {class_path, init_args}`` or ``model: {...}``, ``data: ...``).
        datamodule: import path, class or instance used when the module has no ``example_batch`` hook.
        datamodule_args: keyword arguments (dict or JSON) for the datamodule class; default ``config``'s ``data``.
        policies: policy strings (``"none,selective,every:2,all"``).
        micro_batches: the micro-batch sweep, at length ``seq_len``.
        seq_lens: the length sweep, at micro-batch ``micro_batch``; default half and all of the module's
            ``max_seq_len``.
        micro_batch: the micro-batch held fixed in the length sweep (default the smallest of ``micro_batches``).
        seq_len: the length held fixed in the micro-batch sweep (default the longest of ``seq_lens``).
        steps: measured steps per configuration (after ``warmup``).
        warmup: unmeasured steps first (lazy optimizer state, kernels, the meter's replay calibration).
        accumulate: k of the gradient-accumulation baseline (micro-batch 1 × k, policy ``none``); default the
            largest micro-batch; 0 or 1 skips it.
        budget: the memory the recommendation must fit (``"18GiB"``); default ``capacity``.
        capacity: the device's memory (default: read from the device; unknown on the CPU).
        device: ``"cuda"``, ``"cpu"``, ...; default CUDA when available.
        precision: one of :data:`PRECISIONS`.
        out: output directory (created; files in it are overwritten).
        progress, tensorboard, plot: switch those outputs off.
        seed: ``torch.manual_seed`` at the start of every configuration.
        console: a ``rich.console.Console`` for the progress bar (default: stderr).

    Returns:
        The :class:`ProfileReport` (also written to ``out/profile.json``). A module passed as an instance is moved
        to ``device`` and left with its initial weights and its own checkpointing plan (or none).

    Raises:
        ValueError: bad input (import path, arguments, sizes, missing batch hook), before anything is written.
    """
    from lightning_ckpt.trace import build_model, import_object, load_init_args

    # ---- validate everything before writing anything
    policies_t = _policies(policies)
    mbs = _positive_ints(micro_batches, "--micro-batches")
    budget_b = _size(budget, "--budget")
    capacity_b = _size(capacity, "--capacity")
    for name, value, low in (("--steps", steps, 1), ("--warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}.")
    if precision not in PRECISIONS:
        raise ValueError(f"--precision={precision!r} is not supported; choose one of {list(PRECISIONS)}.")
    try:
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                           else "cpu")
    except RuntimeError as err:
        raise ValueError(f"--device={device!r} is not a device ({err}).") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={device!r}: CUDA is not available here; use --device cpu.")

    class_path, kwargs, data_cfg = load_init_args(init_args, config)
    if model is None:
        if class_path is None:
            raise ValueError("no model: pass pkg.module:Class, or a --config whose model has a class_path.")
        model = class_path
    label = _module_label(model)
    if isinstance(model, nn.Module):
        module = model
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = build_model(model, kwargs, arg="model")
    if not callable(getattr(module, "training_step", None)):
        raise ValueError(f"{label!r} is a {type(module).__name__} without training_step; pass a LightningModule "
                         "(or a module with training_step(batch, batch_idx) returning the loss).")
    if isinstance(datamodule, str):
        datamodule = import_object(datamodule, arg="--datamodule")
    dm_args: Dict[str, Any] = {}
    if datamodule_args is not None:
        _, dm_args, _ = load_init_args(datamodule_args, None)
    elif data_cfg is not None:
        dm_args = dict(data_cfg.get("init_args", data_cfg) if "class_path" in data_cfg else data_cfg)
        if datamodule is None and "class_path" in data_cfg:
            datamodule = import_object(str(data_cfg["class_path"]), arg="--config data.class_path")
    source = _BatchSource(module, datamodule, dm_args)

    if seq_lens is None:
        lens = _seq_default(module)
        if lens is None:
            raise ValueError(f"--seq-lens is required: {type(module).__name__} has no max_seq_len to derive it from.")
    else:
        lens = _positive_ints(seq_lens, "--seq-lens")
    fixed_mb = micro_batch if micro_batch is not None else min(mbs)
    fixed_seq = seq_len if seq_len is not None else max(lens)
    _positive_ints([fixed_mb], "--micro-batch")
    _positive_ints([fixed_seq], "--seq-len")
    k = max(mbs) if accumulate is None else accumulate
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"--accumulate={accumulate!r} must be a non-negative integer.")
    configs = _configurations(policies_t, mbs, lens, fixed_mb, fixed_seq, k)

    from lightning_ckpt.meter import device_capacity
    from lightning_ckpt.wrap import apply_policy

    module.to(dev)
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    module.train()
    # every shape once, so that a bad length fails now (out-of-memory here is left for the run to report)
    from lightning_ckpt.oom import is_out_of_memory

    for mb_, s_ in {(mb_, s_) for (_, mb_, s_, _) in configs}:
        try:
            source.make(mb_, s_, dev)
        except (ValueError, TypeError) as err:
            raise ValueError(f"the batch hook failed for micro-batch {mb_}, length {s_}: {err}") from None
        except Exception as err:  # noqa: BLE001
            if not is_out_of_memory(err):
                raise ValueError(f"the batch hook failed for micro-batch {mb_}, length {s_}: {err!r}") from None
    from lightning_ckpt.wrap import get_plan

    prior = get_plan(module)
    prior_spec = prior.spec if prior is not None else None
    plan = apply_policy(module, "none")
    capacity_b = capacity_b if capacity_b is not None else device_capacity(dev)
    limit = budget_b if budget_b is not None else capacity_b

    outdir = os.fspath(out)
    os.makedirs(outdir, exist_ok=True)
    initial = {k_: v.detach().to("cpu", copy=True) for k_, v in module.state_dict().items()}
    settings = dict(policies=list(policies_t), micro_batches=list(mbs), seq_lens=list(lens), micro_batch=fixed_mb,
                    seq_len=fixed_seq, steps=steps, warmup=warmup, accumulate=k, budget=budget_b,
                    capacity=capacity_b, precision=precision, seed=seed, batch=source.kind,
                    init_args=kwargs, blocks=plan.num_blocks)

    results: List[ProfileResult] = []
    bar = _Progress(progress, console, total=len(configs) * (warmup + steps))
    try:
        # one untimed step of the smallest shape first, so that one-time costs (lazy kernel and thread-pool
        # initialisation) do not land in the first configuration's numbers
        _, mb0, s0, _ = min(configs, key=lambda c: c[1] * c[2] * c[3])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run_configuration(module, plan, source, initial, ProfileResult("warm-up", "none", mb0, s0), dev,
                               precision, 0, 1, seed, None, _Progress(False, None, 0))
        with bar:
            for (policy, mb_, s_, acc), sweep in configs.items():
                name = _slug(policy, mb_, s_, acc)
                bar.describe(name)
                result = ProfileResult(name=name, policy=policy, micro_batch=mb_, seq_len=s_, accumulate=acc,
                                       sweep=sweep)
                writer = _writer(outdir, name) if tensorboard else None
                try:
                    _run_configuration(module, plan, source, initial, result, dev, precision, warmup, steps, seed,
                                       writer, bar)
                finally:
                    if writer is not None:
                        writer.add_text("configuration", _summary_text(result))
                        writer.close()
                result.fits = None if limit is None or result.peak is None else result.peak <= limit
                if not result.ok:
                    result.fits = False
                results.append(result)
    finally:  # the module leaves as it came: its weights, and its own plan (or none)
        if prior_spec is not None:
            plan.retarget(prior_spec)
        else:
            plan.remove()
        module.load_state_dict(initial)

    rec = recommend(results, limit)
    reading = read_slopes(results, fixed_mb, fixed_seq)
    report = ProfileReport(model=label, device=str(dev), settings=settings, results=results, recommendation=rec,
                           reading=reading)
    report.outputs = {"json": os.path.join(outdir, "profile.json"), "markdown": os.path.join(outdir, "profile.md")}
    if plot:
        report.outputs["plot"] = _plot(report, os.path.join(outdir, "profile.png"))
    if tensorboard:
        report.outputs["tensorboard"] = os.path.join(outdir, "tb")
    with open(report.outputs["json"], "w", encoding="utf-8") as fh:
        json.dump(report.as_json(), fh, indent=2)
    with open(report.outputs["markdown"], "w", encoding="utf-8") as fh:
        fh.write(markdown(report))
    return report


def _run_configuration(module, plan, source, initial, result: ProfileResult, dev, precision, warmup, steps, seed,
                       writer, bar) -> None:
    from lightning_ckpt.ledger import model_state_bytes
    from lightning_ckpt.meter import StepMeter, count_tokens, cuda_peaks
    from lightning_ckpt.oom import is_out_of_memory
    from lightning_ckpt.trace import make_optimizers, step_loss

    module.load_state_dict(initial)
    module.zero_grad(set_to_none=True)
    plan.retarget(result.policy)
    torch.manual_seed(seed)
    meter = StepMeter(dev, model=module)
    opts: List[Any] = []
    batch = None
    rows: Dict[str, List[float]] = {k: [] for k in ("fwd", "bwd", "opt", "step", "act", "alloc", "res")}
    cuda = dev.type == "cuda"
    done = 0
    try:
        result.tokens_per_step = result.micro_batch * result.seq_len * result.accumulate  # until counted
        opts = make_optimizers(module, None)
        batch = source.make(result.micro_batch, result.seq_len, dev)
        tokens = count_tokens(batch)
        result.tokens_per_step = int(tokens) * result.accumulate
        for i in range(warmup + steps):
            fwd = bwd = 0.0
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            _sync(dev)
            t_step = time.perf_counter()
            meter.start_step()
            try:
                for _ in range(result.accumulate):
                    t0 = time.perf_counter()
                    with _autocast(dev, precision):
                        loss = step_loss(module, batch)
                    _sync(dev)
                    t1 = time.perf_counter()
                    (loss / result.accumulate).backward()
                    _sync(dev)
                    fwd += t1 - t0
                    bwd += time.perf_counter() - t1
                    last_loss = loss.detach()
                    del loss
                reading = meter.stop_step()
            except BaseException:
                meter.close()
                raise
            t_opt = time.perf_counter()
            for opt in opts:
                opt.step()
            _sync(dev)
            t_end = time.perf_counter()
            if i == warmup + steps - 1:
                state = model_state_bytes(module, opts, device=dev)
                result.model_state = state.params + state.grads + state.optimizer
                result.loss = float(last_loss)
            bar.advance()
            done += 1
            if i < warmup:
                continue
            rows["fwd"].append(fwd)
            rows["bwd"].append(bwd)
            rows["opt"].append(t_end - t_opt)
            rows["step"].append(t_end - t_step)
            if reading.activations is not None:
                rows["act"].append(reading.activations)
            if cuda:
                alloc, res = cuda_peaks(dev)  # reset at start_step: the peak of the whole step, optimizer included
                rows["alloc"].append(alloc)
                rows["res"].append(res)
            if writer is not None:
                j = i - warmup
                step_s = t_end - t_step
                writer.add_scalar("throughput/tokens_per_sec", result.tokens_per_step / step_s, j)
                writer.add_scalar("time/step_s", step_s, j)
                writer.add_scalar("time/forward_s", fwd, j)
                writer.add_scalar("time/backward_s", bwd, j)
                if reading.activations is not None:
                    writer.add_scalar("memory/activations_gib", reading.activations / GiB, j)
                if cuda:
                    writer.add_scalar("memory/peak_allocated_gib", rows["alloc"][-1] / GiB, j)
                    writer.add_scalar("memory/peak_reserved_gib", rows["res"][-1] / GiB, j)
        med = statistics.median
        result.forward_s, result.backward_s = med(rows["fwd"]), med(rows["bwd"])
        result.optimizer_s, result.step_s = med(rows["opt"]), med(rows["step"])
        result.tokens_per_sec = result.tokens_per_step / result.step_s if result.step_s else None
        result.activations = max(rows["act"]) if rows["act"] else None
        if cuda:
            result.peak_allocated, result.peak_reserved = max(rows["alloc"]), max(rows["res"])
            result.peak, result.peak_source = result.peak_reserved, "reserved"
        elif result.activations is not None and result.model_state is not None:
            result.peak, result.peak_source = result.model_state + result.activations, "model state + activations"
        if writer is not None and result.model_state is not None:
            writer.add_scalar("memory/model_state_gib", result.model_state / GiB, 0)
    except Exception as err:  # noqa: BLE001 - an OOM is a result; other errors are reported per configuration
        if is_out_of_memory(err):
            result.oom = True
            result.error = None
            result.peak_source = "out of memory"
        else:
            result.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(f"lightning_ckpt profile: configuration {result.name} failed: {result.error}",
                          RuntimeWarning, stacklevel=2)
        bar.advance(warmup + steps - done)
    finally:
        meter.close()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
        del opts, batch
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _autocast(dev: torch.device, precision: str):
    if precision == "bf16-mixed":
        return torch.autocast(dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _summary_text(r: ProfileResult) -> str:
    if r.oom:
        return f"{r.name}: out of memory"
    if r.error:
        return f"{r.name}: error {r.error}"
    return "  \n".join(f"{k}: {v}" for k, v in asdict(r).items())


def _writer(outdir: str, name: str):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(outdir, "tb", name))


class _Progress:
    """A ``rich`` progress bar over all steps of all configurations (a no-op when disabled)."""

    def __init__(self, enabled: bool, console: Any, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]profile[/bold] {task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=console or Console(stderr=True), transient=True)
            self.task = None

    def __enter__(self):
        if self.progress is not None:
            self.progress.__enter__()
            self.task = self.progress.add_task("", total=self.total)
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        if self.progress is not None and n > 0:
            self.progress.advance(self.task, n)


# -------------------------------------------------------------------------------------------------- output


def _fmt_bytes(n: Optional[int]) -> str:
    return "—" if n is None else f"{n / MiB:,.1f}"


def _fmt_s(s: Optional[float]) -> str:
    return "—" if s is None else f"{s * 1e3:,.1f}"


def _columns(report: ProfileReport) -> List[str]:
    cols = ["configuration", "policy", "micro-batch", "seq len", "tokens/step", "act. peak MiB"]
    if report.device.startswith("cuda"):
        cols += ["peak alloc MiB", "peak reserved MiB"]
    else:
        cols += ["est. peak MiB"]
    return cols + ["fwd ms", "bwd ms", "tokens/s", "fits", "status"]


def _row(r: ProfileResult, cuda: bool) -> List[str]:
    mb = f"{r.micro_batch}×{r.accumulate}" if r.accumulate > 1 else str(r.micro_batch)
    row = [r.name, r.policy, mb, str(r.seq_len), f"{r.tokens_per_step:,}", _fmt_bytes(r.activations)]
    row += [_fmt_bytes(r.peak_allocated), _fmt_bytes(r.peak_reserved)] if cuda else [_fmt_bytes(r.peak)]
    status = "OOM" if r.oom else ("error" if r.error else "ok")
    fits = "—" if r.fits is None else ("yes" if r.fits else "no")
    row += [_fmt_s(r.forward_s), _fmt_s(r.backward_s),
            "—" if r.tokens_per_sec is None else f"{r.tokens_per_sec:,.0f}", fits, status]
    return row


def table(report: ProfileReport):
    """The results as a ``rich.table.Table`` (the recommended row in bold)."""
    from rich.table import Table

    cuda = report.device.startswith("cuda")
    best = (report.recommendation or {}).get("name")
    t = Table(title=f"lightning-ckpt profile: {report.model} on {report.device}")
    for i, c in enumerate(_columns(report)):
        t.add_column(c, justify="left" if i < 2 else "right")
    for r in report.results:
        t.add_row(*_row(r, cuda), style="bold green" if r.name == best else ("red" if not r.ok else None))
    return t


def conclusions(report: ProfileReport) -> List[str]:
    """The recommendation and the reading of the slopes, one paragraph each."""
    lines = []
    if report.recommendation:
        lines.append("Recommendation: " + report.recommendation["text"])
    lines.extend(report.reading.get("text", []))
    ooms = [r.name for r in report.results if r.oom]
    if ooms:
        lines.append(f"Out of memory: {', '.join(ooms)}.")
    errors = [f"{r.name} ({r.error})" for r in report.results if r.error]
    if errors:
        lines.append(f"Failed: {', '.join(errors)}.")
    return lines


def markdown(report: ProfileReport) -> str:
    """``profile.md``: settings, the table, the recommendation and the reading."""
    cuda = report.device.startswith("cuda")
    s = report.settings
    budget = "none" if s["budget"] is None else format_bytes(s["budget"])
    capacity = "unknown" if s["capacity"] is None else format_bytes(s["capacity"])
    accumulation = (f"gradient-accumulation baseline micro-batch 1 × {s['accumulate']}" if s["accumulate"] > 1
                    else "no gradient-accumulation baseline")
    out = [f"# lightning-ckpt profile: `{report.model}`", "",
           f"Device `{report.device}`, precision `{s['precision']}`, {s['warmup']} warm-up + {s['steps']} measured "
           f"steps per configuration, budget {budget}, capacity {capacity}. Micro-batch sweep at length "
           f"{s['seq_len']}; length sweep at micro-batch {s['micro_batch']}; {accumulation}. Batches from "
           f"`{s['batch']}`.", ""]
    if not cuda:
        out += ["On the CPU there are no allocator counters: the estimated peak is model state + activation peak.", ""]
    cols = _columns(report)
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|")
    for r in report.results:
        out.append("| " + " | ".join(_row(r, cuda)) + " |")
    out.append("")
    out += [f"- {line}" for line in conclusions(report)]
    if report.outputs.get("plot"):
        out += ["", f"![profile]({os.path.basename(report.outputs['plot'])})"]
    return "\n".join(out) + "\n"


def _plot(report: ProfileReport, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in report.settings["policies"]:
        rows = sorted((r for r in report.results if r.policy == policy and r.accumulate == 1 and r.ok),
                      key=lambda r: r.tokens_per_step)
        if not rows:
            continue
        xs = [r.tokens_per_step for r in rows]
        line, = ax_mem.plot(xs, [(r.activations or 0) / MiB for r in rows], marker="o", label=policy)
        ax_tps.plot(xs, [r.tokens_per_sec or 0 for r in rows], marker="o", label=policy, color=line.get_color())
        ooms = [r for r in report.results if r.policy == policy and r.oom]
        for r in ooms:
            ax_mem.axvline(r.micro_batch * r.seq_len * r.accumulate, color=line.get_color(), ls=":", lw=1)
    for r in report.results:
        if r.accumulate > 1 and r.ok:
            ax_mem.scatter([r.tokens_per_step], [(r.activations or 0) / MiB], marker="s", color="black",
                           label=f"none, 1×{r.accumulate} accumulation", zorder=3)
            ax_tps.scatter([r.tokens_per_step], [r.tokens_per_sec or 0], marker="s", color="black",
                           label=f"none, 1×{r.accumulate} accumulation", zorder=3)
    ax_mem.set(xlabel="tokens per optimizer step", ylabel="activation peak (MiB)", title="activation peak")
    ax_tps.set(xlabel="tokens per optimizer step", ylabel="tokens / s", title="throughput")
    for ax in (ax_mem, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model} on {report.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
