"""``lightning-ckpt plan``: the memory forecast for a card you do not have, from numbers or from the model."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Optional

from lightning_ckpt.core.policy import parse_policy_list
from lightning_ckpt.core.units import format_bytes, parse_size, unit_for
from lightning_ckpt.decide.anatomy import anatomy_text
from lightning_ckpt.forecast.cuda import SDPA_BACKENDS
from lightning_ckpt.forecast.load import load_init_args
from lightning_ckpt.forecast.numbers import (
    DEFAULT_POLICIES,
    KORTHIKANTI_TENSORS,
    ForecastInputs,
    LedgerForecast,
    attention_call,
    forecast_from_numbers,
)
from lightning_ckpt.forecast.precision import PRECISIONS
from lightning_ckpt.forecast.remedies import STRATEGIES, Job, Layout, cost_text, price, recommend, remedies
from lightning_ckpt.forecast.sdpa import describe_choices, resolve_gpu, saved_bytes, select_for_call
from lightning_ckpt.forecast.trace import DEVICES, forecast_model

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict the memory ledger from numbers or from the model itself",
                       description="Predict parameters, gradients, optimizer state and activations per policy, from "
                                   "numbers (--params ...) or by tracing the model on fake tensors (--model ...).")
    src = p.add_argument_group("source (one of)")
    src.add_argument("--params", type=float, default=None, help="number of parameters, e.g. 1.3e9")
    src.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                     help="a callable returning an nn.Module (a LightningModule class works), a Hugging Face config "
                          "(class, callable or instance), or a config.json path; built under fake tensors, nothing "
                          "is allocated. Demo factories: lightning_ckpt.demos.factories:benchmark_gpt, "
                          "lightning_ckpt.demos.factories:gpt2_config, lightning_ckpt.demos.factories:llama_7b_config")
    p.add_argument("--init-args", default=None, metavar="JSON", help="--model: keyword arguments as a JSON object")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="--model: LightningCLI-style YAML (model: {class_path, init_args} or model: {...}); its "
                        "class_path is the model when --model is not given")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--model: token-id range of the synthetic batch (default: read from the model); numbers: "
                        "count the logits and the loss after the blocks (default: the blocks alone)")
    p.add_argument("--param-dtype", default=None,
                   help="numbers: default bf16; --model: cast the floating parameters (default: as built)")
    p.add_argument("--grad-dtype", default=None, help="numbers only (default bf16)")
    p.add_argument("--optimizer", default=None,
                   help="numbers: adam (default), adamw, sgd, momentum, adafactor, lion; --model: adamw, adam, sgd, "
                        "momentum, adafactor (default: the module's configure_optimizers, else adamw)")
    p.add_argument("--moment-dtype", default=None, help="numbers only (default fp32)")
    p.add_argument("--master-dtype", default=None,
                   help="dtype of a master copy of the weights, or none (default); the optimizer steps it, so with "
                        "--model its moments are kept in this dtype too")
    p.add_argument("--layers", type=int, default=None, help="numbers only (default 24)")
    p.add_argument("--hidden", type=int, default=None, help="numbers only (default 2048)")
    p.add_argument("--heads", type=int, default=None, help="numbers only (default 16)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--act-dtype", default=None, help="numbers only (default bf16)")
    p.add_argument("--tensors-per-block", type=float, default=None,
                   help="numbers only: hidden-width tensors a block keeps for backward (default "
                        f"{KORTHIKANTI_TENSORS}, after Korthikanti et al. with a fused attention kernel; the "
                        "simplified textbook example uses 6)")
    p.add_argument("--attention", default=None, choices=["fused", "eager"], help="numbers only (default fused)")
    p.add_argument("--precision", default=None,
                   help=f"--model: a Lightning precision, one of {', '.join(PRECISIONS)} (default 32-true); the "
                        "forward runs under that precision's autocast (weight cache off as in Lightning's Trainer, "
                        "'+cache' on), or the parameters are cast")
    p.add_argument("--capacity", default=None, help="device capacity, e.g. 24GiB")
    p.add_argument("--device", default=None, choices=list(DEVICES),
                   help="--model: whose kernels' saved tensors to reproduce (dropout masks, attention backend, "
                        "autocast lists); default cuda when --capacity is given, else cpu")
    p.add_argument("--sdpa-backend", default=None, metavar="BACKEND",
                   help="--model --device cuda: scaled_dot_product_attention backend: auto (default: what PyTorch "
                        "would pick on --sm for the dtype, head size, mask and dropout), cudnn, flash, efficient or "
                        "math")
    gpu = p.add_argument_group("target GPU (the attention backend PyTorch picks depends on them)")
    gpu.add_argument("--sm", default=None, metavar="SM|GPU",
                     help="compute capability (9.0, sm_75) or GPU name (H100, A100, T4, 'RTX 4090'); default: this "
                          "machine's GPU, else H100")
    gpu.add_argument("--cudnn", default=None, metavar="VERSION",
                     help="the target's runtime cuDNN (9.15.1 or 91501, torch.backends.cudnn.version()); default: "
                          "the one this machine's torch loads")
    gpu.add_argument("--torch-version", default=None, metavar="X.Y",
                     help="the torch the target runs, whose selection rules apply (default: the installed one)")
    gpu.add_argument("--attn-dropout", type=float, default=None,
                     help="numbers with --sm: the attention dropout probability (default 0)")
    p.add_argument("--foreach", default=None, action=argparse.BooleanOptionalAction,
                   help="the optimizer's multi-tensor step, which holds one parameter-sized temporary (Adam's "
                        "sqrt of the second moment for every parameter at once) (--model default: torch's default "
                        "on --device, on for cuda; numbers default: off, as a fused step)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="numbers: none, all, every:N, group:K; --model: any policy (selective too)")
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes) instead of a table")
    ranks = p.add_argument_group("per GPU and remedies (numbers)")
    ranks.add_argument("--strategy", default=None, choices=[s for s in STRATEGIES if s != "single"],
                       help="how the job is laid out over --world-size GPUs: each GPU's parameters, gradients, "
                            "optimizer state, master copy, buffers in flight and what moves to the host")
    ranks.add_argument("--world-size", type=int, default=None,
                       help="GPUs the strategy spans (default 1 with --strategy); with --remedies, the GPUs the "
                            "sharding rows use (default: the fewest of 2, 4, 8 that fits)")
    ranks.add_argument("--remedies", action="store_true",
                       help="price every remedy side by side (checkpointing, accumulation, smaller optimizer states, "
                            "LoRA/QLoRA, sharding, offload, zeroing gradients before the forward) and recommend two")
    ranks.add_argument("--lora-rank", type=int, default=None, help="--remedies: the LoRA/QLoRA rows' rank (default 16)")
    ranks.add_argument("--trainable", type=float, default=None,
                       help="--remedies: the LoRA/QLoRA rows' trainable share, e.g. 0.01 (default: adapters of "
                            "--lora-rank on every block's four matrices)")


_NUMBERS_ONLY = ("grad_dtype", "moment_dtype", "layers", "hidden", "heads", "act_dtype", "tensors_per_block",
                 "attention")
_NUMBERS_DEFAULTS = dict(param_dtype="bf16", grad_dtype="bf16", optimizer="adam", moment_dtype="fp32",
                         master_dtype="none", layers=24, hidden=2048, heads=16, act_dtype="bf16", attention="fused")


def _capacity(value):
    if value is None:
        return None
    if value.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"--capacity={value!r} needs a unit, e.g. '24GiB' or '80GB'.")
    return parse_size(value, name="--capacity")


def run(args) -> int:
    if not [p for p in args.policies.split(",") if p.strip()]:
        raise ValueError(f"--policies={args.policies!r} names no policy; pass one or more, e.g. "
                         f"{','.join(DEFAULT_POLICIES)!r}.")
    if args.model is None and args.params is None and args.config is not None:
        args.model = load_init_args(None, args.config)[0]  # model.class_path, as profile --config reads it
    if (args.params is None) == (args.model is None):
        raise ValueError("pass exactly one of --params N (plan from numbers) or --model pkg.module:factory (trace "
                         "the model, or a --config whose model has a class_path); got "
                         f"--params={args.params!r} and --model={args.model!r}.")
    _check_ranks(args)
    if args.model is not None:
        return _run_plan_model(args)
    for name in ("init_args", "config", "precision", "device", "sdpa_backend"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} only applies with --model; drop it or pass --model.")
    targeted = any(getattr(args, n) is not None for n in ("sm", "cudnn", "torch_version"))
    if args.attn_dropout is not None and not targeted:
        raise ValueError(f"--attn-dropout={args.attn_dropout!r} only applies with --sm (the attention backend of the "
                         "target GPU); pass --sm or drop it.")
    for name, value in _NUMBERS_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tensors_per_block is None:
        args.tensors_per_block = KORTHIKANTI_TENSORS
    capacity = _capacity(args.capacity)
    inputs = ForecastInputs(
        params=args.params, param_dtype=args.param_dtype, grad_dtype=args.grad_dtype, optimizer=args.optimizer,
        moment_dtype=args.moment_dtype, master_dtype=args.master_dtype, layers=args.layers, hidden=args.hidden,
        micro_batch=args.micro_batch, seq_len=args.seq_len, act_dtype=args.act_dtype, heads=args.heads,
        tensors_per_block=args.tensors_per_block, attention=args.attention,
        capacity=capacity, foreach=bool(args.foreach),
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        attn_dropout=args.attn_dropout or 0.0, vocab=args.vocab_size,
    )
    attention = None
    if targeted and args.attention != "eager":
        # fused attention runs whatever PyTorch picks on the target: the math kernel saves the score matrix
        gpu = resolve_gpu(args.sm, args.cudnn, args.torch_version)
        call = attention_call(inputs)
        choice = select_for_call(call, gpu)
        inputs = replace(inputs, attention_backend=choice.backend)
        attention = dict(gpu=gpu.describe(), backend=choice.backend, source=str(choice.source),
                         saved_bytes_per_block=saved_bytes(choice.backend, call), assumptions=list(gpu.assumptions),
                         explanation=choice.explain())
    forecast = forecast_from_numbers(inputs)
    job = Job.from_numbers(inputs)
    if args.json:
        data = forecast.as_json()
        if attention is not None:
            data["attention"] = attention
        print(json.dumps({**data, **_rank_and_remedies_json(job, args)}, indent=2))
    else:
        print(_table(forecast))
        _print_rank_and_remedies(job, args, capacity)
        if attention is not None:
            print(f"attention on {attention['gpu']}: {attention['backend']} [{attention['source']}], saves "
                  f"{format_bytes(attention['saved_bytes_per_block'])} per block "
                  f"({'score matrix B·H·L·S included' if attention['backend'] == 'math' else 'no score matrix'})")
            print("  " + attention["explanation"].replace("\n", "\n  "))
            for note in attention["assumptions"]:
                print(f"  assumption: {note}")
    return 0


def _check_ranks(args) -> None:
    """--world-size/--strategy/--lora-rank/--trainable named and bounded before anything is computed."""
    if args.world_size is not None and (args.world_size < 1 or args.world_size > 65536):
        raise ValueError(f"--world-size={args.world_size!r} must be a number of GPUs from 1 to 65536.")
    if args.world_size is not None and args.strategy is None and not args.remedies:
        raise ValueError(f"--world-size={args.world_size!r} needs a layout: pass --strategy (e.g. fsdp, ddp) or "
                         "--remedies.")
    for name in ("lora_rank", "trainable"):
        if getattr(args, name) is not None and not args.remedies:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)!r} prices the LoRA rows of --remedies; "
                             "add --remedies or drop it.")
    if args.lora_rank is None:
        args.lora_rank = 16
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank={args.lora_rank!r} must be a positive integer, e.g. 16.")
    if args.trainable is not None and not 0 < args.trainable < 1:
        raise ValueError(f"--trainable={args.trainable!r} must be a share between 0 and 1, e.g. 0.01.")


def _per_rank(job: Job, args) -> Optional[dict]:
    """Each policy's row on one GPU under --strategy over --world-size GPUs (``None`` without --strategy)."""
    if args.strategy is None:
        return None
    n = args.world_size or 1
    return {p: price(job, Layout(p, policy=p, strategy=args.strategy, world_size=n)) for p in job.policies}


def _rank_and_remedies_json(job: Job, args) -> dict:
    """``per_rank`` (with --strategy) and ``remedies``, ``recommended``, ``recommended_any`` (with --remedies)."""
    data: dict = {}
    per_rank = _per_rank(job, args)
    if per_rank is not None:
        data["per_rank"] = {p: row.as_json() for p, row in per_rank.items()}
    if args.remedies:
        rows = remedies(job, args.lora_rank, args.trainable, args.world_size)
        keep, any_ = recommend(rows)
        data.update(remedies=[r.as_json() for r in rows], recommended=keep and keep.name,
                    recommended_any=any_ and any_.name)
    return data


def _print_rank_and_remedies(job: Job, args, capacity: Optional[int]) -> None:
    per_rank = _per_rank(job, args)
    if per_rank is not None:
        print(_rank_table(per_rank, args, capacity))
    if args.remedies:
        print(_remedies_table(remedies(job, args.lora_rank, args.trainable, args.world_size), capacity))


_LINES = ("parameters", "gradients", "optimizer state", "master copy", "in flight", "activations")


def _rank_table(rows: dict, args, capacity: Optional[int]) -> str:
    """Per GPU under the strategy: the state lines, then each policy's phases and verdict."""
    first = next(iter(rows.values()))
    unit, scale = unit_for(max([*first.lines.values(), *(r.peak for r in rows.values())]))
    out = [f"per GPU, {args.strategy} over {args.world_size or 1} GPU(s) ({unit}):"]
    out.append("  " + ", ".join(f"{name} {first.lines[name] / scale:.2f}" for name in _LINES[:5])
               + f"; on the host {first.lines['host'] / scale:.2f}; communicated per step "
               f"{format_bytes(first.cost['communicated_bytes'])}; host↔GPU per step "
               f"{format_bytes(first.cost['host_device_bytes'])}")
    for policy, row in rows.items():
        phases = "  ".join(f"{k} {v / scale:.2f}" for k, v in row.phases.items())
        verdict = "" if capacity is None else ("  fits" if row.fits else "  does not fit")
        out.append(f"  {policy:<12} activations {row.lines['activations'] / scale:.2f}  {phases}{verdict}")
    return "\n".join(out)


def _remedies_table(rows, capacity: Optional[int]) -> str:
    """Every remedy: its GPU's model state and activations, phase peaks, verdict, cost and what it changes."""
    unit, scale = unit_for(max(r.peak for r in rows))
    out = [f"remedies ({unit} on one GPU; cheapest first: more GPUs, host traffic, recompute, micro-batches):",
           f"{'remedy':<48}{'state':>7}{'acts':>7}{'fwd':>7}{'bwd':>7}{'opt':>7}  verdict"]
    for row in rows:
        state = sum(row.lines[k] for k in _LINES[:5])
        verdict = "?" if row.fits is None else ("fits" if row.fits else "does not fit")
        cells = "".join(f"{row.phases[k] / scale:>7.2f}" for k in ("forward", "backward", "optimizer"))
        out.append(f"{row.name:<48}{state / scale:>7.2f}{row.lines['activations'] / scale:>7.2f}{cells}  {verdict}")
        changes = "; ".join(row.changes) or "nothing in the training"
        out.append(f"{'':<4}cost: {cost_text(row)}; changes: {changes}")
        if row.how:
            out.append(f"{'':<4}how: {row.how}")
    keep, any_ = recommend(rows)
    if capacity is not None:
        out.append(f"try first (fits, training unchanged): {keep.name if keep else 'none of these rows'}")
        out.append(f"cheapest that fits at all: {any_.name if any_ else 'none of these rows'}")
    return "\n".join(out)


def _run_plan_model(args) -> int:
    given = [f"--{n.replace('_', '-')}" for n in _NUMBERS_ONLY if getattr(args, n) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} only apply when planning from numbers; with --model they are read "
                         "from the model itself (use --param-dtype to cast it). Drop them.")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(f"--vocab-size={args.vocab_size!r} must be a positive integer.")
    capacity = _capacity(args.capacity)
    device = args.device or ("cuda" if capacity is not None else "cpu")
    if args.sdpa_backend is not None and args.sdpa_backend not in SDPA_BACKENDS:  # before the model is built
        raise ValueError(f"--sdpa-backend={args.sdpa_backend!r} is not an SDPA backend; choose one of "
                         f"{list(SDPA_BACKENDS)} ('auto' picks the backend the target GPU would run for each call).")
    if args.sdpa_backend is not None and device != "cuda":
        raise ValueError(f"--sdpa-backend={args.sdpa_backend!r} only applies with --device cuda (the CPU runs its own "
                         "kernel); drop it or pass --device cuda.")
    for name in ("sm", "cudnn", "torch_version", "attn_dropout"):
        value = getattr(args, name)
        if value is not None and (device != "cuda" or name == "attn_dropout"):
            why = ("the model's own dropout is traced" if name == "attn_dropout" else
                   "the CPU runs its own kernels; pass --device cuda")
            raise ValueError(f"--{name.replace('_', '-')}={value!r} does not apply here ({why}); drop it.")
    gpu = resolve_gpu(args.sm, args.cudnn, args.torch_version) if device == "cuda" else None
    sdpa_log: list = []
    _, kwargs, _ = load_init_args(args.init_args, args.config)
    t0 = time.perf_counter()
    policies = parse_policy_list(args.policies)
    if (args.remedies or args.strategy) and "none" not in policies:
        policies = ["none", *policies]  # the job as it is: what every remedy is priced from
    forecast = forecast_model(args.model, kwargs, micro_batch=args.micro_batch, seq_len=args.seq_len,
                              policies=policies, param_dtype=args.param_dtype,
                              optimizer=args.optimizer, master_dtype=args.master_dtype, capacity=capacity,
                              vocab_size=args.vocab_size, precision=args.precision or "32-true", device=device,
                              sdpa_backend=args.sdpa_backend or "auto", foreach=args.foreach, gpu=gpu,
                              sdpa_log=sdpa_log)
    attention = _attention_summary(gpu, sdpa_log)
    job = Job.from_forecast(forecast) if args.remedies or args.strategy else None
    if args.json:
        data = forecast.as_json()
        if attention is not None:
            data["attention"] = attention
        print(json.dumps({**data, **(_rank_and_remedies_json(job, args) if job else {})}, indent=2))
        return 0
    print(f"model {forecast.model}: {_count(forecast.num_params)} parameters, {forecast.blocks} blocks of "
          f"{forecast.block_class}, "
          f"micro-batch {args.micro_batch} × {args.seq_len} tokens, precision {forecast.precision}, device "
          f"{forecast.device} ({_device_note(forecast)}); traced on fake tensors in "
          f"{time.perf_counter() - t0:.1f} s (nothing allocated)")
    print(_table(forecast))
    replays = {p: v for p, v in forecast.replay_interior.items() if v}
    if replays:
        print("largest replay transient (one region's interior while it is recomputed, included above): "
              + ", ".join(f"{p} {format_bytes(v)}" for p, v in replays.items()))
    first = next(iter(forecast.anatomy), None)
    if first is not None:  # the anatomy of the first policy's step (--json has every policy's)
        print(f"policy {first!r}, traced:")
        print(anatomy_text(forecast.anatomy[first]))
    if attention is not None:
        calls = ", ".join(attention["decisions"]) or "no scaled_dot_product_attention call traced"
        print(f"attention on {attention['gpu']}: {calls}")
        for note in attention["assumptions"]:
            print(f"  assumption: {note}")
    if job is not None:
        _print_rank_and_remedies(job, args, capacity)
    return 0


def _count(n: float) -> str:
    """A parameter count in the unit that fits: ``'1.30 B'``, ``'124.4 M'``, ``'52.2 K'``, ``'800'``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "B" else f"{n / scale:.1f} {unit}"
    return f"{int(n)}"


def _attention_summary(gpu, choices) -> Optional[dict]:
    """What the trace's attention calls ran on the target, with the deciding rule and the assumptions made."""
    if gpu is None:
        return None
    return dict(gpu=gpu.describe(), backends=sorted({c.backend for c in choices}),
                decisions=describe_choices(choices), assumptions=list(gpu.assumptions))


def _device_note(forecast) -> str:
    inputs = forecast.inputs
    foreach = inputs.get("foreach")
    step = "torch's default optimizer step" if foreach is None else f"foreach={foreach}"
    if forecast.device == "cpu":
        return f"CPU kernels' saved tensors, {step}"
    return f"CUDA kernels' saved tensors, attention backend {inputs.get('sdpa_backend')}, {step}"


def _table(forecast: LedgerForecast) -> str:
    """The ledger table; works for :class:`~lightning_ckpt.forecast.numbers.LedgerForecast` and
    :class:`~lightning_ckpt.forecast.trace.ModelForecast` alike. Each of its two tables prints in one unit, the one
    that fits its largest value (named in its header); sentences name each size in its own."""
    cap = forecast.capacity
    lines = forecast.lines() + [("model state", forecast.model_state)]
    unit, scale = unit_for(max(size for _, size in lines))
    rows = [f"{'line':<22}{unit:>10}{'% of capacity':>16}" if cap else f"{'line':<22}{unit:>10}"]
    for name, size in lines:
        rows.append(f"{name:<22}{size / scale:>10.2f}" + (f"{size / cap:>16.1%}" if cap else ""))
    rows.append(f"one hidden-width tensor: {format_bytes(forecast.hidden_tensor)}; boundaries with every block "
                f"checkpointed: {format_bytes(forecast.boundary_all)}; one block's interior: "
                f"{format_bytes(forecast.block_interior)}")
    copies = getattr(forecast, "autocast_copies", {})
    with_copies = any(copies.values())
    sizes = [*forecast.activations.values(), *(v for p in forecast.phase_peaks.values() for v in p.values())]
    unit, scale = unit_for(max([*sizes, *copies.values()], default=0))
    rows.append(f"{'policy':<14}{'activations':>12}" + (f"{'copies':>9}" if with_copies else "")
                + f"{'forward':>10}{'backward':>10}{'optimizer':>10}  verdict ({unit}; the highest phase decides)")
    for policy, act in forecast.activations.items():
        phases = forecast.phase_peaks[policy]
        top = forecast.peak_phase[policy]
        verdict = f"peak in {top}; capacity unknown (pass --capacity)"
        if cap:
            crossing = forecast.crosses[policy]
            verdict = (f"fits, {format_bytes(cap - forecast.peak[policy])} to spare at the {top} peak"
                       if crossing is None else
                       f"does not fit: the {crossing} line crosses {format_bytes(cap)} in the {top} phase")
        extra = f"{copies[policy] / scale:>9.2f}" if with_copies else ""
        cells = "".join(f"{phases[name] / scale:>10.2f}" for name in ("forward", "backward", "optimizer"))
        rows.append(f"{policy:<14}{act / scale:>12.2f}{extra}{cells}  {verdict}")
    return "\n".join(rows)


