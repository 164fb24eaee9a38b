"""One step's memory over its operations, by ledger line (:mod:`lightning_ckpt.measure.timeline`), and the
``lightning-ckpt timeline`` command."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_ckpt.cli.main import main
from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.demos.factories import tiny_gpt
from lightning_ckpt.forecast.load import lightning_step, make_batch, make_optimizers
from lightning_ckpt.measure.ledger import model_state_bytes, state_tensors
from lightning_ckpt.measure.meter import StepMeter
from lightning_ckpt.measure.timeline import CATEGORIES

TINY = "lightning_ckpt.demos.factories:tiny_gpt"


def _timeline(policy):
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=2, n_embd=32)
    model.train()
    plan = apply_policy(model, policy)
    batch = make_batch(model, 2, 32)
    opts = make_optimizers(model)
    lightning_step(model, batch, opts)  # Adam's state exists from here on
    meter = StepMeter("cpu", model=model)
    with meter.step(exact=True, attribute=plan.names, state=state_tensors(model, opts)) as box:
        lightning_step(model, batch, opts, meter=meter)
    return box.reading, model_state_bytes(model, opts)


def test_the_timeline_stacks_the_ledger_lines_and_marks_the_phases():
    reading, state = _timeline("none")
    t = reading.timeline
    assert set(t.layers) == set(CATEGORIES) and [phase for _, phase in t.boundaries] == ["backward", "optimizer"]
    # the model state, as the ledger walks it, before the step (gradients of the last step) and after it
    assert t.layers["parameters"][0] == state.params and t.layers["optimizer state"][0] >= state.optimizer
    assert t.layers["gradients"][0] == state.grads and t.layers["gradients"][-1] == state.grads
    backward = t.boundaries[0][0]
    low = min(g for x, g in zip(t.x, t.layers["gradients"]) if x <= backward)
    assert low == 0  # Lightning's zero_grad(set_to_none=True) freed them before the backward
    assert t.layers["activations"][-1] == 0 and max(t.layers["activations"]) > 0
    totals = [sum(layer[i] for layer in t.layers.values()) for i in range(len(t.x))]
    assert t.peak_bytes == max(totals) and t.peak_x in t.x and len(t.peak_tensors) == 3


def test_checkpointing_lowers_the_curve_and_its_replays_show_in_backward():
    none, _ = _timeline("none")
    every, _ = _timeline("all")
    assert every.timeline.peak_bytes < none.timeline.peak_bytes
    backward = every.timeline.boundaries[0][0]
    replays = [a for x, a in zip(every.timeline.x, every.timeline.layers["activations"]) if x > backward]
    assert max(replays) > every.timeline.layers["activations"][every.timeline.x.index(
        max(x for x in every.timeline.x if x <= backward))]  # a replay rises above the kept boundaries


def test_the_timeline_command_draws_plans_side_by_side(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t"
    assert main(["timeline", TINY, "--init-args", '{"n_layer": 2, "n_embd": 32}', "--micro-batch", "2",
                 "--seq-len", "32", "--policies", "none,all", "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "none: 0/2 blocks checkpointed: peak" in printed and "all: 2/2 blocks checkpointed: peak" in printed
    data = json.loads((out / "memory_timeline.json").read_text())
    assert [d["label"].split(":")[0] for d in data] == ["none", "all"] and data[1]["peak_bytes"] < data[0]["peak_bytes"]
    assert (out / "memory_timeline.png").stat().st_size > 10_000


def test_the_timeline_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert main(["timeline", TINY, "--seq-len", "0", "--out", str(tmp_path / "t")]) == 2
    assert "--seq-len=0 must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
