"""``lightning-ckpt profile``: measure a LightningModule's step per policy, micro-batch and length."""

from __future__ import annotations

from lightning_ckpt.forecast.profile import DEFAULT_POLICIES, PRECISIONS, conclusions, profile, table

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
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
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--micro-batches", default="1,2", help="micro-batch sweep at --seq-len (default 1,2)")
    p.add_argument("--seq-lens", default=None,
                   help="length sweep at --micro-batch (default: half and all of the module's max_seq_len)")
    p.add_argument("--micro-batch", type=int, default=None, help="fixed micro-batch (default: smallest swept)")
    p.add_argument("--seq-len", type=int, default=None, help="fixed length (default: longest swept)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration (default 3)")
    p.add_argument("--warmup", type=int, default=2,
                   help="warm-up steps per configuration (default 2: the first creates the optimizer state, the second "
                        "is the steady state's exact reference step)")
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


def run(args) -> int:
    from rich.console import Console

    from lightning_ckpt.decide.anatomy import anatomy_text

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
    named = next((r for r in report.results if r.anatomy), None)
    if named is not None:  # what one configuration's peak held, named (every configuration's is in the JSON)
        console.print(f"{named.name}:", highlight=False)
        console.print(anatomy_text(named.anatomy), highlight=False, soft_wrap=True)
    console.print("wrote " + ", ".join(report.outputs.values()), highlight=False, soft_wrap=True)
    return 1 if report.results and all(r.error for r in report.results) else 0


