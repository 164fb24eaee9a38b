"""Run the profile: build the module, make batches, step every configuration, write the outputs.

See :mod:`lightning_ckpt.forecast.profile` for what is measured and written.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import re
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ckpt.core.policy import parse_policy_list
from lightning_ckpt.core.units import GiB, parse_size
from lightning_ckpt.core.wrap import apply_policy, get_plan
from lightning_ckpt.decide.anatomy import model_anatomy
from lightning_ckpt.decide.diagnosis import is_out_of_memory
from lightning_ckpt.forecast.load import (
    build_model,
    import_object,
    load_init_args,
    make_optimizers,
    step_loss,
)
from lightning_ckpt.forecast.precision import PRECISIONS, parse_precision
from lightning_ckpt.forecast.profile.analysis import ProfileReport, ProfileResult, read_slopes, recommend
from lightning_ckpt.forecast.profile.output import Progress, markdown, save_plot, summary_text, tensorboard_writer
from lightning_ckpt.measure.ledger import model_state_bytes, state_tensors
from lightning_ckpt.measure.meter import StepMeter, device_capacity
from lightning_ckpt.measure.tokens import count_tokens

__all__ = ["DEFAULT_POLICIES", "PRECISIONS", "profile"]

DEFAULT_POLICIES = ("none", "selective", "every:2", "all")
_SEQ_KWARGS = ("seq_len", "seq_length", "max_length", "block_size", "sequence_length")
_BATCH_KWARGS = ("batch_size", "micro_batch")


# ---------------------------------------------------------------------------------------------- the batch


class _BatchSource:
    """``make(micro_batch, seq_len)``: the module's hook or a datamodule."""

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
                "given; add the hook (see lightning_ckpt.forecast.profile) or pass --datamodule pkg.module:DataModule.")

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
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


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
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9.]+\s*", value):
        raise ValueError(f"{arg}={value!r} needs a unit, e.g. '18GiB' or '512MiB'.")
    return parse_size(value, name=arg)


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
    warmup: int = 2,
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
    """Profile ``model`` (see :mod:`lightning_ckpt.forecast.profile`) and write the outputs under ``out``.

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
        warmup: unmeasured steps first: the first creates the optimizer state, the second is the exact reference
            step of the steady state (phase peaks, the meter's replay calibration); with fewer, a timed step is
            the (slower) reference step.
        accumulate: k of the gradient-accumulation baseline (micro-batch 1 × k, policy ``none``); default the
            largest micro-batch; 0 or 1 skips it.
        budget: the memory the recommendation must fit (``"18GiB"``); default ``capacity``.
        capacity: the device's memory (default: read from the device; unknown on the CPU).
        device: ``"cuda"``, ``"cpu"``, ...; default CUDA when available.
        precision: a Lightning precision name (:data:`lightning_ckpt.forecast.precision.PRECISIONS`).
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
    # ---- validate everything before writing anything
    policies_t = parse_policy_list(policies)
    mbs = _positive_ints(micro_batches, "--micro-batches")
    budget_b = _size(budget, "--budget")
    capacity_b = _size(capacity, "--capacity")
    for name, value, low in (("--steps", steps, 1), ("--warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}.")
    mode = parse_precision(precision)
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

    module.to(dev)
    if mode.param_dtype is not None:
        module.to(mode.param_dtype)
    module.train()
    # every shape once, so that a bad length fails now (out-of-memory here is left for the run to report)
    for mb_, s_ in {(mb_, s_) for (_, mb_, s_, _) in configs}:
        try:
            source.make(mb_, s_, dev)
        except (ValueError, TypeError) as err:
            raise ValueError(f"the batch hook failed for micro-batch {mb_}, length {s_}: {err}") from None
        except Exception as err:  # noqa: BLE001
            if not is_out_of_memory(err):
                raise ValueError(f"the batch hook failed for micro-batch {mb_}, length {s_}: {err!r}") from None
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
    bar = Progress(progress, console, total=len(configs) * (warmup + steps))
    try:
        # one untimed step of the smallest shape first, so that one-time costs (lazy kernel and thread-pool
        # initialisation) do not land in the first configuration's numbers
        _, mb0, s0, _ = min(configs, key=lambda c: c[1] * c[2] * c[3])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run_configuration(module, plan, source, initial, ProfileResult("warm-up", "none", mb0, s0), dev,
                               precision, 0, 1, seed, None, Progress(False, None, 0))
        with bar:
            for (policy, mb_, s_, acc), sweep in configs.items():
                name = _slug(policy, mb_, s_, acc)
                bar.describe(name)
                result = ProfileResult(name=name, policy=policy, micro_batch=mb_, seq_len=s_, accumulate=acc,
                                       sweep=sweep)
                writer = tensorboard_writer(outdir, name) if tensorboard else None
                try:
                    _run_configuration(module, plan, source, initial, result, dev, precision, warmup, steps, seed,
                                       writer, bar)
                finally:
                    if writer is not None:
                        writer.add_text("configuration", summary_text(result))
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
        report.outputs["plot"] = save_plot(report, os.path.join(outdir, "profile.png"))
    if tensorboard:
        report.outputs["tensorboard"] = os.path.join(outdir, "tb")
    with open(report.outputs["json"], "w", encoding="utf-8") as fh:
        json.dump(report.as_json(), fh, indent=2)
    with open(report.outputs["markdown"], "w", encoding="utf-8") as fh:
        fh.write(markdown(report))
    return report


def _tensors_of(batch: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]


def _run_configuration(module, plan, source, initial, result: ProfileResult, dev, precision, warmup, steps, seed,
                       writer, bar) -> None:
    module.load_state_dict(initial)
    module.zero_grad(set_to_none=True)
    plan.retarget(result.policy)
    torch.manual_seed(seed)
    meter = StepMeter(dev, model=module)
    opts: List[Any] = []
    batch = None
    rows: Dict[str, List[float]] = {k: [] for k in ("fwd", "bwd", "opt", "step", "act", "copies", "alloc", "res")}
    cuda = dev.type == "cuda"
    phases: Dict[str, int] = {}
    done = 0
    try:
        result.tokens_per_step = result.micro_batch * result.seq_len * result.accumulate  # until counted
        opts = make_optimizers(module, None)
        batch = source.make(result.micro_batch, result.seq_len, dev)
        tokens = count_tokens(batch)
        if tokens is not None:  # a batch without token ids (images) keeps micro-batch × length
            result.tokens_per_step = int(tokens) * result.accumulate
        for i in range(warmup + steps):
            fwd = bwd = 0.0
            _sync(dev)
            t_step = time.perf_counter()
            # the first step creates the optimizer state: the steady state's exact reference is the next one
            steady = all(bool(opt.state) for opt in opts)
            meter.start_step(key=(result.name, steady), state=state_tensors(module, opts), batch=_tensors_of(batch),
                             attribute=plan.names)
            try:
                for k in range(result.accumulate):  # Lightning's order: forward, zero_grad, backward
                    meter.phase("forward")
                    t0 = time.perf_counter()
                    with parse_precision(precision).forward_context(dev.type):
                        loss = step_loss(module, batch)
                    _sync(dev)
                    t1 = time.perf_counter()
                    if k == 0:
                        for opt in opts:
                            opt.zero_grad(set_to_none=True)
                    meter.phase("backward")
                    (loss / result.accumulate).backward()
                    _sync(dev)
                    fwd += t1 - t0
                    bwd += time.perf_counter() - t1
                    last_loss = loss.detach()
                    del loss
                meter.phase("optimizer")
                t_opt = time.perf_counter()
                for opt in opts:
                    opt.step()
                _sync(dev)
                reading = meter.stop_step()
            except BaseException:
                meter.close()
                raise
            t_end = time.perf_counter()
            if i == warmup + steps - 1:
                state = model_state_bytes(module, opts, device=dev)
                result.model_state = state.params + state.grads + state.optimizer
                result.loss = float(last_loss)
            bar.advance()
            done += 1
            if reading.attribution:  # an exact reference step (a warm-up one): what its peaks held, the last kept
                result.anatomy = model_anatomy(reading.attribution, module, result.micro_batch, result.seq_len,
                                               plan.names, plan.modes, parse_precision(precision).autocast_dtype)
            if i < warmup:
                continue
            rows["fwd"].append(fwd)
            rows["bwd"].append(bwd)
            rows["opt"].append(t_end - t_opt)
            rows["step"].append(t_end - t_step)
            if reading.activations is not None:
                rows["act"].append(reading.activations)
                rows["copies"].append(reading.autocast_copies or 0)
            for name, v in (reading.phase_peaks or {}).items():
                phases[name] = max(phases.get(name, 0), v)
            if cuda:
                alloc, res = reading.peak_allocated, reading.peak_reserved  # the highest phase: the whole step
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
        result.autocast_copies = max(rows["copies"]) if rows["copies"] else None
        result.phase_peaks = phases or None
        if cuda:
            result.peak_allocated, result.peak_reserved = max(rows["alloc"]), max(rows["res"])
            result.peak, result.peak_source = result.peak_reserved, "reserved"
        elif phases:
            result.peak, result.peak_source = max(phases.values()), "highest phase peak (live-tensor count)"
        elif result.activations is not None and result.model_state is not None:
            result.peak = result.model_state + result.activations + (result.autocast_copies or 0)
            result.peak_source = "model state + activations + autocast copies"
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
