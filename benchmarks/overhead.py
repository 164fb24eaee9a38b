"""Step-time overhead of the callback's per-step measurement (and decisions), on one model and batch.

Run from the repository root::

    python benchmarks/overhead.py                  # demo GPT 12x512, seq 512, micro-batch 4, CPU
    python benchmarks/overhead.py --case auto      # B also runs the auto-toggle's decision every step
    python benchmarks/overhead.py --case ddp       # 2 processes (DDP, gloo): B reduces across ranks every step
    python benchmarks/overhead.py --quick          # tiny GPT, a few rounds (< 1 min): shows the format only
    python benchmarks/overhead.py --accelerator gpu   # the same on a CUDA device (target <= 1.01x)
    python benchmarks/overhead.py --host           # host time per measured step, 12-block GPT (target <= 5 ms)
    python benchmarks/overhead.py --host --model gpt2   # the same, Hugging Face GPT-2 of 2 blocks (target <= 3 ms)
    python benchmarks/overhead.py --host --log-every 50 # Lightning's default interval (target <= 1.02x)

**Host time** (``--host``): the model keeps its structure — its blocks, modules, parameter tensors and the ops of a
step — while its arithmetic shrinks to nothing (width and vocabulary 64, one head, micro-batch 1, 8 tokens, one
thread). The plugin's work per step (saved-tensor hooks, replay lookups, the ledger, the figures written to the
loggers) depends on that structure, not on the tensors' sizes, so what B adds to a step here is the host time it
adds to the full-size step, measured above the noise that a one-second CPU step would bury it in. On a GPU, where
the host enqueues kernels for a device that takes tens of milliseconds a step, that host time is what a measured
step can cost.

**Logging interval** (``--log-every N``, default 1): the Trainer's ``log_every_n_steps``. Each letter of the
schedule is then a block of N steps, and in a B block exactly one step (Lightning's logging step) is measured, the
others run the plugin's quiet path; the ratio is that of whole blocks, what a run at that interval pays.

Cases: ``single`` (one process, fixed policy), ``auto`` (B with ``auto_threshold`` — never crossed, so the plan
stays put — deciding on every step; A decides never), ``ddp`` (``ddp_spawn`` on 2 CPU processes with gloo; every B
step reduces its figures across the ranks with one collective and one host sync; times from rank 0).

What is compared (the baseline is stated because it decides what "overhead" means):

* **B, measuring**: ``ActivationCheckpointing(policy=P)`` with ``measure=True`` (the default meter:
  saved-tensor hook + replay lookup, no per-op work) and ``log_every_n_steps=1``, so *every* B step is
  measured, reduced, logged to a ``TensorBoardLogger`` and shown in the progress-bar dict: the worst case
  (Lightning's default ``log_every_n_steps=50`` measures one step in 50).
* **A, not measuring**: *the same callback instance with the same policy* and ``measure=False`` (nothing is
  installed, nothing is logged; the plan, the step clock and the other hooks stay). The checkpointing itself
  is therefore identical in A and B; only the measurement differs.

Both run inside **one** ``Trainer.fit`` on one model, one optimizer (AdamW) and one repeated batch: the
variant is switched between optimizer steps in ABBA order (``A B B A``, then ``B A A B``, ...), so the two
variants see the same machine load, caches and weights. A step is timed by a separate callback from one
``on_train_batch_start`` to the next (the whole step: the callback's own hooks, forward, backward, optimizer
step, Lightning's logging and the next fetch); on CUDA the timer synchronizes the device at each mark (in both
variants alike). Each round gives ``ratio = (B1 + B2) / (A1 + A2)``; the verdict is the **median ratio over
rounds** against the target (1.03x on CPU, 1.01x on CUDA), printed as PASS or MISS from the unrounded
value. The first ``--warmup`` steps (the replay calibration, AdamW's lazy state) are not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_ckpt import ActivationCheckpointing  # noqa: E402
from lightning_ckpt.demos import GPTLightningModule  # noqa: E402
from lightning_ckpt.demos.gpt import GPTConfig  # noqa: E402

TARGET = {"cpu": 1.03, "cuda": 1.01}  # every step measured and logged
TARGET_AT_INTERVAL = 1.02  # at a logging interval (--log-every N > 1): within the machine's noise
HOST_TARGET_MS = {"gpt": 5.0, "gpt2": 3.0}  # --host: host time added per measured step
_PATTERNS = ("ABBA", "BAAB")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="GPTConfig.tiny(), batch 2, seq 64, 4 rounds, 1 thread: the format, not a verdict",
    )
    p.add_argument("--rounds", type=int, default=None, help="ABBA rounds (default 8; --quick 4)")
    p.add_argument("--warmup", type=int, default=4,
                   help="untimed blocks first (default 4: B A B A; the second B is the exact reference step of the "
                        "steady state, AdamW's state created)")
    p.add_argument(
        "--policy", default="every:2", help="checkpointing policy of both variants (default every:2)"
    )
    p.add_argument("--batch", type=int, default=None, help="micro-batch (default 4; --quick 2)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 512; --quick 64)")
    p.add_argument("--model", default="gpt", choices=("gpt", "gpt2"),
                   help="gpt: the demo GPT (default 12 blocks x 512); gpt2: Hugging Face GPT-2 from its config "
                        "(default 2 blocks x 64)")
    p.add_argument("--host", action="store_true",
                   help="host time: width and vocabulary 64, one head, micro-batch 1, 8 tokens, one thread")
    p.add_argument("--log-every", type=int, default=1, help="the Trainer's log_every_n_steps (default 1)")
    p.add_argument("--layers", type=int, default=None, help="blocks of the GPT (default 12)")
    p.add_argument("--width", type=int, default=None, help="residual width (default 512; heads = width / 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 512)")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed (default 32-true)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--case", default="single", choices=("single", "auto", "ddp"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--json", default=None, help="write per-step times and the verdict here")
    p.add_argument("--strict", action="store_true", help="exit 1 on a MISS")
    args = p.parse_args(argv)
    if args.host:  # the structure stays, the arithmetic goes: see the module docstring
        for name, value in (("width", 64), ("vocab", 64), ("batch", 1), ("seq", 8), ("threads", 1)):
            if getattr(args, name) is None:
                setattr(args, name, value)
        args.rounds = args.rounds or 20
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq = args.seq or (64 if args.quick else 512)
    if args.quick and args.threads is None:
        args.threads = 1
    if args.rounds < 1 or args.warmup < 2:
        p.error("--rounds must be >= 1 and --warmup >= 2 (one warm-up step of each variant)")
    if args.log_every < 1:
        p.error(f"--log-every={args.log_every} must be a positive number of steps (Lightning's default is 50)")
    return args


def build_module(args: argparse.Namespace):
    """The LightningModule to time and a one-line description of it."""
    if args.model == "gpt2":
        from lightning_ckpt.demos.hf import HFCausalLMModule

        width = args.width or 64
        shape = dict(n_layer=args.layers or 2, n_embd=width, n_head=1 if args.host else max(1, width // 16),
                     n_positions=max(128, args.seq), vocab_size=args.vocab or 96)
        seed_everything(0, verbose=False)
        module = HFCausalLMModule(dropout=0.0, lr=1e-4, **shape)
        return module, shape["vocab_size"], (f"Hugging Face GPT-2 {shape['n_layer']}x{width}, {shape['n_head']} heads, "
                                             f"vocab {shape['vocab_size']}")
    sizes = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.width), ("vocab_size", args.vocab))
             if v is not None}
    if args.width is not None:
        sizes["n_head"] = 1 if args.host else max(1, args.width // 64)
    cfg = (
        GPTConfig.tiny(block_size=args.seq, **sizes)
        if args.quick
        else GPTConfig.benchmark(block_size=max(512, args.seq), **sizes)
    )
    seed_everything(0, verbose=False)
    module = GPTLightningModule.from_config(cfg, lr=1e-4)
    return module, cfg.vocab_size, f"GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}"


class _SameBatch(LightningDataModule):
    def __init__(self, batch: Dict[str, torch.Tensor], n: int) -> None:
        super().__init__()
        self.batch, self.n = batch, n

    def train_dataloader(self) -> DataLoader:
        return DataLoader([self.batch] * self.n, batch_size=None)


def set_variant(cb: ActivationCheckpointing, measuring: bool) -> None:
    """B: measure (and decide, with an auto-toggle) on every step; A: neither."""
    engine = cb._engine
    engine.settings = engine.settings.replace(measure=measuring, decide_every_n_steps=1 if measuring else 10**9)


class AlternateAndTime(Callback):
    """Put first: switches the callback between A and B per step (ABBA) and times each whole step; with several
    processes, rank 0 writes its times to ``out``."""

    def __init__(self, cb: ActivationCheckpointing, schedule: List[str], cuda: bool, out: str = "") -> None:
        self.cb, self.schedule, self.cuda, self.out = cb, schedule, cuda, out
        self.marks: List[float] = []
        self.cpu_marks: List[float] = []
        self.measured: List[bool] = []
        self._seen = None  # the callback's last measured step, as the previous step left it
        self.end_before: List[float] = []

    def _mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())

    def _record_previous(self) -> None:
        if self.marks:  # the previous step is complete: did the callback measure it? (its last measured step moved)
            step = self.cb._engine.run_report.last_step
            self.measured.append(step is not None and step != self._seen)
            self._seen = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._record_previous()
        self._mark()
        set_variant(self.cb, self.schedule[len(self.marks) - 1] == "B")  # read by the callback's hook, next

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end_before.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self._record_previous()
        self._mark()  # closes the last step (after Lightning logged it)
        if self.out and trainer.global_rank == 0:
            with open(self.out, "w") as fh:
                json.dump(dict(marks=self.marks, cpu_marks=self.cpu_marks, measured=self.measured,
                               end_before=self.end_before), fh)


class HookClock(Callback):
    """Put last: with :class:`AlternateAndTime` first, brackets the measured callback's own batch hooks."""

    def __init__(self) -> None:
        self.start_after: List[float] = []
        self.end_after: List[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start_after.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end_after.append(time.perf_counter())


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = args.accelerator == "gpu"
    if cuda and not torch.cuda.is_available():
        print("--accelerator gpu: no CUDA device here")
        return 2
    warnings.filterwarnings("ignore")
    for line in C.header_lines([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]):
        print(line)
    print(f"load average at start: {C.load_average()}")

    model, vocab, described = build_module(args)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    n = args.log_every  # each letter of the schedule is a block of n steps
    letters = (["B", "A"] * args.warmup)[: args.warmup]  # warm-up: B first (the replay calibration), then A
    for r in range(args.rounds):
        letters += list(_PATTERNS[r % 2])
    schedule = [v for v in letters for _ in range(n)]
    steps = len(schedule)

    # the auto case: a threshold no step crosses, so the plan stays put while every B step reads and decides
    auto = dict(auto_threshold="1TiB", ladder=[args.policy, "all"]) if args.case == "auto" else {}
    cb = ActivationCheckpointing(policy=args.policy, report=False, **auto)
    ddp = args.case == "ddp"
    with tempfile.TemporaryDirectory() as logdir:
        timer = AlternateAndTime(cb, schedule, cuda, out=os.path.join(logdir, "times.json") if ddp else "")
        hooks = HookClock()
        trainer = Trainer(
            accelerator=args.accelerator,
            devices=2 if ddp else 1,
            strategy="ddp_spawn" if ddp else "auto",
            precision=args.precision,
            max_steps=steps,
            callbacks=[timer, cb, hooks],
            logger=TensorBoardLogger(logdir, name="overhead"),
            log_every_n_steps=n,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        t0 = time.perf_counter()
        trainer.fit(model, datamodule=_SameBatch(batch, steps))
        wall = time.perf_counter() - t0
        if ddp:  # the spawned ranks timed the steps; rank 0 wrote them
            with open(timer.out) as fh:
                for name, value in json.load(fh).items():
                    setattr(timer, name, value)

    step_s = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    cpu_s = [b - a for a, b in zip(timer.cpu_marks, timer.cpu_marks[1:])]
    assert len(step_s) == steps, (len(step_s), steps)
    # the schedule was obeyed: in a B block its logging step (the last) was measured; nothing else was
    expected = [v == "B" and (i + 1) % n == 0 for i, v in enumerate(schedule)]
    assert timer.measured == expected, "the callback did not follow the A/B schedule"

    ratios, cpu_ratios, extra_s = [], [], []
    first = args.warmup * n
    for r in range(args.rounds):
        idx = range(first + 4 * n * r, first + 4 * n * (r + 1))
        a = sum(step_s[i] for i in idx if schedule[i] == "A")
        b = sum(step_s[i] for i in idx if schedule[i] == "B")
        ratios.append(b / a)
        extra_s.append((b - a) / 2)  # two blocks of each variant per round, one measured step in each B block
        ca = sum(cpu_s[i] for i in idx if schedule[i] == "A")
        cb_ = sum(cpu_s[i] for i in idx if schedule[i] == "B")
        cpu_ratios.append(cb_ / ca if ca > 0 else math.nan)
    timed = range(first, steps)
    a_steps = [step_s[i] for i in timed if schedule[i] == "A"]
    b_steps = [step_s[i] for i in timed if schedule[i] == "B"]
    # the callback's own batch hooks (begin_step; end_step + ledger + reduce + log_dict), host time per step
    hook_ms = [
        1e3 * ((sa - sb) + (ea - eb))
        for sb, sa, eb, ea in zip(timer.marks, hooks.start_after, timer.end_before, hooks.end_after)
    ]  # empty under ddp_spawn: the hook clocks ran in the workers
    hook_a = [hook_ms[i] for i in timed if schedule[i] == "A" and i < len(hook_ms)] or [math.nan]
    hook_b = [hook_ms[i] for i in timed if schedule[i] == "B" and i < len(hook_ms)] or [math.nan]
    ratio = statistics.median(ratios)
    device = "cuda" if cuda else "cpu"
    target = TARGET[device] if n == 1 else TARGET_AT_INTERVAL
    plan = cb.plan
    blocks = f"{plan.num_checkpointed}/{plan.num_blocks} blocks" if plan is not None else "plan in the workers"

    print(
        f"model: {described} | "
        f"batch {args.batch} x seq {args.seq} | AdamW | {args.precision} | policy {args.policy!r} "
        f"({blocks}) | device {device} | case {args.case}"
    )
    print(
        f"baseline A: the same ActivationCheckpointing(policy={args.policy!r}) measuring nothing, deciding nothing; "
        + ("B: every step measured and logged (log_every_n_steps=1, TensorBoardLogger)" if n == 1 else
           f"B: measured and logged at Lightning's interval (log_every_n_steps={n}: one step in each block of {n})")
        + ("; and the auto-toggle decides on every B step" if args.case == "auto" else "")
        + ("; 2 DDP processes (gloo): every B step reduces across ranks" if ddp else "")
    )
    print(f"{args.rounds} ABBA rounds after {args.warmup} warm-up blocks of {n} step(s); fit wall time {wall:.1f} s"
          + ("; --host: the model's structure with its arithmetic shrunk (see the module docstring)" if args.host
             else ""))
    print()
    print(f"{'variant':<44} {'steps':>5} {'median s':>10} {'mean s':>10} {'min s':>10}")
    for name, xs in (
        ("A  callback, measure=False (same policy)", a_steps),
        ("B  callback, measure=True (default meter)", b_steps),
    ):
        med, mean = statistics.median(xs), statistics.fmean(xs)
        print(f"{name:<44} {len(xs):>5} {med:>10.4f} {mean:>10.4f} {min(xs):>10.4f}")
    print()
    print(f"per-round B/A wall ratios: {' '.join(f'{x:.4f}' for x in ratios)}")
    print(f"per-round B/A process-CPU ratios (diagnostic): {' '.join(f'{x:.4f}' for x in cpu_ratios)}")
    print(
        f"median B/A = {ratio:.4f} (range {min(ratios):.4f} .. {max(ratios):.4f}); "
        f"ratio of median step times = {statistics.median(b_steps) / statistics.median(a_steps):.4f}"
    )
    extra_ms = 1e3 * statistics.median(extra_s)
    print(
        f"extra time per measured step: median over rounds {extra_ms:.2f} ms "
        + ("(with log_every_n_steps=N only every N-th step is measured: about 1/N of that per step)" if n == 1 else
           f"(and the {n - 1} quiet steps of its block)")
    )
    print(
        f"the callback's own batch hooks, median per step: A {statistics.median(hook_a):.2f} ms, "
        f"B {statistics.median(hook_b):.2f} ms (host time; B's saved-tensor hooks in forward, its replay "
        "lookups in backward and Lightning writing the extra scalars are not in this figure, but are in the "
        "step times)"
    )
    print(f"load average at end: {C.load_average()}")
    host_target = HOST_TARGET_MS[args.model] if args.host and n == 1 else None
    ok = ratio <= target  # compared unrounded: a miss is never printed as a pass
    if host_target is not None:  # every step measured on a shrunk step: the ratio says how small it is, not a verdict
        print(f"median B/A {ratio:.4f} (--host: not a verdict; the step's arithmetic is shrunk)")
        ok = extra_ms <= host_target
        print(f"{'PASS' if ok else 'MISS'}  host time added per measured step ({described}): median "
              f"{extra_ms:.2f} ms {'<=' if ok else '>'} target {host_target:.0f} ms")
    else:
        note = ""
        if args.quick and not ok:
            note = " (--quick: a tiny model's step is a few ms, so per-step Python work dominates; not a verdict)"
        print(
            f"{'PASS' if ok else 'MISS'}  measurement overhead ({args.case}) on {device}: median B/A {ratio:.4f} "
            f"{'<=' if ok else '>'} target {target:.2f}{note}"
        )

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(
                    command=C.header_lines()[0],
                    torch=torch.__version__,
                    device=device,
                    policy=args.policy,
                    case=args.case,
                    schedule=schedule,
                    step_s=step_s,
                    cpu_s=cpu_s,
                    warmup=args.warmup,
                    ratios=ratios,
                    cpu_ratios=cpu_ratios,
                    extra_s=extra_s,
                    hook_ms=hook_ms,
                    ratio=ratio,
                    target=target,
                    log_every=n,
                    host=args.host,
                    extra_ms=extra_ms,
                    host_target_ms=host_target,
                    passed=ok,
                    model=described,
                    batch=args.batch,
                    seq=args.seq,
                ),
                fh,
                indent=2,
            )
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
