"""Property: turning checkpointing on never changes what the model learns.

Random small models are built from a grammar of what a parent does between its blocks (dropout, LayerDrop's draw,
an in-place op, a parameter-free op, a saving op, a block reused, the next block under autocast, a stack looped
twice, two forwards before one backward, an outer ``saved_tensors_hooks``, two stacks) and trained one step under
every policy of the grammar, in float32 with dropout. The gradients must equal the plain model's bitwise, or the
plugin must refuse before training with a message naming the pattern. Seeded; bounded in time (cases stop after
``BUDGET_S``)."""

import copy
import random
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_ckpt import apply_policy
from lightning_ckpt.core.blocks import find_blocks

SEED = 35
CASES = 300
BUDGET_S = 12.0
WIDTH = 6

GAPS = ("nothing", "dropout", "layerdrop", "in_place", "parameter_free", "saves", "reuse", "autocast_next")
POLICIES = ("none", "all", "every:2", "first:2", "blocks:0,2", "group:2", "group:3", "group:sqrt", "selective",
            "selective:mm", "selective:gelu,addmm", "offload", "modes")


class Block(nn.Module):
    def __init__(self, p: float, takes_bias: bool):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.p = p
        self.takes_bias = takes_bias

    def forward(self, x, bias=None, *, scale=1.0):
        h = F.gelu(self.fc(x))
        if bias is not None:
            h = h + bias
        return F.dropout(h, self.p, self.training).float() * scale


class Stack(nn.Module):
    def __init__(self, rng: random.Random, n: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(rng.choice((0.0, 0.3)), rng.random() < 0.5) for _ in range(n))
        self.gaps = [rng.choice(GAPS) for _ in range(n)]
        self.reuse = [rng.randrange(i + 1) for i in range(n)]
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.bias = nn.Parameter(torch.full((WIDTH,), 0.1))

    def forward(self, x, loops: int):
        self.autocast_next = False
        for _ in range(loops):
            for i, block in enumerate(self.layers):
                x = self._call(block, x)
                x = self._gap(i, x)
        return x

    def _call(self, block, x):
        autocast, self.autocast_next = self.autocast_next, False
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if block.takes_bias:
                return block(x, self.bias * 2, scale=0.5)
            return block(x)

    def _gap(self, i, x):
        gap = self.gaps[i]
        if gap == "dropout":
            return F.dropout(x, 0.25, self.training)
        if gap == "layerdrop":
            torch.rand([])
            return x
        if gap == "in_place":
            return x.mul_(0.5)
        if gap == "parameter_free":
            x = torch.tanh(x)
            return x + 1
        if gap == "saves":
            return torch.sigmoid(x) * self.gate
        if gap == "reuse":
            return self._call(self.layers[self.reuse[i]], x)
        self.autocast_next = gap == "autocast_next"  # the next block runs under bfloat16 autocast
        return x


class Model(nn.Module):
    def __init__(self, rng: random.Random):
        super().__init__()
        self.stacks = nn.ModuleList(Stack(rng, rng.randint(2, 5)) for _ in range(rng.choice((1, 1, 2))))
        self.loops = rng.choice((1, 1, 2))

    def forward(self, x):
        for stack in self.stacks:
            x = stack(x, self.loops)
        return x


def _case(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = Model(rng)
    selector = Block if rng.random() < 0.8 else None  # None: whatever the plugin finds (the stacks, when two)
    blocks = len(find_blocks(model, selector))
    policy = rng.choice(POLICIES)
    if policy == "modes":
        policy = "modes:" + ",".join(rng.choice(("off", "recompute", "selective", "offload")) for _ in range(blocks))
    if policy in ("first:2", "blocks:0,2") and blocks < 3:
        policy = "all"
    return model, selector, policy, rng.choice((1, 2)), rng.random() < 0.5


def _step(model, x, passes, outer_hooks, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    hooks = saved_tensors_hooks(lambda t: [t], lambda box: box[0]) if outer_hooks else None
    if hooks is not None:
        hooks.__enter__()
    try:
        loss = sum(model(x * (k + 1)).pow(2).sum() for k in range(passes))
    finally:
        if hooks is not None:
            hooks.__exit__(None, None, None)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointing_never_changes_the_gradients_of_random_models():
    started, ran = time.monotonic(), 0
    for seed in range(SEED, SEED + CASES):
        if time.monotonic() - started > BUDGET_S:
            break
        model, selector, policy, passes, outer_hooks = _case(seed)
        x = torch.randn(2, 3, WIDTH)
        plain = copy.deepcopy(model)
        expected = _step(plain, x, passes, outer_hooks, seed)
        try:
            apply_policy(model, policy, blocks=selector)
        except ValueError as err:  # a refusal before training must name what to change
            pytest.fail(f"seed {seed}: {policy!r} refused a model the plain run trains: {err}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a split group region warns; its gradients must hold
            got = _step(model, x, passes, outer_hooks, seed)
        assert got.keys() == expected.keys(), (seed, policy)
        for name in got:
            assert torch.equal(got[name], expected[name]), (
                f"seed {seed}, policy {policy!r}, gaps {[s.gaps for s in model.stacks]}, loops "
                f"{model.loops}, passes {passes}, outer hooks {outer_hooks}: {name} differs by "
                f"{(got[name] - expected[name]).abs().max():.3g}")
        ran += 1
    assert ran >= 10, f"only {ran} cases ran in {BUDGET_S} s"
