"""Issue 14 / issue 33: our ``budget:`` plan against the fixed modes the frameworks ship, at budgets between ``all`` and
``none``, side by side in one process; with ``--compile``, against torch.compile's own activation memory budget.

**Eager rows** (the default): for each model (the demo GPT, a Hugging Face Llama built from its config) and
precision, ``benchmarks/budget.py``'s comparison, run as a user runs the plugin: every configuration is a
``lightning.Trainer`` with ``ActivationCheckpointing(policy=...)`` on its own copy of the model, the steps of all of
them interleaved one by one (``benchmarks/_trainer.py``), each configuration of the verdict in ``--instances``
Trainers (default 3: one Trainer's own bias averages over them). Budgets at ``--positions`` of the way from ``all``'s
to ``none``'s activation figure (the callback's own per-step figure; default 25, 50 and 75 %); ours is
``policy="budget:<bytes>"``, timed after its calibration; the anchors are the fixed policies with the frameworks'
names beside them: ``all`` (torchtitan ``full``), ``first:K`` (Megatron ``full``/``block`` over K layers),
``every:N`` (Hugging Face ``every_n_layers``), ``selective`` (the plugin's op-level selective: matmul and attention
outputs kept, pointwise ops recomputed) and ``none``. Per budget: ours / the fastest fitting anchor, the median of
per-round ratios; PASS at ≤ 1.00, else MISS with its number; "(the same plan)" where our plan is that anchor's own
plan (a ratio between the same computation is the machine's noise and the callback's per-step work). Beside it: the
worst step against the budget (calibration included), the calibration's steps and the pricing time, from the
callback's end-of-fit report.

**Compiled rows** (``--compile [model,block,split]``; these rows only): per budget, the compiler's activation memory
budget at the fraction budget / ``none``'s peak against our plan compiled, for the whole model compiled, for blocks
compiled one by one, and (``split``) for the user's whole-model compile, which the compiler's budget runs as one graph
and our plan, as ``compile_blocks=True``, one graph per block. Memory there is the CPU allocator's activation peak
(which sees inside a compiled graph; see :func:`compiled_rows`). Unlike the eager rows these drive the plugin's
calibration directly (its internal classes, imported when ``--compile`` is given).

Usage::

    python benchmarks/frontier.py                                   # GPT and Llama 6 x 256, float32, 25/50/75 %
    python benchmarks/frontier.py --budgets 8 --rounds 9            # 8 budgets evenly from all to none
    python benchmarks/frontier.py --precisions bf16-mixed --quick   # bf16 autocast at 4 x 128
    python benchmarks/frontier.py --quick                           # smoke: 4 x 128, 2 rounds
    python benchmarks/frontier.py --models gpt --precisions 32-true --compile           # model and block grain
    python benchmarks/frontier.py --small --models gpt --precisions 32-true --compile block
    python benchmarks/frontier.py --small --models gpt --precisions bf16-mixed --compile split  # compile_blocks
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _trainer as T  # noqa: E402
import budget as B  # noqa: E402
from _common import allocation_peaks, header_lines, load_average, measure_memory  # noqa: E402

from lightning_ckpt.core.blocks import find_blocks  # noqa: E402
from lightning_ckpt.core.units import MiB  # noqa: E402
from lightning_ckpt.core.wrap import apply_policy, remove_checkpointing  # noqa: E402
from lightning_ckpt.forecast.load import lightning_step, make_optimizers, step_loss  # noqa: E402
from lightning_ckpt.forecast.precision import parse_precision  # noqa: E402
from lightning_ckpt.measure.meter import StepMeter  # noqa: E402

TIE = 1.02


def _budget_internals() -> types.SimpleNamespace:
    """The plugin's calibration and solver, for the compiled rows only (the eager rows use the callback): found in
    whichever of its modules holds them now (they are being moved between modules)."""
    import importlib

    found: Dict[str, Any] = {}
    for name in ("lightning_ckpt.decide.calibration", "lightning_ckpt.decide.budget"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr in ("BudgetCalibration", "COMPILER_FRACTIONS", "plan_budget"):
            if attr not in found and hasattr(module, attr):
                found[attr] = getattr(module, attr)
    return types.SimpleNamespace(**found)


def mode_mix(modes: Sequence[str]) -> str:
    return B.mix(modes)


# ------------------------------------------------------------------------------------------ the eager rows


def label(policy: str) -> str:
    """``first:3`` → ``first:3 (Megatron block 3)``."""
    other = B.framework_name(policy)
    return f"{policy} ({other})" if other else policy


def eager_case(model_name: str, precision: str, args) -> Dict[str, Any]:
    """``benchmarks/budget.py``'s case, with each row marked where our plan is the fastest anchor's own plan."""
    result = B.run_case(model_name, args, precision)
    for row in result["rows"]:
        row.setdefault("same_plan", False)
    return result


def print_eager(result: Dict[str, Any]) -> None:
    B.print_case(result, label=label)


# ------------------------------------------------------------------------------------------ the compiled rows


def build(name: str, small: bool):
    """The compiled rows' models: 4 x 128 (``--small``/``--quick``) or 8 x 256, sequence as long as the width."""
    from lightning_ckpt.demos import GPTLightningModule, HFCausalLMModule

    layers, width, seq = (4, 128, 128) if small else (8, 256, 256)
    if name == "gpt":
        return GPTLightningModule(n_layer=layers, n_embd=width, n_head=8, block_size=seq, dropout=0.0), seq
    return HFCausalLMModule(arch="llama", n_layer=layers, n_embd=width, n_head=8, n_positions=seq,
                            vocab_size=512), seq


# the compiled rows' model, one precision: its step, peaks and times


class Bench:
    """One model in one precision: its step, its configurations, their peaks and times."""

    def __init__(self, module, seq: int, micro_batch: int, precision: str) -> None:
        self.module, self.precision = module, parse_precision(precision)
        if self.precision.param_dtype is not None:
            module.to(self.precision.param_dtype)
        module.train()
        self.batch = module.example_batch(micro_batch, seq)
        self.opts = make_optimizers(module, None)
        self.blocks = [b for _, b in find_blocks(module)]
        self.step()

    def step(self) -> None:
        lightning_step(self.module, self.batch, self.opts, self.precision)

    def fwd_bwd(self) -> None:
        with self.precision.forward_context("cpu"):
            loss = step_loss(self.module, self.batch)
        loss.backward()
        del loss
        self.module.zero_grad(set_to_none=True)

    def peak(self) -> int:
        """The activation peak of one forward + backward. Float32: MemTracker's ACT line (independent of the
        plugin). Under autocast MemTracker's ACT also holds autocast's weight copies, which the budget does not
        govern (it reads the activation line, copies apart): there the plugin's exact activation line is used, which
        tests/lightning/test_precision.py checks against an independent live-tensor count."""
        if self.precision.autocast_dtype is not None:
            meter = StepMeter("cpu", model=self.module)
            with meter.step(exact=True) as box:
                self.fwd_bwd()
            return int(box.reading.activations or 0)
        tensors = [t for t in (self.batch.values() if isinstance(self.batch, dict) else self.batch)
                   if isinstance(t, torch.Tensor)]
        return measure_memory(self.fwd_bwd, external=(self.module, *tensors)).act_peak

    def seconds(self) -> float:
        gc.collect()
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


def our_costs(bench: Bench, block_caller: Optional[Callable] = None, compiler_fractions: Sequence[float] = ()):
    """The plugin's calibration, run as the callback runs it (exact bytes steps, timed steps; with the blocks
    compiled, ``block_caller`` and, block by block, the compiler's budgets per block, as the callback passes them:
    eager bytes steps, then blocks timed, and measured for the ``compiler:<f>`` modes, compiled)."""
    plan = apply_policy(bench.module, "none")
    meter = StepMeter("cpu", model=bench.module)
    calibration = _budget_internals().BudgetCalibration(plan, meter, budget=2**62, block_caller=block_caller,
                                    compiler_fractions=compiler_fractions)

    def step(exact: bool) -> int:
        with meter.step(exact=exact, eager=True) as box:
            bench.step()
        return int(box.reading.activations or 0)

    calibration.run(step)
    measured = dict(calibration.measured_plans)
    for spec in ("none", "all", "every:2"):  # what the callback would know: its own measured plans
        plan.retarget(spec)
        with meter.step(exact=True) as box:
            bench.step()
        measured[plan.modes] = int(box.reading.activations or 0)
    plan.retarget("none")
    return plan, calibration, measured


EAGER_MODES = ("off", "recompute", "selective")


def fit_plans(bench: Bench, budgets: Sequence[int], costs, base, measured: Dict[Tuple[str, ...], int],
              modes: Sequence[str] = EAGER_MODES, savings: Callable[[Sequence[str]], int] = lambda modes: 0
              ) -> Dict[int, Tuple[Tuple[str, ...], int]]:
    """Our plan at each budget and its measured (MemTracker) peak: chosen from the calibrated costs, and, offline,
    a measured overshoot corrected until the plan fits (at most 3 times). With ``compiler:<f>`` blocks, which an
    eager measurement runs as ``off``, the peak is the callback's: the eager peak less their measured savings
    (``savings``, :meth:`BudgetCalibration.compiled_savings`)."""
    ours = {}
    for budget in budgets:
        chosen = _budget_internals().plan_budget(costs, budget, base, modes, measured=measured)
        plan = apply_policy(bench.module, "none")
        plan.set_modes(chosen.modes)
        peak = bench.peak() - savings(chosen.modes)
        for _ in range(3):
            if peak <= budget:
                break
            measured[chosen.modes] = peak
            chosen = _budget_internals().plan_budget(costs, budget, base, modes, measured=measured)
            plan.set_modes(chosen.modes)
            peak = bench.peak() - savings(chosen.modes)
        remove_checkpointing(bench.module)
        ours[budget] = (chosen.modes, peak)
    return ours


GRAINS = ("model", "block", "split")
GRAIN_TITLES = {"model": "torch.compile(model)", "block": "block.compile() per block",
                "split": "torch.compile(model) for the compiler's budget; split, compile_blocks=True, for ours"}
REGION_BUDGET = "_bench_region_budget"  # the compiler's budget of a compiled graph (None: not set)


def _region_budgeted(block: torch.nn.Module) -> Callable:
    """A forward for ``block`` (a block, or the whole model) that, when ``block._bench_region_budget`` is a fraction,
    runs under ``torch.autograd.graph.region_activation_memory_budget``: the annotation covers the compiled graph's
    whole forward, so it is that graph's ``activation_memory_budget``. Dynamo guards on the attribute, so the
    budgeted and the plain graphs live side by side (a global config patch would not be guarded)."""
    own = type(block).forward

    def forward(self, *args, **kwargs):
        fraction = getattr(self, REGION_BUDGET)  # a string: dynamo would trace a float attribute as a symbol
        if fraction is None:
            return own(self, *args, **kwargs)
        with torch.autograd.graph.region_activation_memory_budget(float(fraction)):
            return own(self, *args, **kwargs)

    return types.MethodType(forward, block)


class CompiledGrain:
    """The benchmark model compiled at one grain: ``model`` (``torch.compile`` of the whole model), ``block``
    (``block.compile()`` per block, the torchtitan / FSDP2 way), or ``split``: the user's ``torch.compile(model)``
    for the compiler's budget (one whole-model graph, as in ``model``) and, for our plan, that compile split into one
    graph per block as ``compile_blocks=True`` does (``torch.compile``'s defaults per block, what
    :func:`lightning_ckpt.lightning.compiled.compile_blocks_one_by_one` gives a default whole-model compile; both
    compiled objects live side by side, so the variants still alternate round by round). The compiler's budget is
    the compiled graph's ``region_activation_memory_budget`` (the whole model's forward, or each block's), set through
    :func:`_region_budgeted`: it overrides ``torch._functorch.config.activation_memory_budget`` for that graph, and
    dynamo guards on it, so each fraction gets its own graph (a config patch is not guarded: a second fraction would
    silently reuse the first one's graph)."""

    def __init__(self, bench: Bench, grain: str) -> None:
        self.bench, self.grain, self.inner = bench, grain, bench.module.model
        torch._dynamo.reset()
        self.budgeted = list(bench.blocks) if grain == "block" else [self.inner]
        for module in self.budgeted:
            setattr(module, REGION_BUDGET, None)
            module.forward = _region_budgeted(module)
        if grain != "model":
            for block in bench.blocks:
                block.compile()
        self.whole = torch.compile(self.inner) if grain != "block" else None
        bench.module.model = self.whole if grain == "model" else self.inner

    def block_caller(self) -> Callable:
        """What the callback passes to the calibration for this grain (``compiled.compiled_block_caller``)."""
        return torch.compile if self.grain == "model" else (lambda block: block)

    def use(self, plan, modes: Sequence[str], fraction: Optional[float]) -> None:
        """Set a variant: our modes, or every block off under the compiler's budget ``fraction``."""
        plan.set_modes(list(modes))
        for module in self.budgeted:
            setattr(module, REGION_BUDGET, None if fraction is None else repr(fraction))
        if self.grain == "split":  # the compiler's budget runs the whole-model graph, our plan the per-block ones
            self.bench.module.model = self.whole if fraction is not None else self.inner

    def peak(self, plan, modes: Sequence[str], fraction: Optional[float]) -> int:
        """Compile a variant (one step) and read its activation peak from the CPU allocator."""
        self.use(plan, modes, fraction)
        self.bench.step()
        gc.collect()
        return allocation_peaks(self.bench.fwd_bwd, list(self.bench.module.parameters()))[1]

    def close(self) -> None:
        self.bench.module.model = self.inner
        remove_checkpointing(self.bench.module)
        for block in self.bench.blocks:
            block._compiled_call_impl = None
        for module in self.budgeted:
            del module.forward
            delattr(module, REGION_BUDGET)
        torch._dynamo.reset()


def compiled_ends(bench: Bench, grain: str) -> Dict[str, int]:
    """``all``'s and ``none``'s allocator peaks compiled at ``grain``, printed beside the eager ones: how far the
    compiled graphs move the range (block by block, fusion drops the intermediates of blocks kept: on the Llama
    ``none`` 139 MiB against 177 eager; one whole-model graph holds more under ``all``: 43.8 against 34.6).

    They are not the budgets' ends: a budget stands for a card, whose bytes do not shrink or grow when the model
    is compiled, and both variants are held to it (a range between the compiled ends would tighten the budgets
    block by block and loosen them for the whole model)."""
    compiled = CompiledGrain(bench, grain)
    plan = apply_policy(bench.module, "none")
    try:
        return {spec: compiled.peak(plan, (mode,) * len(bench.blocks), None)
                for spec, mode in (("all", "recompute"), ("none", "off"))}
    finally:
        compiled.close()


def eager_allocator_ends(bench: Bench) -> Dict[str, int]:
    """``all``'s and ``none``'s allocator peaks run eagerly: the ends the compiled rows' budgets are spaced between
    (eager, like the plans' MemTracker peaks: MemTracker sees eager operators only). Measured once per case."""
    ends = {}
    for spec in ("all", "none"):
        apply_policy(bench.module, spec)
        gc.collect()
        ends[spec] = allocation_peaks(bench.fwd_bwd, list(bench.module.parameters()))[1]
        remove_checkpointing(bench.module)
    return ends


def compiled_rows(bench: Bench, budgets: Sequence[int], ends_memtracker: Tuple[int, int], eager_ends: Dict[str, int],
                  args, grain: str) -> List[Dict[str, Any]]:
    """The compiler's activation memory budget at ``budget / none's peak`` against our plan, both compiled at one
    grain (:class:`CompiledGrain`). Our plan comes from the plugin's calibration run on the compiled model as the
    callback runs it: bytes steps eagerly, block times compiled (``block_caller``).

    One compiled model holds both variants' graphs (dynamo guards on each block's mode and, per block, on its region
    budget), so the two are timed in interleaved rounds and compared per round, like the eager rows; the cache is
    reset between budgets (dynamo's recompile limit). Memory: the CPU allocator's activation peak of one forward +
    backward (gradient buffers left out), the instrument of ``benchmarks/compile.py`` that sees inside compiled
    graphs, for both variants and for our plan run eagerly. The budgets are MemTracker peaks, evenly spaced between
    eager ``all``'s and ``none``'s; in the allocator's units (which also count backward temporaries) the same
    budgets are evenly spaced between eager ``all``'s and ``none``'s allocator peaks, and a variant fits when its
    compiled allocator peak is at most that (the compiled ends, :func:`compiled_ends`, are kept in the row).
    """
    params = list(bench.module.parameters())
    compiled = CompiledGrain(bench, grain)
    try:
        # the compiler's budget per block exists only where each block is its own graph (engine.fit_start)
        fractions = _budget_internals().COMPILER_FRACTIONS if grain != "model" else ()
        _, calibration, measured = our_costs(bench, compiled.block_caller(), fractions)
    finally:
        compiled.close()
    ends = compiled_ends(bench, grain)
    modes = (*EAGER_MODES, "compiler") if grain != "model" else EAGER_MODES
    ours = fit_plans(bench, budgets, calibration.costs(), calibration.base, measured, modes,
                     calibration.compiled_savings)
    rows = []
    low, high = ends_memtracker
    for budget in budgets:
        fraction = min(max(budget / ends_memtracker[1], 0.0), 1.0)
        allocator_budget = round(eager_ends["all"] + (eager_ends["none"] - eager_ends["all"]) * (budget - low)
                                 / max(high - low, 1))
        modes = ours[budget][0]
        off = ("off",) * len(bench.blocks)
        variants = {"compile budget": (off, fraction), "ours compiled": (modes, None)}
        compiled = CompiledGrain(bench, grain)
        plan = apply_policy(bench.module, "none")
        peaks: Dict[str, int] = {}
        try:
            compiled.use(plan, modes, None)
            with torch.compiler.set_stance("force_eager"):
                gc.collect()
                ours_eager = allocation_peaks(bench.fwd_bwd, params)[1]
            for label, setting in variants.items():
                peaks[label] = compiled.peak(plan, *setting)
            if peaks["compile budget"] > allocator_budget:  # a user would lower the fraction until it fits
                for lowered in (fraction * 0.75, fraction * 0.5, fraction * 0.25, 0.0):
                    peaks["compile budget, lowered"] = compiled.peak(plan, off, lowered)
                    if peaks["compile budget, lowered"] <= allocator_budget:
                        variants["compile budget, lowered"] = (off, lowered)
                        break
            times: Dict[str, List[float]] = {label: [] for label in variants}
            labels = list(variants)
            for r in range(args.rounds):
                for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                    compiled.use(plan, *variants[label])
                    times[label].append(bench.seconds())
        finally:
            compiled.close()
        ours_fits, same_fits = (peaks[v] <= allocator_budget for v in ("ours compiled", "compile budget"))
        fitting = "compile budget" if same_fits else "compile budget, lowered" if len(variants) > 2 else None
        row = dict(grain=grain, budget=budget, allocator_budget=allocator_budget, compiled_ends=ends,
                   eager_ends=eager_ends, fraction=fraction,
                   ours_fits=ours_fits, compile_fits=same_fits, compile_peak=peaks["compile budget"],
                   ours_eager_peak=ours_eager, ours_memtracker_peak=ours[budget][1],
                   ours_peak=peaks["ours compiled"], modes=list(modes), block_seconds=calibration.block_seconds,
                   **_timing("ours", times["ours compiled"]), **_timing("compile", times["compile budget"]))
        row["same_fraction_ratio"] = T.paired(times["ours compiled"], times["compile budget"])
        if fitting == "compile budget, lowered":
            row.update(lowered_fraction=variants[fitting][1], lowered_peak=peaks[fitting],
                       **_timing("lowered", times[fitting]))
        row["ratio"] = T.paired(times["ours compiled"], times[fitting]) if fitting else None
        row["verdict"] = ("MISS (over budget)" if not ours_fits else "PASS (no compiler fraction fits)"
                          if fitting is None else _verdict(row["ratio"][0]))
        rows.append(row)
    return rows


def _timing(name: str, seconds: List[float]) -> Dict[str, Any]:
    return {f"{name}_s": statistics.median(seconds), f"{name}_range": [min(seconds), max(seconds)]}


def _verdict(ratio: float) -> str:
    return "PASS" if ratio <= 1.0 else "TIE" if ratio <= TIE else "MISS"



def compiled_case(model_name: str, precision: str, args) -> Dict[str, Any]:
    """The compiled rows of one model and precision: budgets at ``args.positions`` between ``all``'s and ``none``'s
    MemTracker activation peak (eager), each grain of ``args.compile``."""
    torch.manual_seed(0)
    module, seq = build(model_name, args.small)
    bench = Bench(module, seq, args.micro_batch, precision)
    ends = []
    for spec in ("all", "none"):
        apply_policy(bench.module, spec)
        ends.append(bench.peak())
        remove_checkpointing(bench.module)
    low, high = ends
    budgets = [round(low + (high - low) * pos) for pos in args.positions]
    eager_ends = eager_allocator_ends(bench)
    rows: List[Dict[str, Any]] = []
    for grain in args.compile:
        with torch._dynamo.config.patch(recompile_limit=64):  # each variant and lowered fraction is a graph
            rows.extend(compiled_rows(bench, budgets, (low, high), eager_ends, args, grain))
    return dict(model=model_name, precision=precision, blocks=len(bench.blocks), seq_len=seq,
                micro_batch=args.micro_batch, rounds=args.rounds, compiled_budgets=budgets,
                memtracker_ends={"all": low, "none": high}, compiled=rows)


def print_compiled(result: Dict[str, Any]) -> None:
    print(f"\n{result['model']} {result['precision']}: {result['blocks']} blocks, micro-batch "
          f"{result['micro_batch']} x {result['seq_len']}, {result['rounds']} interleaved rounds")
    for grain in GRAINS:
        rows = [r for r in result.get("compiled", []) if r["grain"] == grain]
        if not rows:
            continue
        print(f"\ncompiled ({GRAIN_TITLES[grain]}): our "
              "plan vs the compiler's memory budget at fraction = budget / none's peak ('same'), lowered until it "
              "fits when it does not ('lowered'); peaks by the CPU allocator, MiB ('allocator': the budget in its "
              "units); ratio: ours over the fitting compiler plan, paired per round")
        seconds = "; ".join(f"{cls} " + ", ".join(f"{m} +{t * 1e3:.2f} ms" for m, t in modes.items())
                            for cls, modes in rows[0]["block_seconds"].items())
        ce, ee = rows[0]["compiled_ends"], rows[0]["eager_ends"]
        print(f"allocator budgets spaced between eager all {ee['all'] / MiB:.2f} and none {ee['none'] / MiB:.2f} "
              f"MiB (compiled at this grain: all {ce['all'] / MiB:.2f}, none {ce['none'] / MiB:.2f})")
        print(f"our calibration's compiled block times (forward + backward of one block, over off): {seconds}")
        print(f"{'budget':>7} {'allocator':>9} {'same':>5} {'peak':>7} {'ms':>6} {'lowered':>7} {'peak':>7} {'ms':>6}  "
              f"{'our plan':<44}{'peak':>7} {'ms':>6}{'ratio':>7} {'(paired range)':<15} verdict")
        for r in rows:
            mix = mode_mix(r["modes"])
            lowered = (f"{r['lowered_fraction']:>7.2f} {r['lowered_peak'] / MiB:>7.2f} {r['lowered_s'] * 1e3:>6.0f}"
                       if "lowered_fraction" in r else f"{'-':>7} {'':>7} {'':>6}")
            ratio = (f"{r['ratio'][0]:>7.3f} ({r['ratio'][1]:.3f}-{r['ratio'][2]:.3f})" if r["ratio"]
                     else f"{'-':>7} {'':<15}")
            print(f"{r['budget'] / MiB:>7.2f} {r['allocator_budget'] / MiB:>9.2f} {r['fraction']:>5.2f} "
                  f"{r['compile_peak'] / MiB:>7.2f} {r['compile_s'] * 1e3:>6.0f} {lowered}  {mix:<44}"
                  f"{r['ours_peak'] / MiB:>7.2f} {r['ours_s'] * 1e3:>6.0f}{ratio}  {r['verdict']}")



def _grains(text: str) -> List[str]:
    grains = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in grains if g not in GRAINS]
    if bad:
        raise argparse.ArgumentTypeError(f"--compile {text!r}: unknown grain {bad}; choose among {list(GRAINS)}, "
                                         "e.g. --compile model,block")
    return grains


def parse_budgets(args: argparse.Namespace) -> None:
    if args.budgets is not None:
        if args.budgets < 2:
            raise SystemExit(f"--budgets {args.budgets}: give at least 2 (they include all's and none's figures).")
        args.positions = [i / (args.budgets - 1) for i in range(args.budgets)]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--precisions", default="32-true", help="comma-separated, e.g. 32-true,bf16-mixed (bf16 "
                                                                 "autocast on a CPU without bf16 units is ~18x slower)")
    parser.add_argument("--positions", type=B.parse_positions, default=[0.25, 0.5, 0.75],
                        help="budgets as fractions of the way from all to none (default 0.25,0.5,0.75)")
    parser.add_argument("--budgets", type=int, default=None, help="N budgets evenly from all to none, both included "
                                                                  "(instead of --positions)")
    parser.add_argument("--compile", nargs="?", const="model,block", default="", type=_grains,
                        help="instead of the eager rows: torch.compile's memory budget against our plan compiled, for "
                             "the whole model and/or block by block (default, bare: model,block)")
    parser.add_argument("--small", action="store_true", help="--compile: the 4 x 128 models (else 8 x 256)")
    parser.add_argument("--json", default=None, help="write every figure here")
    B.add_size_arguments(parser)
    args = parser.parse_args(argv)
    parse_budgets(args)
    B.resolve_sizes(args)
    args.small = args.small or args.quick
    T.quiet()
    print("\n".join(header_lines([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])))
    print(f"load average at start: {load_average()}")
    results = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        for precision in [p.strip() for p in args.precisions.split(",") if p.strip()]:
            if args.compile:
                result = compiled_case(model_name, precision, args)
                print_compiled(result)
            else:
                result = eager_case(model_name, precision, args)
                print_eager(result)
            results.append(result)
    if args.compile:
        compiled = [r["verdict"] for res in results for r in res["compiled"]]
        print(f"\ncompiled: {sum(v.startswith(('PASS', 'TIE')) for v in compiled)}/{len(compiled)} budgets PASS or "
              f"TIE; {sum(v.startswith('MISS') for v in compiled)} MISS")
    else:
        rows = [r for res in results for r in res["rows"]]
        verdicts = [r["verdict"] for r in rows]
        same = sum(r["verdict"].startswith("MISS") and r.get("same_plan", False) for r in rows)
        print(f"\nsummary: {sum(v.startswith('PASS') for v in verdicts)}/{len(verdicts)} budgets PASS (ours <= "
              f"{B.TARGET:.2f} x the fastest fitting anchor); {sum(v.startswith('MISS') for v in verdicts)} MISS "
              f"({same} of them our plan is the anchor's own plan); every step within the budget: "
              f"{all((r['report'].get('worst_step_ratio') or 0) <= 1.0 for r in rows)}")
    print(f"load average at end: {load_average()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
