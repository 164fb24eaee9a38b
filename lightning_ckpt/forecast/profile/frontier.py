"""The memory / time frontier of a module: the fastest per-block plan at every budget, beside fixed modes.

``lightning-ckpt frontier pkg.module:Class`` (or :func:`frontier`) answers "what is the fastest way to fit this
run in this card?" for a whole range of cards at once:

1. **Calibrate** (plain PyTorch, no Trainer): :class:`~lightning_ckpt.decide.calibration.BudgetCalibration` runs its
   steps — every mode on the even, then the odd blocks — and measures each block's bytes kept, replay transient
   and time per mode (``recompute`` and ``selective``; ``offload`` on CUDA).
2. **Fixed modes** (:data:`ANCHORS`): ``none``, ``all``, ``selective``, ``every:2``, ``first:N`` … each measured
   for its activation peak (one exact step, the figure the callback logs) and step time.
3. **Budgets**: ``budgets`` evenly spaced from ``all``'s measured peak to ``none``'s (or the sizes given). At
   each, :func:`~lightning_ckpt.decide.budget.plan_budget` chooses the per-block mix; the plan is measured; if the
   measured peak exceeds the budget, that plan is marked with its measured peak and the plan is chosen again (up
   to three times; the callback, mid-training, corrects once). A budget below the smallest feasible one is
   reported as refused, with that smallest budget named.
4. **Time**: all configurations are timed in interleaved rounds (every configuration once per round, one untimed
   round first), without any meter; the median and the range over rounds are reported, so that the machine's
   drift hits every configuration alike.

With ``compile_blocks`` (``--compile-blocks [BACKEND]``) every block is compiled as its own graph
(``block.compile()``, the torchtitan / FSDP2 way) and the plans are what the callback chooses for such a model: the
modes are priced on the compiled block alone, and the compiler's own budget per block, ``compiler:<f>``, joins the
modes (measured on the compiled block). Peaks come from exact steps, which run compiled code eagerly, so a plan's
``compiler:<f>`` blocks count there as ``off`` and their measured savings are taken off, as the callback does; times
are the compiled steps'.

Outputs under ``out``: ``frontier.json``, ``frontier.png`` (activation peak on x, step time on y: the budget plans
as a line, every fixed mode as a labelled point) and the table :func:`frontier_table` prints.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_ckpt.core.policy import COMPILER_MODE, parse_policy
from lightning_ckpt.core.units import MiB, format_bytes, parse_size
from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.decide.budget import mode_mix, plan_budget, smallest_budget
from lightning_ckpt.decide.calibration import COMPILER_FRACTIONS, BudgetCalibration
from lightning_ckpt.decide.choose import TIME_TIE
from lightning_ckpt.forecast.load import build_model, lightning_step, load_init_args, make_optimizers
from lightning_ckpt.forecast.precision import parse_precision
from lightning_ckpt.measure.meter import StepMeter

__all__ = ["ANCHORS", "FrontierPoint", "FrontierReport", "frontier", "frontier_table", "parse_budgets"]

# fixed modes drawn as points, with the system each one stands for
ANCHORS: Dict[str, str] = {
    "none": "no checkpointing",
    "all": "torchtitan full / Megatron full uniform / HF gradient_checkpointing",
    "selective": "op-level selective (keep matmul and attention outputs)",
    "every:2": "HF-style every 2nd layer",
    "first:half": "Megatron full block, N = half the layers",
}


@dataclass
class FrontierPoint:
    """One measured configuration: a budget plan or a fixed mode; bytes are ``int``."""

    label: str
    modes: Tuple[str, ...]
    activations: int = 0
    step_s: float = 0.0
    step_range: Tuple[float, float] = (0.0, 0.0)
    budget: Optional[int] = None
    predicted: Optional[int] = None
    fits: Optional[bool] = None
    corrected: bool = False
    refused: Optional[str] = None
    times: List[float] = field(default_factory=list, repr=False)

    @property
    def mix(self) -> str:
        """``"6 off, 4 selective, 2 recompute"``."""
        return mode_mix(self.modes)


@dataclass
class FrontierReport:
    """What :func:`frontier` measured; ``as_json()`` is ``frontier.json``."""

    model: str
    device: str
    settings: Dict[str, Any]
    plans: List[FrontierPoint]
    anchors: List[FrontierPoint]
    smallest_budget: int
    outputs: Dict[str, str] = field(default_factory=dict)

    def as_json(self) -> Dict[str, Any]:
        def point(p: FrontierPoint) -> Dict[str, Any]:
            data = asdict(p)
            data["mix"] = p.mix
            return data

        return {"model": self.model, "device": self.device, "settings": self.settings,
                "smallest_budget": self.smallest_budget, "plans": [point(p) for p in self.plans],
                "anchors": [point(p) for p in self.anchors], "outputs": self.outputs}

    def fastest_anchor(self, budget: int) -> Optional[FrontierPoint]:
        """The fastest fixed mode whose measured peak fits ``budget``."""
        fitting = [a for a in self.anchors if a.activations <= budget]
        return min(fitting, key=lambda a: a.step_s) if fitting else None


def parse_budgets(value: Union[str, int, Sequence[Any]], arg: str = "--budgets") -> Union[int, List[int]]:
    """``8`` (that many budgets between ``all``'s and ``none``'s peak) or sizes ``"40MiB,60MiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        count: Union[int, List[int]] = value
    elif isinstance(value, str) and value.strip().isdigit():
        count = int(value.strip())
    else:
        items = [i for i in value.split(",") if i.strip()] if isinstance(value, str) else list(value)
        if not items:
            raise ValueError(f"{arg}={value!r} is empty; pass a count (e.g. 8) or sizes such as '40MiB,60MiB'.")
        sizes = []
        for item in items:
            try:
                size = parse_size(str(item).strip(), name=arg) if isinstance(item, str) else int(item)
            except ValueError as err:
                raise ValueError(f"{err} {arg} takes a count (e.g. 8) or sizes such as '40MiB,60MiB'.") from None
            if size <= 0:
                raise ValueError(f"{arg}={value!r}: a budget must be a positive size; got {item!r}.")
            sizes.append(size)
        return sorted(sizes)
    if count < 2:
        raise ValueError(f"{arg}={value!r}: a count of budgets must be at least 2 (the two ends).")
    return count


def frontier(
    model: Any,
    init_args: Union[str, Dict[str, Any], None] = None,
    *,
    micro_batch: int = 2,
    seq_len: int = 64,
    budgets: Union[str, int, Sequence[Any]] = 8,
    anchors: Sequence[str] = tuple(ANCHORS),
    rounds: int = 5,
    precision: str = "32-true",
    device: Union[str, torch.device, None] = None,
    out: Union[str, os.PathLike] = "frontier_out",
    plot: bool = True,
    seed: int = 0,
    compile_blocks: Optional[str] = None,
) -> FrontierReport:
    """Measure the frontier of ``model`` (see the module docstring) and write the outputs under ``out``.

    Args:
        model: a module with ``training_step`` (or a loss-returning forward) and ``example_batch(micro_batch,
            seq_len)``, as an import path, a class or an instance.
        init_args: keyword arguments (dict or JSON text).
        micro_batch, seq_len: the batch shape of every step.
        budgets: a count (evenly spaced from ``all``'s measured peak to ``none``'s) or activation budgets as sizes.
        anchors: fixed modes to draw as points (keys of :data:`ANCHORS` or any fixed policy).
        rounds: timed rounds (after one untimed round).
        precision: a Lightning precision name.
        device: ``cuda`` when available, else ``cpu``.
        compile_blocks: a ``torch.compile`` backend (e.g. ``"inductor"``): compile every block with it, one graph
            per block, and offer the compiler's budget per block (module docstring); ``None``: run eagerly.

    Raises:
        ValueError: bad input, before any step runs.
    """
    wanted = parse_budgets(budgets)
    for name, value in (("--micro-batch", micro_batch), ("--seq-len", seq_len), ("--rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    mode = parse_precision(precision)
    _check_backend(compile_blocks)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, kwargs, _ = load_init_args(init_args, None)
    label = model if isinstance(model, str) else getattr(model, "__qualname__", type(model).__name__)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = model if isinstance(model, nn.Module) else build_model(model, kwargs, arg="model")
    if not callable(getattr(module, "example_batch", None)):
        raise ValueError(f"{label!r} has no example_batch(micro_batch, seq_len) hook; add one (see "
                         "lightning_ckpt.forecast.profile).")
    module.to(dev)
    if mode.param_dtype is not None:
        module.to(mode.param_dtype)
    module.train()
    plan = apply_policy(module, "none")
    specs = {name: _anchor_spec(name, plan.num_blocks) for name in anchors}
    for name, spec in specs.items():
        try:
            parse_policy(spec).layout(plan.num_blocks)
        except ValueError as err:
            raise ValueError(f"--anchors: {name!r} is not a fixed mode ({err}); use {', '.join(ANCHORS)} or any "
                             "fixed policy such as every:3.") from None
    if compile_blocks is not None:
        for block in plan.blocks:
            block.compile(backend=compile_blocks)
    torch.manual_seed(seed)
    batch = _to(module.example_batch(micro_batch, seq_len), dev)
    opts = make_optimizers(module, None)
    runner = _Runner(module, batch, opts, mode, dev)
    runner.step()  # lazy optimizer state and one-time kernel set-up, before anything is measured

    modes = ("recompute", "selective", "offload") if dev.type == "cuda" else ("recompute", "selective")
    compiled = compile_blocks is not None
    calibration = BudgetCalibration(plan, runner.meter, budget=2**62, synchronize=runner.sync, modes=modes,
                                    block_caller=(lambda block: block) if compiled else None,
                                    compiler_fractions=COMPILER_FRACTIONS if compiled else ())
    calibration.run(lambda exact: runner.activations(exact=exact))
    costs, base = calibration.costs(), calibration.base
    solver_modes = ("off", *modes, *[COMPILER_MODE] * compiled)
    floor = smallest_budget(costs, base, solver_modes)

    anchor_points = []
    for name, spec in specs.items():
        plan.retarget(spec)
        anchor_points.append(FrontierPoint(name, plan.modes, activations=runner.activations()))
    by_name = {p.label: p for p in anchor_points}
    low = by_name["all"].activations if "all" in by_name else floor
    high = by_name["none"].activations if "none" in by_name else max(p.activations for p in anchor_points)
    levels = wanted if isinstance(wanted, list) else [round(low + (high - low) * i / (wanted - 1))
                                                       for i in range(wanted)]
    measured = dict(calibration.measured_plans)
    measured.update({tuple(p.modes): p.activations for p in anchor_points})
    floor = min(floor, min(measured.values()))  # a plan measured to fit is feasible, whatever the model says
    plans = [_budget_point(plan, runner, costs, base, budget, solver_modes, measured, calibration.compiled_savings)
             for budget in levels]

    points = [p for p in plans + anchor_points if p.refused is None]
    load_start = _load_average()
    _time_interleaved(plan, runner, points, rounds)
    load = (load_start, _load_average())
    plan.retarget("none")
    report = FrontierReport(model=label, device=str(dev), plans=plans, anchors=anchor_points, smallest_budget=floor,
                            settings=dict(micro_batch=micro_batch, seq_len=seq_len, budgets=levels, rounds=rounds,
                                          precision=mode.name, anchors={a: specs[a] for a in specs},
                                          modes=solver_modes[1:], base=base, seed=seed, compile_blocks=compile_blocks,
                                          load_average=load,  # (1, 5, 15 min) before and after the timing
                                          block_seconds=calibration.block_seconds,
                                          compiled_kept=calibration.compiled_kept))
    outdir = os.fspath(out)
    os.makedirs(outdir, exist_ok=True)
    report.outputs["json"] = os.path.join(outdir, "frontier.json")
    if plot:
        report.outputs["png"] = save_frontier_plot(report, os.path.join(outdir, "frontier.png"))
    with open(report.outputs["json"], "w", encoding="utf-8") as fh:
        json.dump(report.as_json(), fh, indent=2)
    return report


def _check_backend(backend: Optional[str]) -> None:
    """Refuse an unknown ``torch.compile`` backend before anything runs."""
    if backend is None:
        return
    valid = sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})
    if backend not in valid:
        raise ValueError(f"--compile-blocks={backend!r} is not a torch.compile backend; valid backends: "
                         f"{', '.join(valid)} (inductor compiles, aot_eager partitions without code generation).")


def _anchor_spec(name: str, num_blocks: int) -> str:
    if name == "first:half":
        return f"first:{max(num_blocks // 2, 1)}"
    return name


def _to(batch: Any, dev: torch.device) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, batch)


class _Runner:
    """One training step in Lightning's order (forward, ``zero_grad``, backward, ``step``), measured or timed."""

    def __init__(self, module, batch, opts, precision, dev) -> None:
        self.module, self.batch, self.opts, self.precision, self.dev = module, batch, opts, precision, dev
        self.meter = StepMeter(dev, model=module)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def step(self) -> None:
        lightning_step(self.module, self.batch, self.opts, self.precision, self.dev.type)

    def activations(self, exact: bool = True) -> int:
        """The activation peak of one step: exact (what the callback logs; compiled code runs eagerly), or the cheap
        figure (a timed step)."""
        gc.collect()
        with self.meter.step(exact=exact) as box:
            self.step()
        return int(box.reading.activations or 0)

    def seconds(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.step()
        self.sync()
        return time.perf_counter() - t0


def _budget_point(plan, runner: _Runner, costs, base, budget: int, modes, measured, savings) -> FrontierPoint:
    """The plan at ``budget``, measured (its ``compiler:<f>`` blocks' ``savings`` taken off the eager figure)."""
    chosen = plan_budget(costs, budget, base, modes, measured=measured, tie=TIME_TIE)
    point = FrontierPoint(f"budget {format_bytes(budget)}", chosen.modes, budget=budget,
                          predicted=chosen.predicted_peak)
    if not chosen.fits:
        point.refused = (f"the smallest feasible budget is {format_bytes(chosen.smallest_budget)}; "
                         f"{format_bytes(budget)} cannot be met with modes {list(modes)}")
        return point
    plan.set_modes(chosen.modes)
    point.activations = runner.activations() - savings(chosen.modes)
    for _ in range(3):  # offline there is time: a measured overshoot is corrected until the plan fits (3 at most)
        if point.activations <= budget:
            break
        measured[tuple(point.modes)] = point.activations
        again = plan_budget(costs, budget, base, modes, measured=measured, tie=TIME_TIE)
        if not again.fits or again.modes == tuple(point.modes):
            break
        plan.set_modes(again.modes)
        point.modes, point.predicted, point.corrected = again.modes, again.predicted_peak, True
        point.activations = runner.activations() - savings(again.modes)
    point.fits = point.activations <= budget
    return point


def _time_interleaved(plan, runner: _Runner, points: List[FrontierPoint], rounds: int) -> None:
    """Every distinct plan once per round, rotating the order; one untimed round first."""
    distinct: Dict[Tuple[str, ...], List[FrontierPoint]] = {}
    for p in points:
        distinct.setdefault(tuple(p.modes), []).append(p)
    keys = list(distinct)
    samples: Dict[Tuple[str, ...], List[float]] = {k: [] for k in keys}
    for r in range(rounds + 1):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            plan.set_modes(k)
            seconds = runner.seconds()
            if r:
                samples[k].append(seconds)
    for k, ps in distinct.items():
        for p in ps:
            p.times = samples[k]
            p.step_s = statistics.median(samples[k])
            p.step_range = (min(samples[k]), max(samples[k]))


def _load_average() -> Optional[Tuple[float, float, float]]:
    """The machine's load average (1, 5, 15 minutes), or ``None`` where the platform has none: times measured on a
    loaded machine say so."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return None


def frontier_table(report: FrontierReport) -> str:
    """Per budget: the plan's mix, measured peak, time, and the fastest fixed mode that fits, with the ratio."""
    rows = [f"frontier of {report.model} on {report.device} ({report.settings['precision']}, micro-batch "
            f"{report.settings['micro_batch']} × {report.settings['seq_len']}); smallest feasible budget "
            f"{format_bytes(report.smallest_budget)}",
            f"{'budget':>11} {'plan':<34}{'peak':>11}{'fits':>6}{'step ms':>9}  {'fastest fixed mode that fits':<30}"
            f"{'ratio':>7}  verdict"]
    for p in report.plans:
        if p.refused:
            rows.append(f"{format_bytes(p.budget):>11} refused: {p.refused}")
            continue
        anchor = report.fastest_anchor(p.budget)
        ratio = p.step_s / anchor.step_s if anchor else None
        verdict = "—" if ratio is None else ("PASS" if ratio <= 1.0 else "TIE" if ratio <= 1.02 else "MISS")
        if not p.fits:
            verdict = "MISS (over budget)"
        rows.append(f"{format_bytes(p.budget):>11} {p.mix:<34}{format_bytes(p.activations):>11}"
                    f"{'yes' if p.fits else 'NO':>6}{p.step_s * 1e3:>9.1f}  "
                    f"{(anchor.label + f' {anchor.step_s * 1e3:.1f} ms') if anchor else 'none fits':<30}"
                    f"{'' if ratio is None else f'{ratio:.3f}':>7}  {verdict}")
    rows.append("fixed modes: " + "; ".join(f"{a.label} {format_bytes(a.activations)} {a.step_s * 1e3:.1f} ms"
                                            for a in report.anchors))
    return "\n".join(rows)


def save_frontier_plot(report: FrontierReport, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    ours = sorted((p for p in report.plans if p.refused is None), key=lambda p: p.activations)

    def bars(points):  # each point's range over the interleaved rounds, around its median
        return [[(p.step_s - p.step_range[0]) * 1e3 for p in points], [(p.step_range[1] - p.step_s) * 1e3
                                                                          for p in points]]

    ax.errorbar([p.activations / MiB for p in ours], [p.step_s * 1e3 for p in ours], yerr=bars(ours), marker="o",
                color="tab:blue", capsize=3, label="lightning_ckpt budget plan")
    anchors = list(report.anchors)
    ax.errorbar([a.activations / MiB for a in anchors], [a.step_s * 1e3 for a in anchors], yerr=bars(anchors),
                fmt="s", color="tab:red", capsize=3, zorder=3, label="fixed modes (anchors)")
    for a in anchors:
        ax.annotate(a.label, (a.activations / MiB, a.step_s * 1e3), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set(xlabel="activation peak (MiB)", ylabel="step time (ms): median, bar = range over the rounds")
    ax.set_title(f"memory / time frontier: {report.model.split(':')[-1].split('.')[-1]} "
                 f"({report.settings['precision']}, {report.device})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    load = report.settings.get("load_average")
    shown = " → ".join("/".join(f"{x:.2f}" for x in avg) for avg in load if avg) if load else "not available"
    fig.text(0.01, 0.01, f"{report.settings['rounds']} interleaved rounds; load average (1/5/15 min) during the "
                         f"timing: {shown}", fontsize=7, color="0.3")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
