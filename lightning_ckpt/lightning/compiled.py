"""How the blocks run under ``torch.compile``: all in one whole-model graph, or each block its own graph, and the
switch from the first to the second (``compile_blocks=True``).

Why the switch exists. One compiled graph around every block (``torch.compile(model)`` in ``configure_model``, or
``trainer.fit(torch.compile(model))``) has one backward graph for the whole model, and inductor's lowering of it
keeps buffers longer than eager autograd does: a checkpointed model holds 17-26 % more activation memory than
eager at the same plan on the CPU (docs/compile-precision.md), the plan's figures are verified on eager
reference steps and so read low, and PyTorch's activation memory budget is one fraction for the whole graph. A
graph break at each block boundary does not help: dynamo cannot resume after a break inside the model's loop over
its blocks and runs that whole frame eagerly. Compiling each block as its own graph (``block.compile()``, the
torchtitan / FSDP2 way) keeps eager's activation memory for ``all``, makes every activation figure true and lets the
budget choose the compiler's budget per block (``compiler:<f>``). ``compile_blocks=True`` does it for the user:
the whole-model compile's backend and options are reused, and its wrapper stays in place (so ``state_dict()`` keys
do not change) but calls the model uncompiled; the modules outside the blocks (embedding, head, loss) then run
eagerly.

CUDA graphs (:func:`cuda_graphs_in_use`): ``torch.compile(mode="reduce-overhead")`` (or ``"max-autotune"``,
``options={"triton.cudagraphs": True}``, ``backend="cudagraphs"``, inductor's global
``torch._inductor.config.triton.cudagraphs``) replays the compiled graphs with their tensors in private memory
pools that persist across steps, so the allocator's peaks count those pools and not the step's memory. The engine
then warns once (:data:`CUDA_GRAPHS_WARNING`) and the ledger leaves the allocator's lines out
(:mod:`lightning_ckpt.measure.ledger`). Found by reading the compile's backend and its options where each compile
is held: ``torch.compile`` wrappers in the module tree, ``block.compile()`` (the compiled call's context), and
Lightning's record of ``trainer.fit(torch.compile(model))``; a ``torch.compile``d function the model calls is not
seen.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ckpt.lightning import conflicts

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["CHECKPOINT_BREAK_WARNING", "CUDA_GRAPHS_WARNING", "blocks_in_one_compiled_graph",
           "checkpoint_graph_breaks", "compile_blocks_one_by_one", "compiled_block_caller", "cuda_graphs_in_use",
           "graph_breaks_so_far", "model_compiles", "room_for_plans", "warn_checkpoint_graph_breaks",
           "warn_cuda_graphs_once"]

CUDA_GRAPHS_WARNING = (
    "lightning_ckpt: to measure peak allocated/reserved memory, compile without CUDA graphs (mode='default' or "
    "'max-autotune-no-cudagraphs', or options={{'triton.cudagraphs': False}}): {note}, whose private memory pools "
    "hold the step's tensors across steps, so the allocator's lines (peaks, other, cache, per-phase peaks) are not "
    "this step's memory and are not logged; the report says so.")

CHECKPOINT_BREAK_WARNING = (
    "lightning_ckpt: to keep the checkpointed blocks compiled, pin the previous release of the library the blocks "
    "come from (e.g. transformers), leave these blocks out of checkpointing with blocks=..., or use policy='none' "
    "under torch.compile: dynamo broke the graph inside {count} checkpointed region(s) and ran them eagerly, so "
    "their recompute is not compiled. Dynamo's reason: {reasons}")

# words dynamo puts in a break's reason when it comes from a higher-order op such as torch.utils.checkpoint
_HOP_MARKERS = ("HOP", "Higher Order Operator", "higher order op", "torch.utils.checkpoint", "checkpoint")

# set on a whole-model wrapper whose graph compile_blocks_one_by_one replaced by per-block graphs
_UNROLLED = "_lightning_ckpt_blocks_compiled"


def _wrappers(pl_module: nn.Module) -> Iterator[nn.Module]:
    """The ``torch.compile`` wrappers in the module tree that still compile what they wrap."""
    for module in pl_module.modules():
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) and not module.__dict__.get(_UNROLLED):
            yield module


def _holds_blocks(wrapper: nn.Module, blocks: Sequence[nn.Module]) -> bool:
    ids = {id(b) for b in blocks}
    return sum(id(m) in ids for m in wrapper._orig_mod.modules()) > 1


def blocks_in_one_compiled_graph(pl_module: "pl.LightningModule", blocks: Sequence[nn.Module]) -> bool:
    """Whether two or more blocks run inside one ``torch.compile``d module: the whole model compiled (in
    ``configure_model``, or by ``trainer.fit(torch.compile(model))``, which Lightning records in ``_compiler_ctx``),
    not block by block (``block.compile()`` or one ``torch.compile`` per block)."""
    if getattr(pl_module, "_compiler_ctx", None):
        return True
    return any(_holds_blocks(w, blocks) for w in _wrappers(pl_module))


def compiled_block_caller(pl_module: "pl.LightningModule", blocks: Sequence[nn.Module]) -> Optional[Callable]:
    """How the budget's calibration runs one block as training runs it, when the blocks run compiled (``None``
    when they run eagerly): the block itself after ``block.compile()``, its ``torch.compile`` wrapper when the
    parent holds one, and, when the whole model is one compiled graph (where a block's code is only reachable
    inside that graph), the block alone compiled with the whole model's backend and options. ``None`` too when the
    model is sharded by FSDP: one block run alone would gather its parameters outside the root module's forward,
    which FSDP's state machine does not expect (those runs keep timing blocks inside the training step)."""
    if any(conflicts.is_fsdp_module(m) for m in pl_module.modules()):
        return None
    eval_frame = torch._dynamo.eval_frame
    wrappers = list(_wrappers(pl_module))
    by_block = {id(m._orig_mod): m for m in wrappers}
    if blocks_in_one_compiled_graph(pl_module, blocks):
        ctx = _whole_model_context(pl_module, blocks)
        return (lambda block: eval_frame.OptimizedModule(block, ctx)) if ctx is not None else torch.compile
    if any(id(b) in by_block for b in blocks):
        return lambda block: by_block.get(id(block), block)
    if any(getattr(b, "_compiled_call_impl", None) is not None for b in blocks):
        return lambda block: block
    return None


def _whole_model_context(pl_module: "pl.LightningModule", blocks: Sequence[nn.Module]):
    """The backend and options (a dynamo context) of the compile that holds the blocks in one graph, if any."""
    first = blocks[0] if blocks else None
    holders = [w.dynamo_ctx for w in _wrappers(pl_module) if any(b is first for b in w._orig_mod.modules())]
    return holders[0] if holders else (getattr(pl_module, "_compiler_ctx", None) or {}).get("dynamo_ctx")


def compile_blocks_one_by_one(pl_module: "pl.LightningModule", blocks: Sequence[nn.Module]) -> List[str]:
    """Give every block its own compiled graph, as ``block.compile()`` does; returns what was changed, for the log.

    A whole-model compile is turned into per-block graphs with the same backend and options: a wrapper held in the
    module tree keeps its place and its parameters' names but calls the model uncompiled, and
    ``trainer.fit(torch.compile(model))`` is undone with Lightning's ``to_uncompiled``. Blocks already compiled one
    by one are left as they are; without any compile the blocks get ``torch.compile``'s defaults. Idempotent.

    Raises:
        ValueError: the model is sharded by FSDP (its hooks would be traced inside each block's graph).
    """
    if any(conflicts.is_fsdp_module(m) for m in pl_module.modules()):
        raise ValueError(
            "compile_blocks=True on a model sharded by FSDP: a block compiled after fully_shard() runs FSDP's hooks "
            "inside its graph, which dynamo cannot trace (the block's body then runs eagerly). Leave "
            "compile_blocks=False and compile in configure_model yourself: each block wrapped before its fully_shard() "
            "(the torchtitan order: layers[i] = torch.compile(layer), then fully_shard(layers[i])), or "
            "torch.compile(model) after sharding.")
    done: List[str] = []
    ctx = _whole_model_context(pl_module, blocks) if blocks_in_one_compiled_graph(pl_module, blocks) else None
    if getattr(pl_module, "_compiler_ctx", None):
        from lightning.pytorch.utilities.compile import to_uncompiled

        to_uncompiled(pl_module)
        done.append("the LightningModule's whole-model compile (trainer.fit(torch.compile(model))) undone")
    for wrapper in [w for w in _wrappers(pl_module) if _holds_blocks(w, blocks)]:
        wrapper.forward = wrapper._orig_mod.__call__  # the wrapper stays (state_dict keys); its graph goes
        wrapper.__dict__[_UNROLLED] = True
        done.append(f"the whole-model graph of {type(wrapper._orig_mod).__name__} replaced (its modules outside the "
                    "blocks run eagerly)")
    own = {id(w._orig_mod) for w in _wrappers(pl_module)}
    compile_fn = ctx if ctx is not None else torch.compile
    fresh = [b for b in blocks if getattr(b, "_compiled_call_impl", None) is None and id(b) not in own]
    for block in fresh:
        block._compiled_call_impl = compile_fn(block._call_impl)  # what nn.Module.compile() does
    if fresh:
        how = "with the whole model's backend and options" if ctx is not None else "with torch.compile's defaults"
        done.append(f"{len(fresh)} of {len(blocks)} blocks compiled one by one {how}")
    return done


# ------------------------------------------------------------------------------------------------- CUDA graphs


def _contexts(pl_module: nn.Module) -> Iterator[tuple]:
    """``(where, dynamo context)`` of every compile held by the model (see the module docstring)."""
    ctx = (getattr(pl_module, "_compiler_ctx", None) or {}).get("dynamo_ctx")
    if ctx is not None:  # trainer.fit(torch.compile(model))
        yield type(pl_module).__name__, ctx
    context_type = getattr(torch._dynamo.eval_frame, "_TorchDynamoContext", None)
    for name, module in pl_module.named_modules():
        where = repr(name) if name else type(pl_module).__name__
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            yield where, module.dynamo_ctx
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None and context_type is not None:  # module.compile(): the context is in its closure
            for cell in getattr(compiled, "__closure__", None) or ():
                try:
                    held = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(held, context_type):
                    yield where, held


def _innermost_backend(ctx: Any) -> Any:
    """The backend a dynamo context compiles with, under dynamo's wrappers (``torch.compile``'s backend object)."""
    fn = getattr(ctx, "callback", None)
    for _ in range(16):  # the wrapper chain is a few links long; never loop on a cycle
        inner = getattr(fn, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        fn = inner
    return fn


def _global_inductor_cudagraphs() -> bool:
    config = sys.modules.get("torch._inductor.config")  # not imported: nobody set it
    return bool(getattr(getattr(config, "triton", None), "cudagraphs", False))


def _how_cuda_graphs(backend: Any) -> Optional[str]:
    if getattr(backend, "compiler_name", None) == "cudagraphs":
        return "backend='cudagraphs'"
    inductor = type(backend).__name__ == "_TorchCompileInductorWrapper" or \
        getattr(backend, "compiler_name", None) == "inductor" or getattr(backend, "__name__", None) == "compile_fx"
    if not inductor:
        return None
    options = getattr(backend, "config", None) or {}
    if "triton.cudagraphs" in options:  # the compile's mode or options override inductor's global config
        return "options {'triton.cudagraphs': True} (mode='reduce-overhead' or 'max-autotune')" \
            if options["triton.cudagraphs"] else None
    return "torch._inductor.config.triton.cudagraphs = True" if _global_inductor_cudagraphs() else None


def cuda_graphs_in_use(pl_module: nn.Module) -> Optional[str]:
    """Where and how the model's compiled code runs CUDA graphs (for :data:`CUDA_GRAPHS_WARNING` and the ledger's
    note), or ``None`` when it does not; reads the compiles' settings only (nothing is compiled or run)."""
    found = []
    for where, ctx in _contexts(pl_module):
        how = _how_cuda_graphs(_innermost_backend(ctx))
        if how is not None and (where, how) not in found:
            found.append((where, how))
    if not found:
        return None
    return "; ".join(f"{where} is compiled with CUDA graphs ({how})" for where, how in found)


_WARNED: set = set()


def warn_cuda_graphs_once(note: str) -> None:
    """:data:`CUDA_GRAPHS_WARNING` for ``note``, once per process (a second ``fit`` of the same model is quiet)."""
    if note in _WARNED:
        return
    _WARNED.add(note)
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(CUDA_GRAPHS_WARNING.format(note=note), category=RuntimeWarning)


def room_for_plans(modes: int) -> Optional[Tuple[str, Callable[[], None]]]:
    """Make room in dynamo's cache for blocks compiled one by one whose plan changes with the batch's shape.

    Dynamo compiles a block's call once per mode the plan gives it (it guards on the mode) and, when the lengths
    vary, once more per mode with the lengths dynamic (its automatic dynamic shapes): ``2 × modes`` graphs per block
    class. Past ``torch._dynamo.config.recompile_limit`` (8 by default) it stops compiling that block and runs it
    eagerly, silently slower. The limit is raised to ``2 × modes + 1`` when it is lower; returns what changed (for
    the log) and the call that puts the user's limit back (at the end of the run), ``None`` when nothing changed.
    """
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    current, needed = getattr(config, name), 2 * modes + 1
    if current >= needed:
        return None
    setattr(config, name, needed)
    return (f"torch._dynamo.config.{name} raised from {current} to {needed} for this run: blocks compiled one by one "
            f"take one graph per mode ({modes}) and per static and dynamic lengths",
            lambda: setattr(config, name, current))


# ------------------------------------------------------------------------------------------ graph breaks


def graph_breaks_so_far() -> Dict[str, int]:
    """Dynamo's graph-break counts by reason until now (process-wide), to tell a fit's own breaks from earlier ones."""
    return dict(torch._dynamo.utils.counters["graph_break"])


def checkpoint_graph_breaks(before: Dict[str, int]) -> List[str]:
    """The reasons of the graph breaks dynamo counted since ``before`` that come from a checkpointed region.

    Dynamo names a higher-order op in the reason when the op's body fails to trace (transformers 5.25's "HOP: Unsafe
    side effect ..."); those are taken when present. Some failures inside the body (a ``torch.compiler.disable``d
    call) carry the inner reason only; with no reason naming a higher-order op, every new break is taken, since the
    caller asks only when blocks run checkpointed under compile.
    """
    new = [r for r, n in torch._dynamo.utils.counters["graph_break"].items() if n > before.get(r, 0)]
    named = [r for r in new if any(m in r for m in _HOP_MARKERS)]
    return named or new


_WARNED_BREAKS: set = set()


def model_compiles(pl_module: nn.Module) -> bool:
    """Whether any part of the model runs under ``torch.compile`` (the whole module or some of its submodules)."""
    return any(True for _ in _contexts(pl_module))


def warn_checkpoint_graph_breaks(pl_module: nn.Module, num_checkpointed: int, before: Dict[str, int]) -> Dict[str, int]:
    """After a training step: :data:`CHECKPOINT_BREAK_WARNING` (rank zero, once per reason per process) when blocks
    run checkpointed under ``torch.compile`` and dynamo broke the graph inside them since ``before``, which would
    otherwise fall back to eager silently. The first step that compiles is not always the first step (an eager
    reference step may come first), so the engine asks after every step: reading the counts copies a dict of a few keys.
    Returns the counts now, the ``before`` of the next call.

    Known limit: a break the model also has without checkpointing, whose reason does not name a higher-order op, is
    reported too when it is new in this fit; ``policy='none'`` tells the two apart.
    """
    reasons = [r for r in checkpoint_graph_breaks(before) if r not in _WARNED_BREAKS]
    now = graph_breaks_so_far()
    if not reasons or num_checkpointed <= 0 or not model_compiles(pl_module):
        return now
    _WARNED_BREAKS.update(reasons)
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    shown = " | ".join(r.split("\n")[0].strip() + (f" ({_explanation(r)})" if _explanation(r) else "") for r in reasons)
    rank_zero_warn(CHECKPOINT_BREAK_WARNING.format(count=len(reasons), reasons=shown), category=RuntimeWarning)
    return now


def _explanation(reason: str) -> str:
    """The ``Explanation:`` line of dynamo's multi-line reason, if any (it names the function or object at fault)."""
    for line in reason.splitlines()[1:]:
        if line.strip().startswith("Explanation:"):
            return line.strip()[len("Explanation:"):].strip()
    return ""
