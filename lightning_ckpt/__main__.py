"""``lightning-ckpt`` / ``python -m lightning_ckpt``: the command line.

Sub-commands:

- ``plan``: predict the training-memory ledger for a card you do not have, from numbers (``--params ...``) or
  from the model itself (``--model pkg.module:factory``, built under fake tensors; see :mod:`lightning_ckpt.trace`).
- ``profile``: measure a LightningModule's step per policy, micro-batch and length, and recommend a
  configuration (see :mod:`lightning_ckpt.profile`).

Bad input prints one line ``lightning-ckpt <command>: error: ...`` on stderr and exits with status 2, before
anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

__all__ = ["main"]


def _plan_parser(sub) -> None:
    from lightning_ckpt.planner import DEFAULT_POLICIES, KORTHIKANTI_TENSORS

    p = sub.add_parser("plan", help="predict the memory ledger from numbers or from the model itself",
                       description="Predict parameters, gradients, optimizer state and activations per policy, from "
                                   "numbers (--params ...) or by tracing the model on fake tensors (--model ...).")
    src = p.add_argument_group("source (one of)")
    src.add_argument("--params", type=float, default=None, help="number of parameters, e.g. 1.3e9")
    src.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                     help="a callable returning an nn.Module (a LightningModule class works), a Hugging Face config "
                          "(class, callable or instance), or a config.json path; built under fake tensors, nothing "
                          "is allocated. Demo factories: lightning_ckpt.trace:benchmark_gpt, "
                          "lightning_ckpt.trace:gpt2_config, lightning_ckpt.trace:llama_7b_config")
    p.add_argument("--init-args", default=None, metavar="JSON", help="--model: keyword arguments as a JSON object")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="--model: LightningCLI-style YAML (model: {class_path, init_args} or model: {...})")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--model: token-id range of the synthetic batch (default: read from the model)")
    p.add_argument("--param-dtype", default=None,
                   help="numbers: default bf16; --model: cast the floating parameters (default: as built)")
    p.add_argument("--grad-dtype", default=None, help="numbers only (default bf16)")
    p.add_argument("--optimizer", default=None,
                   help="numbers: adam (default), adamw, sgd, momentum, adafactor, lion; --model: adamw, adam, sgd, "
                        "momentum, adafactor (default: the module's configure_optimizers, else adamw)")
    p.add_argument("--moment-dtype", default=None, help="numbers only (default fp32)")
    p.add_argument("--master-dtype", default=None,
                   help="dtype of a master copy of the weights, or none (default); with --model it is added to "
                        "what the optimizer itself holds")
    p.add_argument("--layers", type=int, default=None, help="numbers only (default 24)")
    p.add_argument("--hidden", type=int, default=None, help="numbers only (default 2048)")
    p.add_argument("--heads", type=int, default=None, help="numbers only (default 16)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--act-dtype", default=None, help="numbers only (default bf16)")
    p.add_argument("--tensors-per-block", type=float, default=None,
                   help="numbers only: hidden-width tensors a block keeps for backward (default "
                        f"{KORTHIKANTI_TENSORS}, after Korthikanti et al. with a fused attention kernel; the seed's "
                        "simplified example uses 6)")
    p.add_argument("--attention", default=None, choices=["fused", "eager"], help="numbers only (default fused)")
    p.add_argument("--capacity", default=None, help="device capacity, e.g. 24GiB")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="numbers: none, all, every:N, group:K; --model: any policy (selective too)")
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes) instead of a table")


_NUMBERS_ONLY = ("grad_dtype", "moment_dtype", "layers", "hidden", "heads", "act_dtype", "tensors_per_block",
                 "attention")
_NUMBERS_DEFAULTS = dict(param_dtype="bf16", grad_dtype="bf16", optimizer="adam", moment_dtype="fp32",
                         master_dtype="none", layers=24, hidden=2048, heads=16, act_dtype="bf16", attention="fused")


def _capacity(value):
    from lightning_ckpt.units import parse_size

    if value is None:
        return None
    if value.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"--capacity={value!r} needs a unit, e.g. '24GiB' or '80GB'.")
    return parse_size(value, name="--capacity")


def _run_plan(args) -> int:
    from lightning_ckpt.planner import KORTHIKANTI_TENSORS, LedgerInputs, plan_from_numbers

    if (args.params is None) == (args.model is None):
        raise ValueError("pass exactly one of --params N (plan from numbers) or --model pkg.module:factory (trace "
                         f"the model); got --params={args.params!r} and --model={args.model!r}.")
    if args.model is not None:
        return _run_plan_model(args)
    for name in ("init_args", "config", "vocab_size"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} only applies with --model; drop it or pass --model.")
    for name, value in _NUMBERS_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tensors_per_block is None:
        args.tensors_per_block = KORTHIKANTI_TENSORS
    capacity = _capacity(args.capacity)
    inputs = LedgerInputs(
        params=args.params, param_dtype=args.param_dtype, grad_dtype=args.grad_dtype, optimizer=args.optimizer,
        moment_dtype=args.moment_dtype, master_dtype=args.master_dtype, layers=args.layers, hidden=args.hidden,
        micro_batch=args.micro_batch, seq_len=args.seq_len, act_dtype=args.act_dtype, heads=args.heads,
        tensors_per_block=args.tensors_per_block, attention=args.attention,
        capacity=capacity,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
    )
    plan = plan_from_numbers(inputs)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
    else:
        print(_plan_table(plan))
    return 0


def _run_plan_model(args) -> int:
    import time

    from lightning_ckpt.profile import _policies
    from lightning_ckpt.trace import load_init_args, plan_model

    given = [f"--{n.replace('_', '-')}" for n in _NUMBERS_ONLY if getattr(args, n) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} only apply when planning from numbers; with --model they are read "
                         "from the model itself (use --param-dtype to cast it). Drop them.")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(f"--vocab-size={args.vocab_size!r} must be a positive integer.")
    capacity = _capacity(args.capacity)
    _, kwargs, _ = load_init_args(args.init_args, args.config)
    t0 = time.perf_counter()
    plan = plan_model(args.model, kwargs, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      policies=_policies(args.policies), param_dtype=args.param_dtype, optimizer=args.optimizer,
                      master_dtype=args.master_dtype, capacity=capacity, vocab_size=args.vocab_size)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
        return 0
    from lightning_ckpt.units import format_bytes

    print(f"model {plan.model}: {plan.num_params / 1e9:.3f} B parameters, {plan.blocks} blocks of {plan.block_class}, "
          f"micro-batch {args.micro_batch} × {args.seq_len} tokens; traced on fake tensors in "
          f"{time.perf_counter() - t0:.1f} s (nothing allocated)")
    print(_plan_table(plan))
    replays = {p: v for p, v in plan.replay_interior.items() if v}
    if replays:
        print("largest replay transient (one region's interior while it is recomputed, included above): "
              + ", ".join(f"{p} {format_bytes(v)}" for p, v in replays.items()))
    return 0


def _plan_table(plan) -> str:
    """The ledger table; works for :class:`~lightning_ckpt.planner.LedgerPlan` and
    :class:`~lightning_ckpt.trace.ModelPlan` alike."""
    from lightning_ckpt.units import GiB, MiB

    cap = plan.capacity
    rows = [f"{'line':<22}{'GiB':>10}{'% of capacity':>16}" if cap else f"{'line':<22}{'GiB':>10}"]
    for name, size in plan.lines() + [("model state", plan.model_state)]:
        rows.append(f"{name:<22}{size / GiB:>10.2f}" + (f"{size / cap:>16.1%}" if cap else ""))
    rows.append(f"one hidden-width tensor: {plan.hidden_tensor / MiB:.0f} MiB; boundaries with every block "
                f"checkpointed: {plan.boundary_all / MiB:.0f} MiB; one block's interior: "
                f"{plan.block_interior / MiB:.0f} MiB")
    rows.append(f"{'policy':<14}{'activations GiB':>17}{'peak GiB':>10}  verdict")
    for policy, act in plan.activations.items():
        verdict = "capacity unknown (pass --capacity)"
        if cap:
            crossing = plan.crosses[policy]
            verdict = (f"fits, {(cap - plan.peak[policy]) / GiB:.2f} GiB to spare" if crossing is None
                       else f"does not fit: the {crossing} line crosses {cap / GiB:.0f} GiB")
        rows.append(f"{policy:<14}{act / GiB:>17.2f}{plan.peak[policy] / GiB:>10.2f}  {verdict}")
    return "\n".join(rows)


def _profile_parser(sub) -> None:
    from lightning_ckpt.profile import DEFAULT_POLICIES as PROFILE_POLICIES
    from lightning_ckpt.profile import PRECISIONS

    p = sub.add_parser(
        "profile", help="measure a LightningModule's step per policy, micro-batch and length",
        description="Warm up, then measure identical training steps per policy, micro-batch (at a fixed length) and "
                    "length (at a fixed micro-batch), plus the gradient-accumulation baseline; print a table, write "
                    "profile.json, profile.md, profile.png and one TensorBoard run per configuration, and recommend "
                    "the fastest configuration that fits --budget. The module needs an example_batch(micro_batch, "
                    "seq_len) hook, or pass --datamodule.")
    p.add_argument("model", nargs="?", default=None, metavar="PKG.MODULE:CLASS",
                   help="the LightningModule (optional when --config names model.class_path)")
    p.add_argument("--init-args", default=None, metavar="JSON", help="keyword arguments as a JSON object")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="LightningCLI-style YAML: model: {class_path, init_args} or model: {...}; data: {...}")
    p.add_argument("--datamodule", default=None, metavar="PKG.MODULE:CLASS",
                   help="makes batches when the module has no example_batch hook (built with batch_size and seq_len)")
    p.add_argument("--datamodule-args", default=None, metavar="JSON")
    p.add_argument("--policies", default=",".join(PROFILE_POLICIES))
    p.add_argument("--micro-batches", default="1,2", help="micro-batch sweep at --seq-len (default 1,2)")
    p.add_argument("--seq-lens", default=None,
                   help="length sweep at --micro-batch (default: half and all of the module's max_seq_len)")
    p.add_argument("--micro-batch", type=int, default=None, help="fixed micro-batch (default: smallest swept)")
    p.add_argument("--seq-len", type=int, default=None, help="fixed length (default: longest swept)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per configuration (default 1)")
    p.add_argument("--accumulate", type=int, default=None,
                   help="k of the accumulation baseline, micro-batch 1 x k (default: largest micro-batch; 0 skips)")
    p.add_argument("--budget", default=None, help="memory the recommendation must fit, e.g. 18GiB (default: capacity)")
    p.add_argument("--capacity", default=None, help="device memory, e.g. 24GiB (default: read from the device)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--precision", default="32-true", choices=list(PRECISIONS))
    p.add_argument("--out", default="profile_out", help="output directory (default profile_out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard runs")
    p.add_argument("--no-plot", action="store_true", help="no profile.png")


def _run_profile(args) -> int:
    from rich.console import Console

    from lightning_ckpt.profile import conclusions, profile, table

    report = profile(
        args.model, args.init_args, config=args.config, datamodule=args.datamodule,
        datamodule_args=args.datamodule_args, policies=args.policies, micro_batches=args.micro_batches,
        seq_lens=args.seq_lens, micro_batch=args.micro_batch, seq_len=args.seq_len, steps=args.steps,
        warmup=args.warmup, accumulate=args.accumulate, budget=args.budget, capacity=args.capacity,
        device=args.device, precision=args.precision, out=args.out, progress=not args.no_progress,
        tensorboard=not args.no_tensorboard, plot=not args.no_plot, seed=args.seed,
    )
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table(report))
    for line in conclusions(report):
        console.print(line, highlight=False, soft_wrap=True)
    console.print("wrote " + ", ".join(report.outputs.values()), highlight=False, soft_wrap=True)
    return 1 if report.results and all(r.error for r in report.results) else 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``lightning-ckpt <command>: error: ...``) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="lightning-ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    _profile_parser(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        return {"plan": _run_plan, "profile": _run_profile}[args.command](args)
    except (ValueError, TypeError) as err:
        print(f"lightning-ckpt {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
