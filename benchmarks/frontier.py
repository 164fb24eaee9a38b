"""Issue 14: our per-block budget plan against the anchors' fixed modes, at 8 budgets, side by side in one process.

For each model (the benchmark GPT at a CPU size, a Hugging Face Llama built from its config) and precision
(float32, bf16 autocast):

1. Measure ``none`` and ``all`` (PyTorch's MemTracker, the running peak of its ACT line: not our meter) and put
   ``--budgets`` budgets evenly between the two activation peaks.
2. Our plan at each budget: the plugin calibrates (:class:`lightning_ckpt.decide.budget.BudgetCalibration`),
   :func:`lightning_ckpt.decide.budget.plan_budget` chooses the per-block mix, and the plan is applied with
   ``CheckpointPlan.set_modes``.
3. The anchors, implemented here from their public descriptions with plain ``torch.utils.checkpoint`` (not the
   plugin):

   - torchtitan ``full``: every block under non-reentrant checkpoint;
   - torchtitan op-level selective: every block under selective checkpointing whose policy saves the outputs of
     ``mm`` and the attention kernels, except every second ``mm`` (torchtitan's ``_op_sac_save_list`` policy);
   - Megatron ``selective``: only the attention core (the SDPA / softmax / dropout / batched matmuls) recomputed;
   - Megatron ``full`` ``block`` over N layers: the first N blocks checkpointed, N = 1 … L-1;
   - Hugging Face ``every_n_layers`` (n = 2, 3): blocks 0, n, 2n, … checkpointed;
   - ``none``.
4. Every configuration's activation peak is measured by MemTracker, and its step (forward, backward, optimizer)
   is timed in interleaved rounds (one untimed round first; medians and ranges reported). The fastest fitting
   anchor is the one with the lowest median; the ratio is the median over rounds of our time over that anchor's
   time in the same round (paired, so a slow drift of this shared machine cancels; its range is reported).

Targets per budget: our plan's measured peak ≤ budget (fits), and its step time ≤ 1.00× the fastest anchor that
fits (≤ 1.02× reads as a tie on this noisy machine). ``--compile [model,block,split]`` adds, per budget, the
compiler's activation memory budget at the same fraction of ``none``'s peak against our plan compiled, for the whole
model compiled, for blocks compiled one by one, and (``split``) for the user's whole-model compile, which the
compiler's budget runs as one graph and our plan, with ``compile_blocks=True``, as one graph per block (memory
there: the CPU allocator's activation peak, which sees inside a compiled graph; see :func:`compiled_rows`).

Usage::

    python benchmarks/frontier.py                    # both models, float32 and bf16 autocast, 8 budgets
    python benchmarks/frontier.py --quick            # small models, 4 budgets, 2 rounds (smoke)
    python benchmarks/frontier.py --models gpt --precisions 32-true --compile           # model and block grain
    python benchmarks/frontier.py --small --models gpt --precisions 32-true --compile block
    python benchmarks/frontier.py --small --models gpt --precisions bf16-mixed --compile split  # compile_blocks
    python benchmarks/frontier.py --small --precisions bf16-mixed --rounds 3   # bf16 autocast at a CPU size
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import allocation_peaks, header_lines, measure_memory  # noqa: E402

from lightning_ckpt.core.blocks import find_blocks  # noqa: E402
from lightning_ckpt.core.units import MiB  # noqa: E402
from lightning_ckpt.core.wrap import apply_policy, remove_checkpointing  # noqa: E402
from lightning_ckpt.decide.budget import COMPILER_FRACTIONS, BudgetCalibration, mode_mix, plan_budget  # noqa: E402
from lightning_ckpt.forecast.load import lightning_step, make_optimizers, step_loss  # noqa: E402
from lightning_ckpt.forecast.precision import parse_precision  # noqa: E402
from lightning_ckpt.measure.meter import StepMeter  # noqa: E402

aten = torch.ops.aten
TIE = 1.02


def build(name: str, quick: bool):
    from lightning_ckpt.demos import GPTLightningModule, HFCausalLMModule

    layers, width, seq = (4, 128, 128) if quick else (8, 256, 256)
    if name == "gpt":
        return GPTLightningModule(n_layer=layers, n_embd=width, n_head=8, block_size=seq, dropout=0.0), seq
    return HFCausalLMModule(arch="llama", n_layer=layers, n_embd=width, n_head=8, n_positions=seq,
                            vocab_size=512), seq


# ------------------------------------------------------------------------------------------ the anchors


def _titan_op_sac_policy():
    """torchtitan's op-level SAC: save compute-heavy ops' outputs, but recompute every second mm."""
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        save.add(aten._scaled_dot_product_flash_attention_for_cpu.default)  # the CPU's flash kernel
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        save.add(aten._scaled_dot_product_cudnn_attention.default)

    def context_fn():
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == aten.mm.default:
                counts[mode] += 1
            to_save = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


class MegatronSelective:
    """Megatron's ``selective`` recompute: only the core attention is checkpointed (its inputs q, k, v kept, its
    softmax / dropout / matmuls recomputed), the rest of the block runs with plain autograd. The core attention of
    both models is ``F.scaled_dot_product_attention``, wrapped here for as long as the configuration runs."""

    def __init__(self) -> None:
        import torch.nn.functional as F

        self._functional, self._original = F, F.scaled_dot_product_attention

        def core_attention(*args, **kwargs):
            if not torch.is_grad_enabled():
                return self._original(*args, **kwargs)
            return checkpoint(self._original, *args, use_reentrant=False, **kwargs)

        F.scaled_dot_product_attention = core_attention

    def remove(self) -> None:
        self._functional.scaled_dot_product_attention = self._original


def anchor_wrappers(num_blocks: int) -> Dict[str, Tuple[List[bool], Optional[Callable]]]:
    """Anchor name → (which blocks are checkpointed, the ``context_fn`` — ``None`` for full recompute — or, for
    Megatron selective, the class that wraps the core attention)."""
    out: Dict[str, Tuple[List[bool], Optional[Callable]]] = {
        "none": ([False] * num_blocks, None),
        "torchtitan full": ([True] * num_blocks, None),
        "torchtitan op-SAC": ([True] * num_blocks, _titan_op_sac_policy()),
        "Megatron selective": ([False] * num_blocks, MegatronSelective),
    }
    for n in range(1, num_blocks):
        out[f"Megatron block {n}"] = ([i < n for i in range(num_blocks)], None)
    for n in (2, 3):
        out[f"HF every_n_layers={n}"] = ([i % n == 0 for i in range(num_blocks)], None)
    return out


def same_plan(modes: Sequence[str], anchor: Tuple[List[bool], Optional[Callable]]) -> bool:
    """Our plan runs the anchor's computation: the same blocks fully recomputed, the others off. Between the two,
    a ratio off 1.00 is the machine's noise (or the wrappers' overhead), not a better or a worse plan."""
    mask, context_fn = anchor
    return context_fn is None and list(modes) == ["recompute" if m else "off" for m in mask]


class AnchorWrap:
    """Wrap the chosen blocks' forward in ``torch.utils.checkpoint`` (plain PyTorch); ``remove()`` restores them."""

    def __init__(self, blocks: Sequence[torch.nn.Module], mask: Sequence[bool], context_fn: Optional[Callable]):
        self.blocks = [b for b, m in zip(blocks, mask) if m]
        self.core = context_fn() if context_fn is MegatronSelective else None
        if self.core is not None:
            return
        kwargs = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        for block in self.blocks:
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), **kwargs)

    def remove(self) -> None:
        if self.core is not None:
            self.core.remove()
        for block in self.blocks:
            if self.core is None:
                del block.forward


# ------------------------------------------------------------------------------------------ measuring


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
    calibration = BudgetCalibration(plan, meter, budget=2**62, block_caller=block_caller,
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
        chosen = plan_budget(costs, budget, base, modes, measured=measured)
        plan = apply_policy(bench.module, "none")
        plan.set_modes(chosen.modes)
        peak = bench.peak() - savings(chosen.modes)
        for _ in range(3):
            if peak <= budget:
                break
            measured[chosen.modes] = peak
            chosen = plan_budget(costs, budget, base, modes, measured=measured)
            plan.set_modes(chosen.modes)
            peak = bench.peak() - savings(chosen.modes)
        remove_checkpointing(bench.module)
        ours[budget] = (chosen.modes, peak)
    return ours


def interleaved(configs: Dict[str, Tuple[Callable[[], None], Callable[[], None]]], bench: Bench, rounds: int
                ) -> Dict[str, List[float]]:
    """Time every configuration once per round (rotating order, one untimed round first)."""
    names = list(configs)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            install, remove = configs[name]
            install()
            try:
                seconds = bench.seconds()
            finally:
                remove()
            if r:
                times[name].append(seconds)
    return times


def run_case(model_name: str, precision: str, args) -> Dict[str, Any]:
    torch.manual_seed(0)
    module, seq = build(model_name, args.quick or args.small)
    bench = Bench(module, seq, args.micro_batch, precision)
    L = len(bench.blocks)
    plan, calibration, measured = our_costs(bench)
    costs, base = calibration.costs(), calibration.base
    remove_checkpointing(bench.module)

    anchors = anchor_wrappers(L)
    configs: Dict[str, Tuple[Callable[[], None], Callable[[], None]]] = {}
    peaks: Dict[str, int] = {}
    for name, (mask, context_fn) in anchors.items():
        holder: Dict[str, AnchorWrap] = {}

        def install(mask=mask, context_fn=context_fn, holder=holder):
            holder["w"] = AnchorWrap(bench.blocks, mask, context_fn)

        def remove(holder=holder):
            holder.pop("w").remove()

        configs[name] = (install, remove)
        install()
        try:
            peaks[name] = bench.peak()
        finally:
            remove()
    low, high = peaks["torchtitan full"], peaks["none"]
    budgets = [round(low + (high - low) * i / (args.budgets - 1)) for i in range(args.budgets)]

    ours = fit_plans(bench, budgets, costs, base, measured)
    for budget, (modes, peak) in ours.items():
        name = f"ours@{budget}"
        peaks[name] = peak

        def install(modes=modes):
            apply_policy(bench.module, "none").set_modes(modes)

        configs[name] = (install, lambda: remove_checkpointing(bench.module))
    times = interleaved(configs, bench, args.rounds)

    rows = []
    for budget in budgets:
        name = f"ours@{budget}"
        fitting = [a for a in anchors if peaks[a] <= budget]
        best = min(fitting, key=lambda a: statistics.median(times[a])) if fitting else None
        ours_s = statistics.median(times[name])
        best_s = statistics.median(times[best]) if best else None
        # paired: ours over the anchor within each round, then the median (a slow drift of the machine cancels)
        ratio, *ratio_range = _paired(times[name], times[best]) if best else (None,)
        fits = peaks[name] <= budget
        verdict = "MISS (over budget)" if not fits else "—" if ratio is None else _verdict(ratio)
        rows.append(dict(budget=budget, modes=list(ours[budget][0]), peak=peaks[name], fits=fits, step_s=ours_s,
                         same_plan=best is not None and same_plan(ours[budget][0], anchors[best]),
                         step_range=[min(times[name]), max(times[name])], best_anchor=best, best_anchor_s=best_s,
                         best_anchor_range=[min(times[best]), max(times[best])] if best else None, ratio=ratio,
                         ratio_range=ratio_range or None,
                         verdict=verdict))
    result = dict(model=model_name, precision=precision, blocks=L, seq_len=seq, micro_batch=args.micro_batch,
                  rounds=args.rounds, budgets=budgets, rows=rows,
                  anchors={a: dict(peak=peaks[a], step_s=statistics.median(times[a]),
                                   step_range=[min(times[a]), max(times[a])]) for a in anchors})
    eager_ends = eager_allocator_ends(bench) if args.compile else None
    for grain in args.compile:
        with torch._dynamo.config.patch(recompile_limit=64):  # each variant and lowered fraction is a graph
            result.setdefault("compiled", []).extend(
                compiled_rows(bench, budgets, peaks["none"], eager_ends, args, grain))
    return result


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


def compiled_rows(bench: Bench, budgets: Sequence[int], none_peak: int, eager_ends: Dict[str, int], args,
                  grain: str) -> List[Dict[str, Any]]:
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
        fractions = COMPILER_FRACTIONS if grain != "model" else ()
        _, calibration, measured = our_costs(bench, compiled.block_caller(), fractions)
    finally:
        compiled.close()
    ends = compiled_ends(bench, grain)
    modes = (*EAGER_MODES, "compiler") if grain != "model" else EAGER_MODES
    ours = fit_plans(bench, budgets, calibration.costs(), calibration.base, measured, modes,
                     calibration.compiled_savings)
    rows = []
    low, high = budgets[0], budgets[-1]
    for budget in budgets:
        fraction = min(max(budget / none_peak, 0.0), 1.0)
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
        row["same_fraction_ratio"] = _paired(times["ours compiled"], times["compile budget"])
        if fitting == "compile budget, lowered":
            row.update(lowered_fraction=variants[fitting][1], lowered_peak=peaks[fitting],
                       **_timing("lowered", times[fitting]))
        row["ratio"] = _paired(times["ours compiled"], times[fitting]) if fitting else None
        row["verdict"] = ("MISS (over budget)" if not ours_fits else "PASS (no compiler fraction fits)"
                          if fitting is None else _verdict(row["ratio"][0]))
        rows.append(row)
    return rows


def _timing(name: str, seconds: List[float]) -> Dict[str, Any]:
    return {f"{name}_s": statistics.median(seconds), f"{name}_range": [min(seconds), max(seconds)]}


def _paired(ours: List[float], theirs: List[float]) -> Tuple[float, float, float]:
    """Median over rounds of ours / theirs in the same round, and the range."""
    paired = [o / t for o, t in zip(ours, theirs)]
    return statistics.median(paired), min(paired), max(paired)


def _verdict(ratio: float) -> str:
    return "PASS" if ratio <= 1.0 else "TIE" if ratio <= TIE else "MISS"


def print_case(result: Dict[str, Any]) -> None:
    print(f"\n{result['model']} {result['precision']}: {result['blocks']} blocks, micro-batch "
          f"{result['micro_batch']} × {result['seq_len']}, {result['rounds']} interleaved rounds (medians; ranges)")
    print(f"{'budget MiB':>10} {'our plan':<28}{'peak MiB':>9}{'fits':>5}{'ours ms':>9} {'range':>13}  "
          f"{'fastest fitting anchor':<24}{'ms':>8} {'range':>13}{'ratio':>7} {'(paired range)':<15} verdict")
    for r in result["rows"]:
        mix = mode_mix(r["modes"])
        rng = f"{r['step_range'][0] * 1e3:.0f}-{r['step_range'][1] * 1e3:.0f}"
        arng = (f"{r['best_anchor_range'][0] * 1e3:.0f}-{r['best_anchor_range'][1] * 1e3:.0f}"
                if r["best_anchor"] else "")
        prng = f"({r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f})" if r.get("ratio_range") else ""
        print(f"{r['budget'] / MiB:>10.2f} {mix:<28}{r['peak'] / MiB:>9.2f}{'yes' if r['fits'] else 'NO':>5}"
              f"{r['step_s'] * 1e3:>9.1f} {rng:>13}  {str(r['best_anchor']):<24}"
              f"{(r['best_anchor_s'] or 0) * 1e3:>8.1f} {arng:>13}{(r['ratio'] or 0):>7.3f} {prng:<15} {r['verdict']}"
              f"{' (the same plan)' if r.get('same_plan') else ''}")
    print("anchors: " + "; ".join(f"{a} {v['peak'] / MiB:.2f} MiB {v['step_s'] * 1e3:.0f} ms"
                                  for a, v in result["anchors"].items()))
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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--precisions", default="32-true,bf16-mixed")
    parser.add_argument("--budgets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--compile", nargs="?", const="model,block", default="", type=_grains,
                        help="also torch.compile's memory budget against our plan compiled, for the whole model "
                             "and/or block by block (default, bare: model,block)")
    parser.add_argument("--quick", action="store_true", help="small models, 4 budgets, 2 rounds")
    parser.add_argument("--small", action="store_true",
                        help="the small models (4 blocks × 128) at the given budgets and rounds: bf16 autocast on a "
                             "CPU without bf16 matrix units is ~18× slower than float32")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.quick:
        args.budgets, args.rounds = min(args.budgets, 4), min(args.rounds, 2)
    for line in header_lines():
        print(line)
    results = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        for precision in [p.strip() for p in args.precisions.split(",") if p.strip()]:
            result = run_case(model_name, precision, args)
            print_case(result)
            results.append(result)
    verdicts = [r["verdict"] for res in results for r in res["rows"]]
    compiled = [r["verdict"] for res in results for r in res.get("compiled", [])]
    if compiled:
        print(f"compiled: {sum(v.startswith(('PASS', 'TIE')) for v in compiled)}/{len(compiled)} budgets PASS or "
              f"TIE; {sum(v.startswith('MISS') for v in compiled)} MISS")
    same = sum(r["verdict"].startswith("MISS") and r.get("same_plan", False) for res in results for r in res["rows"])
    print(f"\nsummary: {sum(v in ('PASS', 'TIE') for v in verdicts)}/{len(verdicts)} budgets PASS or TIE; "
          f"{sum(v.startswith('MISS') for v in verdicts)} MISS ({same} of them our plan is the anchor's own plan, "
          "the same computation); fits at every budget: "
          f"{all(r['fits'] for res in results for r in res['rows'])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
