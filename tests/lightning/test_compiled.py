"""How the blocks run under ``torch.compile`` (:mod:`lightning_ckpt.lightning.compiled`): one whole-model graph told
apart from one graph per block, the block caller the budget times with, and ``compile_blocks=True`` turning a
whole-model compile into per-block graphs (same backend, same ``state_dict()`` keys, the budget's compiler modes
allowed)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _lightning_models import CompiledGPT, GraphCount, trainer_kwargs
from _torch_features import needs_compiler_budget
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing, apply_policy
from lightning_ckpt.core.blocks import find_blocks
from lightning_ckpt.demos import GPTLightningModule
from lightning_ckpt.lightning.compiled import (
    blocks_in_one_compiled_graph,
    compile_blocks_one_by_one,
    compiled_block_caller,
    cuda_graphs_in_use,
)

T = 32


def _model(counter=None):
    seed_everything(0)
    kwargs = dict(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0)
    return CompiledGPT(counter, **kwargs) if counter is not None else GPTLightningModule(**kwargs)


def _step(model):
    batch = model.example_batch(2, T)
    loss = model.compute_loss(batch)
    loss.backward()
    return loss.detach()


def test_whole_model_compile_is_told_apart_from_block_by_block():

    model = _model()
    blocks = [b for _, b in find_blocks(model)]
    assert len(blocks) == 2 and not blocks_in_one_compiled_graph(model, blocks)
    for block in blocks:  # the torchtitan / FSDP2 way: each block its own graph
        block.compile(backend="eager")
    assert not blocks_in_one_compiled_graph(model, blocks)
    inner = model.model
    model.model = torch.compile(inner, backend="eager")  # in configure_model: one graph around every block
    assert blocks_in_one_compiled_graph(model, blocks)
    model.model = inner
    model._compiler_ctx = {"compiler": "dynamo"}  # trainer.fit(torch.compile(model)): Lightning's record of it
    assert blocks_in_one_compiled_graph(model, blocks)


def test_the_budget_times_blocks_the_way_they_run():
    """The calibration's block caller: none when the blocks run eagerly, the block itself after ``block.compile()``,
    the wrapper a parent holds after ``torch.compile(block)``, and the block alone compiled with the whole model's
    own backend and options when the whole model is one graph."""

    model = _model()
    blocks = [b for _, b in find_blocks(model)]
    assert compiled_block_caller(model, blocks) is None
    for block in blocks:
        block.compile(backend="eager")
    assert compiled_block_caller(model, blocks)(blocks[1]) is blocks[1]
    for block in blocks:
        block._compiled_call_impl = None
    held = model.model.transformer.h
    wrappers = [torch.compile(block, backend="eager") for block in blocks]
    for i, wrapper in enumerate(wrappers):
        held[i] = wrapper
    assert compiled_block_caller(model, blocks)(blocks[1]) is wrappers[1]
    for i, block in enumerate(blocks):
        held[i] = block
    counter = GraphCount()
    whole = torch.compile(model.model, backend=counter.backend)
    model.model = whole
    caller = compiled_block_caller(model, blocks)(blocks[0])
    assert isinstance(caller, torch._dynamo.eval_frame.OptimizedModule) and caller._orig_mod is blocks[0]
    assert caller.dynamo_ctx is whole.dynamo_ctx  # the user's backend and options, not a default compile


def test_sharded_blocks_keep_timing_inside_the_step(monkeypatch):
    """Under FSDP one block run alone would gather its parameters outside the root's forward: no block caller,
    the calibration times blocks inside its training steps (eagerly) as without compile."""
    from lightning_ckpt.lightning import conflicts

    model = _model()
    blocks = [b for _, b in find_blocks(model)]
    for block in blocks:
        block.compile(backend="eager")
    assert compiled_block_caller(model, blocks) is not None
    monkeypatch.setattr(conflicts, "is_fsdp_module", lambda module: module is blocks[0])
    assert compiled_block_caller(model, blocks) is None


def test_compile_blocks_turns_a_whole_model_graph_into_one_graph_per_block():
    counter = GraphCount()
    model = _model(counter)
    model.configure_model()  # torch.compile(model.model, backend=counter.backend), as the user wrote it
    blocks = [b for _, b in find_blocks(model)]
    keys = list(model.state_dict())
    reference = _model()
    apply_policy(reference, "all")
    apply_policy(model, "all")
    assert blocks_in_one_compiled_graph(model, blocks)

    changes = compile_blocks_one_by_one(model, blocks)

    assert any("whole-model graph of GPT replaced" in c for c in changes), changes
    assert any("2 of 2 blocks compiled one by one with the whole model's backend" in c for c in changes), changes
    assert not blocks_in_one_compiled_graph(model, blocks)
    assert list(model.state_dict()) == keys  # the wrapper stays: checkpoints keep their keys
    assert compiled_block_caller(model, blocks)(blocks[0]) is blocks[0]
    loss, expected = _step(model), _step(reference)
    # one graph for the block class (both blocks share it), none for the whole model: the user's backend compiled it
    assert counter.graphs == 1, counter.graphs
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert compile_blocks_one_by_one(model, blocks) == []  # idempotent: fit twice compiles nothing twice


def test_compile_blocks_undoes_trainer_fit_of_a_compiled_lightning_module_and_compiles_plain_blocks():
    from lightning.pytorch.utilities.compile import from_compiled

    counter = GraphCount()
    model = from_compiled(torch.compile(_model(), backend=counter.backend))  # what trainer.fit(compiled) does
    blocks = [b for _, b in find_blocks(model)]
    assert blocks_in_one_compiled_graph(model, blocks)
    changes = compile_blocks_one_by_one(model, blocks)
    assert model._compiler_ctx is None and not blocks_in_one_compiled_graph(model, blocks), changes
    _step(model)
    assert counter.graphs == 1, counter.graphs  # the block class's graph, with the user's backend

    plain = _model()
    blocks = [b for _, b in find_blocks(plain)]
    assert compile_blocks_one_by_one(plain, blocks) == ["2 of 2 blocks compiled one by one with torch.compile's "
                                                        "defaults"]
    assert all(b._compiled_call_impl is not None for b in blocks)


def _fit(tmp_path, model, cb, steps=2, accumulate=1, **overrides):
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1,
                                                       limit_val_batches=0, num_sanity_val_steps=0,
                                                       accumulate_grad_batches=accumulate, **overrides))
    batches = [model.example_batch(2, T)] * (steps * accumulate)
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    return trainer


@needs_compiler_budget
def test_compiler_modes_in_a_whole_model_graph_are_refused_naming_compile_blocks_as_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"whole model is one compiled graph.*compile_blocks=True"):
        _fit(tmp_path, _model(GraphCount()), ActivationCheckpointing(policy="modes:off,compiler:0.5"))


@pytest.mark.slow
@needs_compiler_budget
@pytest.mark.parametrize("precision, accumulate", [("32-true", 1), ("bf16-mixed", 2)])
def test_compile_blocks_lets_a_whole_model_compile_use_the_compilers_budget_per_block(tmp_path, precision,
                                                                                      accumulate):
    """Without the flag the compiler's per-block budget is refused in a whole-model graph (above); with it the same
    model trains, each block in its own graph under its budget, and the activation line is logged."""
    counter = GraphCount()
    model = _model(counter)
    cb = ActivationCheckpointing(policy="modes:off,compiler:0.5", compile_blocks=True)
    _fit(tmp_path, model, cb, steps=3, accumulate=accumulate, precision=precision)
    assert tuple(cb.plan.modes) == ("off", "compiler:0.5")
    assert not blocks_in_one_compiled_graph(model, cb.plan.blocks)
    assert 1 <= counter.graphs <= 2, counter.graphs  # one per block mode: off and compiler:0.5, no whole graph
    assert cb.last_metrics["memory/activations_gib"] > 0


def test_compile_blocks_is_refused_on_a_model_sharded_by_fsdp(monkeypatch):
    from lightning_ckpt.lightning import conflicts

    model = _model()
    blocks = [b for _, b in find_blocks(model)]
    monkeypatch.setattr(conflicts, "is_fsdp_module", lambda module: module is blocks[0])
    with pytest.raises(ValueError, match=r"compile_blocks=True on a model sharded by FSDP.*fully_shard"):
        compile_blocks_one_by_one(model, blocks)
    assert all(b._compiled_call_impl is None for b in blocks)


# ------------------------------------------------------------------------------------------------ CUDA graphs


@pytest.mark.parametrize(("how", "named"), [
    ("whole model, mode='reduce-overhead'", "triton.cudagraphs"),
    ("blocks one by one, mode='max-autotune'", "triton.cudagraphs"),
    ("blocks one by one, options", "triton.cudagraphs"),
    ("whole model, backend='cudagraphs'", "backend='cudagraphs'"),
    ("trainer.fit(torch.compile(model, mode='reduce-overhead'))", "triton.cudagraphs"),
    ("inductor's global config", "torch._inductor.config.triton.cudagraphs"),
])
def test_cuda_graphs_are_found_wherever_the_model_is_compiled(how, named):
    """CUDA graphs keep a step's tensors in the graphs' private memory pools, so the allocator's peaks stop meaning
    the step's: every way a Lightning model is compiled with them is found (nothing is compiled or run here)."""
    from lightning.pytorch.utilities.compile import from_compiled

    model = _model()
    blocks = [b for _, b in find_blocks(model)]
    assert cuda_graphs_in_use(model) is None
    if how.startswith("whole model, mode"):
        model.model = torch.compile(model.model, mode="reduce-overhead")
    elif how.startswith("blocks one by one, mode"):
        for block in blocks:
            block.compile(mode="max-autotune")
    elif how == "blocks one by one, options":
        blocks[1].compile(options={"triton.cudagraphs": True})
    elif how.startswith("whole model, backend"):
        model.model = torch.compile(model.model, backend="cudagraphs")
    elif how.startswith("trainer.fit"):
        model = from_compiled(torch.compile(model, mode="reduce-overhead"))
    else:
        for block in blocks:
            block.compile()
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"triton.cudagraphs": how == "inductor's global config"}):
        note = cuda_graphs_in_use(model)
    assert note is not None and named in note, note


@pytest.mark.parametrize("kwargs", [dict(), dict(mode="max-autotune-no-cudagraphs"), dict(backend="aot_eager"),
                                    dict(options={"triton.cudagraphs": False})])
def test_compiles_without_cuda_graphs_are_not_flagged(kwargs):
    model = _model()
    blocks = [b for _, b in find_blocks(model)]
    model.model = torch.compile(model.model, **kwargs)
    for block in blocks:
        block.compile(**kwargs)
    assert cuda_graphs_in_use(model) is None
    if "options" in kwargs:  # an explicit False in the compile's options wins over inductor's global default
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"triton.cudagraphs": True}):
            assert cuda_graphs_in_use(model) is None


@torch._dynamo.disable
def _outside_the_compiler(x):  # dynamo cannot trace it, even with side effects allowed: a break in the block
    return x * 1.0


class _Untraceable(torch.nn.Module):
    def forward(self, x):
        return _outside_the_compiler(x)


def _fit_with_a_break_in_each_block(tmp_path, policy, **cb_kwargs):
    model = _model()
    for block in model.model.transformer.h:
        block.mlp.dropout = _Untraceable()
    model.model = torch.compile(model.model, backend="aot_eager")
    cb = ActivationCheckpointing(policy=policy, **cb_kwargs)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=2, limit_val_batches=0,
                                                       num_sanity_val_steps=0))
    loader = DataLoader([model.example_batch(2, T)] * 2, batch_size=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader)
    return [str(w.message) for w in caught if "dynamo broke the graph inside" in str(w.message)]


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_a_graph_break_inside_checkpointed_blocks_is_named_once(tmp_path, compile_blocks):
    """A break dynamo takes inside a checkpointed region (the blocks then run eagerly) is named once after the first
    step, with dynamo's reason and the workaround, whole model compiled or blocks one by one; without checkpointing
    the same break is the model's own and is not reported."""
    torch._dynamo.reset()
    import lightning_ckpt.lightning.compiled as compiled

    compiled._WARNED_BREAKS.clear()
    found = _fit_with_a_break_in_each_block(tmp_path, "all", compile_blocks=compile_blocks)
    assert len(found) == 1, found
    assert "torch.compiler.disable" in found[0] and "_outside_the_compiler" in found[0]
    assert "policy='none'" in found[0] and "blocks=" in found[0]
    compiled._WARNED_BREAKS.clear()
    torch._dynamo.reset()
    assert _fit_with_a_break_in_each_block(tmp_path, "none", compile_blocks=compile_blocks) == []


def test_breaks_named_by_a_higher_order_op_are_the_checkpoints_own():
    """Only breaks counted since ``before`` are taken; when dynamo's reason names the checkpoint's higher-order op
    (transformers 5.25's "HOP: Unsafe side effect"), the others are left to the model."""
    from torch._dynamo.utils import counters

    from lightning_ckpt.lightning.compiled import checkpoint_graph_breaks, graph_breaks_so_far

    counters["graph_break"].clear()
    counters["graph_break"]["an old break"] += 1
    before = graph_breaks_so_far()
    assert checkpoint_graph_breaks(before) == []
    counters["graph_break"]["a break of the model's own"] += 1
    assert checkpoint_graph_breaks(before) == ["a break of the model's own"]
    counters["graph_break"]["HOP: Unsafe side effect\n  Explanation: mutated a context variable"] += 1
    counters["graph_break"]["an old break"] += 1
    assert checkpoint_graph_breaks(before) == ["HOP: Unsafe side effect\n  Explanation: mutated a context variable"]
    counters["graph_break"].clear()
