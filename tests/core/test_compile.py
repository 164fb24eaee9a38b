"""Every policy under ``torch.compile``, in the three ways Lightning users compile: the whole model after the plan
is applied, the model compiled before the plan is applied (``configure_model``), and block by block
(``block.compile()``, the torchtitan/FSDP2 way). For each: no error, the recompute really happens (matmuls counted
in the compiled backward graph), gradients equal the eager un-checkpointed model, and no graph break is added.

Most of the matrix uses AOTAutograd with the min-cut partitioner (what inductor partitions with) and counting
compilers, so it runs in seconds; the C++ inductor backend itself runs on the policies users pick most.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _torch_features import needs_compiler_budget
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from lightning_ckpt import apply_policy
from lightning_ckpt.demos.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, n_layer=4, n_head=2, n_embd=32, block_size=16, dropout=0.0)
POLICIES = ("none", "all", "every:2", "first:1", "blocks:1,3", "group:2", "selective", "offload")
# per-block matmuls in backward beyond the un-checkpointed graph: a recomputed block adds its forward matmuls
RECOMPUTES = {"none": False, "all": True, "every:2": True, "first:1": True, "blocks:1,3": True, "group:2": True,
              "selective": False, "offload": False}
# group:K regions span several calls of the parent's forward: under compile they run eagerly (documented)
BREAKS_ALLOWED = {"group:2"}


def _inputs():
    torch.manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (2, CFG.block_size))


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = GPT(CFG)
    plain = copy.deepcopy(model)
    idx = _inputs()
    plain(idx, idx)[1].backward()
    return model, {n: p.grad for n, p in plain.named_parameters()}


class Counting:
    """An AOTAutograd backend that counts matmuls in the forward and backward graphs it is handed."""

    def __init__(self) -> None:
        self.counts = {"fw": 0, "bw": 0, "graphs": 0}
        self.backend = aot_autograd(fw_compiler=self._compiler("fw"), bw_compiler=self._compiler("bw"),
                                    partition_fn=min_cut_rematerialization_partition)

    def _compiler(self, phase):
        def compile_graph(gm, example_inputs):
            self.counts[phase] += sum(1 for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
            self.counts["graphs"] += phase == "fw"
            return gm.forward

        return compile_graph


def _compiled(model, how, backend):
    """``model`` compiled ``how``, and the module whose blocks get the plan (the compiled wrapper's original)."""
    if how == "model after plan":
        return torch.compile(model, backend=backend), model
    if how == "model before plan":  # LightningModule.configure_model compiling before the callback applies
        compiled = torch.compile(model, backend=backend)
        return compiled, compiled
    if how == "block wrappers":  # torch.compile(block) held by the parent (torchtitan, before fully_shard)
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = torch.compile(block, backend=backend)
        return model, model
    for block in model.transformer.h:  # block by block
        block.compile(backend=backend)
    return model, model


def _step(model, how, policy, backend):
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    if how == "model after plan":
        apply_policy(model, policy)
        run, _ = _compiled(model, how, backend)
    else:
        run, owner = _compiled(model, how, backend)
        apply_policy(owner, policy)
    idx = _inputs()
    run(idx, idx)[1].backward()
    return model


def _assert_grads_equal(model, grads):
    for name, p in model.named_parameters():  # a block wrapper adds "_orig_mod." to its parameters' names
        torch.testing.assert_close(p.grad, grads[name.replace("_orig_mod.", "")], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["model after plan", "model before plan", "block by block", "block wrappers"])
def test_every_policy_compiles_recomputes_and_matches_eager(reference, how):
    model, grads = reference
    counts = {}
    for policy in POLICIES:
        counting = Counting()
        compiled = _step(model, how, policy, counting.backend)
        _assert_grads_equal(compiled, grads)
        counts[policy] = dict(counting.counts)
    baseline = counts["none"]
    assert baseline["graphs"] >= 1 and baseline["bw"] > 0
    for policy in POLICIES:
        if policy in BREAKS_ALLOWED:
            continue
        if how == "model after plan" or how == "model before plan":  # per-block graphs are shared: not comparable
            more = counts[policy]["bw"] > baseline["bw"]
            assert more == RECOMPUTES[policy], (policy, counts[policy], baseline)
            assert counts[policy]["fw"] == baseline["fw"], (policy, counts[policy])


def _breaks(model) -> int:
    idx = _inputs()
    return torch._dynamo.explain(model)(idx, idx).graph_break_count


@pytest.mark.slow
@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in BREAKS_ALLOWED])
def test_the_wrapper_adds_no_graph_break(reference, policy):
    model, _ = reference
    plain = copy.deepcopy(model)
    checkpointed = copy.deepcopy(model)
    apply_policy(checkpointed, policy)
    torch._dynamo.reset()
    plain_breaks = _breaks(plain)
    torch._dynamo.reset()
    assert _breaks(checkpointed) <= plain_breaks


def test_group_regions_run_eagerly_under_compile_and_stay_correct(reference):
    model, grads = reference
    compiled = _step(model, "model after plan", "group:2", "aot_eager")
    _assert_grads_equal(compiled, grads)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "selective", "every:2"])
def test_the_inductor_cpp_backend(reference, policy):
    model, grads = reference
    compiled = _step(model, "model after plan", policy, "inductor")
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)  # fused kernels


@pytest.mark.slow
def test_changing_the_plan_recompiles_once_per_plan_and_reuses_a_plan_that_comes_back(reference):
    model, _ = reference
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    plan = apply_policy(model, "none")
    counting = Counting()
    run = torch.compile(model, backend=counting.backend)
    idx = _inputs()
    sequence = ["none", "every:2", "all", "every:2", "none", "all", "none"]
    graphs = []
    for policy in sequence:
        plan.retarget(policy)
        run(idx, idx)[1].backward()
        graphs.append(counting.counts["graphs"])
    assert graphs == [1, 2, 3, 3, 3, 3, 3], graphs  # three distinct plans: three graphs, then only reuse


def _saved_bytes(model, run) -> int:
    """Bytes saved for backward by one forward (distinct storages, parameters left out), then the backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    idx = _inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(idx, idx)[1]
    loss.backward()
    return sum(seen.values())


@pytest.mark.slow
@needs_compiler_budget
def test_the_compilers_budget_per_block_keeps_less_and_matches_eager(reference):
    """``compiler:<f>`` blocks compiled one by one: the partitioner keeps less as ``f`` falls (``0`` keeps what a full
    recompute keeps), gradients equal the eager un-checkpointed model; run eagerly the mode is ``off``."""
    model, grads = reference
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    for block in compiled.transformer.h:
        block.compile(backend="aot_eager")
    plan = apply_policy(compiled, "none")
    saved = {}
    for mode in ("off", "compiler:1", "compiler:0.5", "compiler:0", "recompute"):
        plan.set_modes([mode] * plan.num_blocks)
        compiled.zero_grad(set_to_none=True)
        saved[mode] = _saved_bytes(compiled, compiled)
        _assert_grads_equal(compiled, grads)
    assert saved["compiler:0"] == saved["recompute"] < saved["compiler:0.5"] < saved["off"] == saved["compiler:1"]
    eager = copy.deepcopy(model)
    plan = apply_policy(eager, "none")
    off = _saved_bytes(eager, eager)
    plan.set_modes(["compiler:0"] * plan.num_blocks)
    assert _saved_bytes(eager, eager) == off


@needs_compiler_budget
def test_the_compilers_budget_per_block_is_refused_by_pytorch_inside_one_whole_model_graph(reference):
    """PyTorch takes one budget per graph, covering all of it: a block's annotation inside a whole-model graph fails
    at the first compile (the callback refuses the combination before training)."""
    model, _ = reference
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    apply_policy(model, "modes:off,compiler:0,off,off")
    idx = _inputs()
    with pytest.raises(Exception, match="must cover the entire forward of a graph"):
        torch.compile(model, backend="aot_eager")(idx, idx)
