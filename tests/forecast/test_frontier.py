"""``lightning-ckpt frontier``: calibrate, solve at every budget, measure, time, write the JSON and the picture."""

from __future__ import annotations

import json

import pytest
from _torch_features import needs_compiler_budget

from lightning_ckpt.cli.main import main
from lightning_ckpt.forecast.profile.frontier import frontier, frontier_table, parse_budgets

GPT = "lightning_ckpt.demos.lightning_gpt:GPTLightningModule"
TINY = json.dumps(dict(n_layer=4, n_embd=64, n_head=4, block_size=64))
KiB = 1024


@pytest.mark.slow
def test_frontier_command_writes_its_files_and_every_plan_fits_its_budget(tmp_path, capsys):
    out = tmp_path / "fr"
    assert main(["frontier", GPT, "--init-args", TINY, "--micro-batch", "2", "--seq-len", "64", "--budgets", "4",
                 "--rounds", "1", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "smallest feasible budget" in stdout and "fastest fixed mode that fits" in stdout
    assert (out / "frontier.png").stat().st_size > 10_000
    data = json.loads((out / "frontier.json").read_text())
    anchors = {a["label"]: a for a in data["anchors"]}
    assert set(anchors) == {"none", "all", "selective", "every:2", "first:half"}
    assert anchors["first:half"]["modes"] == ["recompute", "recompute", "off", "off"]
    low, high = anchors["all"]["activations"], anchors["none"]["activations"]
    budgets = [p["budget"] for p in data["plans"]]
    assert budgets[0] == low and budgets[-1] == high and budgets == sorted(budgets) and len(budgets) == 4
    for p in data["plans"]:
        assert p["refused"] is None, p  # all's measured peak is a feasible plan: even the lowest budget is met
        assert p["fits"] and p["activations"] <= p["budget"] and p["step_s"] > 0
        assert set(p["modes"]) <= {"off", "selective", "recompute"}  # no offload on the CPU
    assert data["plans"][-1]["modes"] == ["off"] * 4  # at none's peak nothing needs replaying
    # the picture says how loaded the machine was while it timed (before and after), for the reader to judge
    load = data["settings"]["load_average"]
    assert len(load) == 2 and all(avg is None or len(avg) == 3 for avg in load)


@pytest.mark.parametrize("value, words", [
    ("abc", "--budgets='abc' is not a size"), ("1", "at least 2"), ("0MiB", "must be a positive size"),
    ("10 parsecs", "unknown unit"), ("", "is empty"),
    ("40,60", "--budgets='40,60': 40 has no unit"), ("40MiB,60", "60 has no unit"), ("2.5", "2.5 has no unit"),
])
def test_bad_budgets_are_refused_with_the_fix(value, words, tmp_path, capsys):
    assert main(["frontier", GPT, "--budgets", value, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("lightning-ckpt frontier: error:")
    assert not (tmp_path / "x").exists()


def test_parse_budgets():
    assert parse_budgets(8) == 8 and parse_budgets("6") == 6
    assert parse_budgets("2MiB,1MiB") == [1024 * KiB, 2048 * KiB]


@pytest.mark.slow
def test_a_budget_below_the_smallest_feasible_is_refused_naming_it(tmp_path):
    report = frontier(GPT, TINY, micro_batch=2, seq_len=64, budgets="1KiB,64MiB", rounds=1, anchors=("none", "all"),
                      out=str(tmp_path), plot=False)
    refused, generous = report.plans
    assert refused.refused.startswith("the smallest feasible budget is ")
    assert report.smallest_budget == report.anchors[1].activations  # 'all', as measured
    assert generous.fits and generous.modes == ("off",) * 4
    assert "refused: the smallest feasible budget" in frontier_table(report)


def test_an_anchor_must_be_a_fixed_mode(tmp_path, capsys):
    assert main(["frontier", GPT, "--init-args", TINY, "--anchors", "none,budget:1MiB", "--out", str(tmp_path)]) == 2
    assert "--anchors: 'budget:1MiB' is not a fixed mode" in capsys.readouterr().err


@pytest.mark.slow
@needs_compiler_budget
@pytest.mark.timeout(300)
def test_with_blocks_compiled_the_compilers_budget_per_block_joins_the_modes(tmp_path):
    """``--compile-blocks``: every block its own graph; the modes are priced compiled and ``compiler:<f>`` is
    offered; every plan fits its budget in the callback's figure (the eager peak less the compiler blocks' savings)."""
    import torch

    torch._dynamo.reset()
    report = frontier(GPT, TINY, micro_batch=2, seq_len=64, budgets=3, rounds=1, anchors=("none", "all"),
                      out=str(tmp_path), plot=False, compile_blocks="aot_eager")
    assert report.settings["compile_blocks"] == "aot_eager" and "compiler" in report.settings["modes"]
    priced = {"recompute", "selective", "compiler:0", "compiler:0.25", "compiler:0.5", "compiler:0.75"}
    assert set(report.settings["block_seconds"]["Block"]) == priced  # each priced on the compiled block
    kept = report.settings["compiled_kept"]["Block"]
    assert kept["off"] > kept["compiler:0.5"] > kept["compiler:0"]
    for point in report.plans:
        assert point.refused is None and point.fits and point.activations <= point.budget, point
        assert {m.split(":")[0] for m in point.modes} <= {"off", "selective", "recompute", "compiler"}
    data = json.loads((tmp_path / "frontier.json").read_text())
    assert data["settings"]["compile_blocks"] == "aot_eager"


def test_an_unknown_compile_backend_is_refused_with_the_choices(tmp_path, capsys):
    assert main(["frontier", GPT, "--init-args", TINY, "--compile-blocks", "turbo", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--compile-blocks='turbo' is not a torch.compile backend; valid backends:" in err and "inductor" in err
    assert not (tmp_path / "x").exists()
