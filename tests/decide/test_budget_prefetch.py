"""The budget's peak model charges an offloaded block's interior from the start of the next offloaded block's
backward until its own backward ends (``lightning_ckpt.decide.budget``): this pins that reading of the offload
mechanism, run on the CPU with CPU tensors treated as device tensors."""

import torch
from torch import nn

from lightning_ckpt import apply_policy
from lightning_ckpt.core import offload
from lightning_ckpt.core.offload import Transfers, configure_offload
from lightning_ckpt.decide.budget import BlockCost, predict_peak

MODES = ("offload", "recompute", "off", "offload", "recompute")
OFFLOADED = [i for i, m in enumerate(MODES) if m == "offload"]  # block of each offloaded call, in forward order


class Blocks(nn.Module):
    def __init__(self, n: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
                                    for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _resident(groups) -> set:
    """The blocks whose copies are back on the device now (fetched and still held by the graph)."""
    return {OFFLOADED[k] for k, group in enumerate(groups)
            if any(ref() is not None and ref().fetched is not None for ref in group.copies)}


def test_an_offloaded_blocks_copies_are_back_from_the_next_offloaded_blocks_backward_until_its_own_ends(
        monkeypatch):
    torch.manual_seed(0)
    model = Blocks(len(MODES))
    plan = apply_policy(model, "offload", "blocks.*")
    plan.set_modes(MODES)
    state = configure_offload(plan, transfers=Transfers(is_device=lambda t: True))
    groups, seen = [], {}
    new_group, start_backward = offload.HostOffload.new_group, offload._Group.start_backward

    def record_group(self):
        groups.append(new_group(self))
        return groups[-1]

    def record_start(group, prefetch):  # an offloaded block's backward begins: its own copies, then the prefetch
        start_backward(group, prefetch)
        seen[f"{OFFLOADED[groups.index(group)]} started"] = _resident(groups)

    monkeypatch.setattr(offload.HostOffload, "new_group", record_group)
    monkeypatch.setattr(offload._Group, "start_backward", record_start)
    x = torch.randn(4, 16, requires_grad=True)
    outputs = []
    for i, block in enumerate(model.blocks):  # block i's backward begins when its output's gradient is ready
        block.register_forward_hook(lambda m, a, out, i=i: outputs.append((i, out)) if len(outputs) < len(MODES)
                                    else None)
    loss = model(x).pow(2).mean()
    for i, out in outputs:
        out.register_hook(lambda grad, i=i: seen.__setitem__(f"{i} begins", _resident(groups)))
    loss.backward()

    assert len(groups) == len(OFFLOADED)
    assert seen == {
        "4 begins": set(),  # no offloaded block after 3 in the forward: nothing comes back early
        "3 begins": set(),
        "3 started": {3, 0},  # 3's own interior, then block 0's prefetched
        "2 begins": {0},  # block 0's interior stays through the other modes' backward
        "1 begins": {0},
        "0 begins": {0},
        "0 started": {0},
    }
    assert state.held == 0  # every copy was freed by the backward
    # the peak model charges block 0's interior in the same interval: 3's moment and 1's replay carry it
    costs = [BlockCost(interior=10, boundary=1, recompute_s=0.0, offload_s=0.0)] * len(MODES)
    assert predict_peak(costs, MODES) == 10 + 1 + 10 + 10  # block 3: block 1's boundary, block 2 kept, 3, then 0

