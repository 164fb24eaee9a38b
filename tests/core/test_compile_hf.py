"""A Hugging Face Llama under ``torch.compile`` with checkpointed blocks: no graph break that the un-checkpointed
model does not have, the recompute in the compiled backward, gradients equal to eager.

Since transformers 5.25 (which depends on the ``kernels`` package) the attention's ``forward`` is wrapped by
``kernels.use_kernelized_func``: every call sets and resets a module-level ``CompileableContextVar``, a Python
side effect inside the checkpointed region that dynamo refuses in a ``torch.utils.checkpoint`` body ("HOP: Unsafe
side effect"), so each checkpointed block fell out of the graph and ran eagerly (no recompute in the compiled
backward). On transformers without that wrapper these tests pass as they are.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.partitioners import min_cut_rematerialization_partition

from lightning_ckpt import apply_policy

pytest.importorskip("transformers")

N_LAYER = 4


class Counting:
    """An AOTAutograd backend counting matmuls in the forward and backward graphs it compiles."""

    def __init__(self) -> None:
        self.counts = {"fw": 0, "bw": 0}
        self.backend = aot_autograd(fw_compiler=self._compiler("fw"), bw_compiler=self._compiler("bw"),
                                    partition_fn=min_cut_rematerialization_partition)

    def _compiler(self, phase):
        def compile_graph(gm, example_inputs):
            self.counts[phase] += sum(n.op == "call_function" and "mm" in str(n.target) for n in gm.graph.nodes)
            return gm.forward

        return compile_graph


@pytest.fixture(scope="module")
def reference():
    from lightning_ckpt.demos.hf import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(n_layer=N_LAYER, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    plain(input_ids=ids, labels=ids).loss.backward()
    return model, ids, {n: p.grad for n, p in plain.named_parameters()}


def _compiled_step(reference, policy, how="model"):
    """One compiled training step; returns (graph breaks, matmul counts, the model)."""
    model, ids, _ = reference
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    counting = Counting()
    if policy != "none":
        apply_policy(model, policy)
    if how == "model":
        run = torch.compile(model, backend=counting.backend)
    else:  # each block its own graph (block.compile(), what compile_blocks=True does)
        for block in model.model.layers:
            block.compile(backend=counting.backend)
        run = model
    run(input_ids=ids, labels=ids).loss.backward()
    return sum(counters["graph_break"].values()), dict(counting.counts), model, dict(counters["graph_break"])


def _assert_grads_equal(model, grads):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # four whole-model compiles (~30 s); the per-block test below catches the same break in seconds
def test_checkpointed_llama_blocks_compile_without_a_break_and_recompute_in_the_compiled_backward(reference):
    plain_breaks, plain, _, _ = _compiled_step(reference, "none")
    extra = {}
    for policy in ("all", "every:2", "selective"):
        breaks, counts, model, reasons = _compiled_step(reference, policy)
        assert breaks == plain_breaks, (policy, reasons)
        assert counts["fw"] == plain["fw"], (policy, counts, plain)
        extra[policy] = counts["bw"] - plain["bw"]
        _assert_grads_equal(model, reference[2])
    # a recomputed block replays its forward matmuls in the backward graph, every:2 in half the blocks; selective
    # keeps the matmuls' outputs (nothing to replay there)
    assert extra["all"] > extra["every:2"] > 0, extra
    assert extra["selective"] == 0, extra


@pytest.mark.parametrize("policy", ["all", "selective"])
def test_checkpointed_llama_blocks_compiled_one_by_one_have_no_break(reference, policy):
    plain_breaks, plain, _, _ = _compiled_step(reference, "none", how="blocks")
    breaks, counts, model, reasons = _compiled_step(reference, policy, how="blocks")
    assert breaks == plain_breaks, reasons
    assert counts["fw"] == plain["fw"], (counts, plain)
    assert (counts["bw"] > plain["bw"]) == (policy == "all"), (counts, plain)
    _assert_grads_equal(model, reference[2])
