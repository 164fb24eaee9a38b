"""Findings named from the tensors alive at the peak (:mod:`lightning_ckpt.decide.anatomy`), on models built to
have them, and the seed's units."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.decide.anatomy import FINDINGS, anatomy, anatomy_text, hidden_width, vocab_size
from lightning_ckpt.measure.meter import StepMeter

B, T, H, HEADS, VOCAB = 2, 16, 32, 4, 50


class Attention(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv, self.out = nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        q, k, v = (t.view(B, T, HEADS, H // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.kind == "eager":  # softmax(q kᵀ) written out: the (T x T) matrix is kept for backward
            y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(H // HEADS), dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.kind == "sdpa+dropout" else 0.0)
        return x + self.out(y.transpose(1, 2).reshape(B, T, H))


class Net(nn.Module):
    def __init__(self, kind: str = "sdpa", layers: int = 2, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, H)
        self.layers = nn.ModuleList(Attention(kind) for _ in range(layers))
        self.head = nn.Linear(H, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), ids.view(-1))  # the upcast


def _anatomy(net, policy="none", autocast=False, vocab=VOCAB):
    plan = apply_policy(net, policy, blocks="layers.*")
    meter = StepMeter("cpu", model=net)
    with meter.step(exact=True, attribute=plan.names) as box:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = net(torch.randint(0, vocab, (B, T)))
        meter.phase("backward")
        loss.backward()
    return anatomy(box.reading.attribution, B, T, hidden_width(net), 2 if autocast else 4, vocab=vocab_size(net),
                   mixed=autocast, blocks=plan.names, checkpointed=[m != "off" for m in plan.modes])


def _codes(data):
    return {f["code"] for f in data["findings"]}


@pytest.mark.parametrize("kind, expected", [("eager", True), ("sdpa", False), ("sdpa+dropout", True)])
def test_a_materialised_attention_matrix_is_found_whichever_op_made_it(kind, expected):
    """On the CPU, SDPA with dropout falls back to the math kernel, which keeps the matrix; without dropout the
    fused kernel keeps none."""
    torch.manual_seed(0)
    data = _anatomy(Net(kind))
    assert ("attention_scores" in _codes(data)) == expected, data["findings"]
    if expected:
        (scores,) = [f for f in data["findings"] if f["code"] == "attention_scores"]
        assert all(t["shape"][-2:] == [T, T] for t in scores["tensors"])
        assert "scaled_dot_product_attention" in scores["advice"]


def test_the_float32_logits_of_a_mixed_precision_loss_are_found_and_named_by_the_head():
    torch.manual_seed(0)
    data = _anatomy(Net("sdpa", vocab=4096), autocast=True, vocab=4096)
    (upcast,) = [f for f in data["findings"] if f["code"] == "logits_upcast"]
    assert upcast["bytes"] >= B * T * 4096 * 4 and "chunks" in upcast["advice"]
    assert "float32 copies of head's output" in upcast["text"]  # the head's bf16 logits, upcast by the loss
    assert "logits_upcast" not in _codes(_anatomy(Net("sdpa", vocab=4096), vocab=4096))  # float32 run: no upcast
    assert "autocast_copies" in _codes(data)  # and the weights' bf16 copies, a line of their own
    (copies,) = [f for f in data["findings"] if f["code"] == "autocast_copies"]
    assert "layers.0.qkv" in copies["text"] or "head" in copies["text"]


def test_what_lies_outside_the_blocks_is_named_with_its_share():
    torch.manual_seed(0)
    data = _anatomy(Net("sdpa", layers=1, vocab=4096), policy="all", vocab=4096)  # a big head, one small block
    (outside,) = [f for f in data["findings"] if f["code"] == "outside_blocks"]
    assert "outside the blocks" in outside["text"] and outside["bytes"] > 0


def test_a_large_temporary_at_the_peak_is_a_workspace():
    class Scratch(nn.Module):
        def forward(self, x):
            big = x.exp().repeat(1, 1, 64)  # a wide temporary, reduced at once: never kept
            return x * big.mean(-1, keepdim=True).detach()

    class WithScratch(Net):
        def __init__(self):
            super().__init__("sdpa")
            self.scratch = Scratch()

        def forward(self, ids):
            x = self.scratch(self.emb(ids))
            for layer in self.layers:
                x = layer(x)
            return self.head(x).logsumexp(-1).mean()

    torch.manual_seed(0)
    data = _anatomy(WithScratch())
    (work,) = [f for f in data["findings"] if f["code"] == "workspace"]
    assert work["tensors"][0]["module"] == "scratch" and work["tensors"][0]["role"] == "temporary"


def test_per_block_units_and_the_seeds_arithmetic_for_this_run():
    torch.manual_seed(0)
    data = _anatomy(Net("eager"))
    unit = B * T * H * 4
    assert data["unit_bytes"] == unit
    blocks = data["per_block"]
    assert [b["name"] for b in blocks] == ["layers.0", "layers.1"]
    assert blocks[0]["hidden_tensors"] == pytest.approx(blocks[0]["kept"] / unit, abs=0.01)
    assert any("its input kept by qkv" in p["what"] for p in blocks[1]["parts"])
    assert data["arithmetic"] and data["arithmetic"][0].startswith("2 blocks kept whole × ")
    checkpointed = _anatomy(Net("eager"), policy="all")
    assert [b["hidden_tensors"] for b in checkpointed["per_block"]] == [1.0, 1.0]  # only their inputs
    assert checkpointed["arithmetic"][0].startswith("2 checkpointed blocks × 1.0 hidden-width tensors")
    text = anatomy_text(dict(data, step=3, shape="2 x 16"))
    assert "what is alive at the activation peak (step 3, batch 2 x 16" in text and "blocks 0-1:" in text
    assert "[attention_scores]" in text


def test_every_finding_code_is_documented_in_the_module_and_the_docs():
    import pathlib

    import lightning_ckpt.decide.anatomy as module

    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "diagnosis.md").read_text()
    for code in FINDINGS:
        assert f"``{code}``" in module.__doc__ and f"`{code}`" in docs, code
