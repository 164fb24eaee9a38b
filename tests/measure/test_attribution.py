"""What is alive at a step's peaks, named (:mod:`lightning_ckpt.measure.attribution`), on models whose answer is
known by construction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.measure.attribution import ModuleStack
from lightning_ckpt.measure.meter import StepMeter

H, B, T, LAYERS = 16, 2, 8, 3


class MLPBlock(nn.Module):
    """``Linear(h, 4h) → GELU → Linear(4h, h)`` plus the residual: 9 hidden-width tensors kept by construction (the
    input of fc1, fc1's output for gelu: 4, gelu's output for fc2: 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class MLPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, H)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(LAYERS))
        self.head = nn.Linear(H, 10)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float().logsumexp(-1).mean()


def _attributed(net, plan, policy):
    plan.retarget(policy)
    meter = StepMeter("cpu", model=net)
    ids = torch.randint(0, 10, (B, T))
    with meter.step(exact=True, attribute=plan.names) as box:
        loss = net(ids)
        meter.phase("backward")
        loss.backward()
    return box.reading


def _kept_units(attribution):
    unit = B * T * H * 4
    kept = {}
    for t in attribution["forward end"].tensors:
        if t.role == "kept" and t.block is not None:
            kept[t.block] = kept.get(t.block, 0) + t.bytes
    return {block: n / unit for block, n in kept.items()}


@pytest.mark.parametrize("policy, units", [("none", 9.0), ("all", 1.0)])
def test_an_mlp_block_keeps_nine_hidden_width_tensors_and_one_checkpointed(policy, units):
    torch.manual_seed(0)
    net = MLPNet()
    plan = apply_policy(net, "none", blocks="layers.*")
    reading = _attributed(net, plan, policy)
    assert _kept_units(reading.attribution) == {i: units for i in range(LAYERS)}
    peak = reading.attribution["activation peak"]
    assert peak.bytes == reading.activations  # the tensors named add up to the activation line, exactly
    assert sum(peak.per_block.values()) + peak.outside == peak.bytes


def test_kept_tensors_are_named_by_their_keeper_and_their_maker():
    torch.manual_seed(0)
    net = MLPNet()
    plan = apply_policy(net, "none", blocks="layers.*")
    end = _attributed(net, plan, "none").attribution["forward end"]
    kept = {(t.module, t.kept_by, t.op) for t in end.tensors if t.role == "kept" and t.block == 1}
    assert ("layers.1.fc1", "layers.1.act", "aten.addmm") in kept  # fc1's output, kept for gelu's backward
    assert ("layers.1.act", "layers.1.fc2", "aten.gelu") in kept
    assert ("layers.0", "layers.1.fc1", "aten.add") in kept  # block 1's input: block 0's output, kept by fc1
    plan.retarget("all")
    end = _attributed(net, plan, "all").attribution["forward end"]
    kept = [t for t in end.tensors if t.block == 2 and t.role == "kept"]  # (temporaries differ by torch release)
    assert [(t.module, t.kept_by) for t in kept] == [("layers.1", "layers.2")]


def test_replays_and_temporaries_are_told_apart_at_a_backward_peak():
    torch.manual_seed(0)
    net = MLPNet()
    plan = apply_policy(net, "all", blocks="layers.*")
    reading = _attributed(net, plan, "all")
    peak = reading.attribution["activation peak"]
    assert peak.phase == "backward" and peak.by_role()["replay"] > 0  # the peak is a block's replay
    replayed = {t.block for t in peak.tensors if t.role == "replay"}
    assert len(replayed) == 1  # one block replays at a time


def test_autocast_copies_are_their_own_role_and_name_their_weight():
    torch.manual_seed(0)
    net = MLPNet()
    plan = apply_policy(net, "none", blocks="layers.*")
    meter = StepMeter("cpu", model=net)
    with meter.step(exact=True, attribute=plan.names) as box:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(torch.randint(0, 10, (B, T)))
        meter.phase("backward")
        loss.backward()
    total = box.reading.attribution["total peak"]
    copies = [t for t in total.tensors if t.role == "copy"]
    assert copies and all(t.dtype == "bfloat16" for t in copies)
    assert {t.module for t in copies} >= {"layers.0.fc1", "layers.0.fc2"}
    peak = box.reading.attribution["activation peak"]
    assert peak.bytes == box.reading.activations and "copy" not in {t.role for t in peak.tensors}


def test_the_module_stack_pops_on_error_and_leaves_no_hook():
    from torch.nn.modules import module as module_module

    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    before = (len(module_module._global_forward_pre_hooks), len(module_module._global_forward_hooks))
    with ModuleStack(net, prefix="model") as stack:
        seen = []
        net[1].register_forward_pre_hook(lambda m, a: seen.append(stack.current))
        net(torch.randn(1, 2))
        net[0].register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError):
            net(torch.randn(1, 2))
        assert stack.stack == [] and seen == ["model.1"]
    assert (len(module_module._global_forward_pre_hooks), len(module_module._global_forward_hooks)) == before


def test_a_step_not_attributed_costs_nothing_more():
    torch.manual_seed(0)
    net = MLPNet()
    meter = StepMeter("cpu", model=net)
    with meter.step(exact=True) as box:
        net(torch.randint(0, 10, (B, T))).backward()
    assert box.reading.attribution is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_per_module_bytes_equal_pytorchs_memtracker_on_hugging_face_models(arch):
    """At the end of the forward, what each block made and still holds equals the ACT bytes PyTorch's MemTracker
    sees that block's forward leave alive (an independent tracker: it shares no code with the attribution)."""
    pytest.importorskip("transformers")
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    from lightning_ckpt.demos.hf import tiny_gpt2, tiny_llama
    from lightning_ckpt.forecast.load import make_batch, step_loss

    torch.manual_seed(0)
    shape = dict(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=96)
    model = tiny_llama(**shape) if arch == "llama" else tiny_gpt2(dropout=0.0, **shape)
    model.train()
    plan = apply_policy(model, "none")
    batch = make_batch(model, 2, 32)
    tracker = MemTracker()
    tracker.track_external(model, *batch.values())
    with tracker:
        loss = step_loss(model, batch)
    cpu = torch.device("cpu")
    theirs = []
    for block in plan.blocks:
        snaps = tracker.memory_tracking[block].snapshots
        theirs.append(snaps[_ModState.POST_FW][-1][cpu][_MemRefType.ACT] - snaps[_ModState.PRE_FW][-1][cpu][
            _MemRefType.ACT])
    loss.backward()
    model.zero_grad(set_to_none=True)
    meter = StepMeter("cpu", model=model)
    with meter.step(exact=True, attribute=plan.names) as box:
        loss = step_loss(model, batch)
        meter.phase("backward")
        loss.backward()
    ours = [sum(t.bytes for t in box.reading.attribution["forward end"].tensors
                if t.module == name or t.module.startswith(name + ".")) for name in plan.names]
    assert all(t > 0 for t in theirs)
    for o, t in zip(ours, theirs):
        assert o == pytest.approx(t, rel=0.01)
