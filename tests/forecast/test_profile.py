"""``lightning-ckpt profile`` / :func:`lightning_ckpt.forecast.profile.profile` on a tiny demo GPT (CPU, seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ckpt.cli.main import main
from lightning_ckpt.core.units import unit_for
from lightning_ckpt.forecast.profile import ProfileReport, ProfileResult, profile, read_slopes, recommend
from lightning_ckpt.forecast.profile.output import markdown, table

GPT = "lightning_ckpt.demos.lightning_gpt:GPTLightningModule"
TINY = json.dumps(dict(n_layer=2, n_embd=32, n_head=2, block_size=32))
HERE = Path(__file__).parents[1]  # tests/, where the helper modules live
MiB = 2**20


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    return tmp_path


# Deterministic on the CPU: peak = the highest phase peak of the live-tensor count; this budget lies between
# the peaks of the configurations (500-780 KB), so some fit and some do not.
BUDGET = "600KB"


@pytest.mark.slow
def test_profile_writes_everything_and_recommends_within_budget(in_tmp, capsys):
    out = in_tmp / "prof"
    args = ["profile", GPT, "--init-args", TINY, "--policies", "none,all", "--micro-batches", "1,2",
            "--seq-lens", "16,32", "--steps", "2", "--warmup", "1", "--budget", BUDGET, "--out", str(out)]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "none_mb2_seq32" in stdout and "Recommendation:" in stdout and "tokens/s" in stdout

    data = json.loads((out / "profile.json").read_text())
    names = [r["name"] for r in data["results"]]
    # per policy: micro-batch 1, 2 at length 32 and lengths 16, 32 at micro-batch 1 (one shared), plus 1x2 accumulation
    assert sorted(names) == sorted(["none_mb1_seq32", "none_mb2_seq32", "none_mb1_seq16", "all_mb1_seq32",
                                    "all_mb2_seq32", "all_mb1_seq16", "none_mb1x2_seq32"])
    budget = data["settings"]["budget"]
    assert budget == 600_000
    for r in data["results"]:
        assert not r["oom"] and r["error"] is None
        for key in ("activations", "model_state", "peak", "forward_s", "backward_s", "step_s", "tokens_per_sec"):
            assert r[key] is not None and r[key] > 0, (r["name"], key)
        assert r["peak_allocated"] is None and r["peak_reserved"] is None  # no allocator counters on a CPU
        assert r["fits"] == (r["peak"] <= budget)
    by = {r["name"]: r for r in data["results"]}
    assert by["none_mb1x2_seq32"]["tokens_per_step"] == 64
    assert by["none_mb1x2_seq32"]["activations"] == pytest.approx(by["none_mb1_seq32"]["activations"], rel=0.05)
    assert by["all_mb2_seq32"]["activations"] < by["none_mb2_seq32"]["activations"]
    fitting = [r for r in data["results"] if r["fits"]]
    assert fitting and len(fitting) < len(data["results"]), "the budget should split the configurations"
    rec = data["recommendation"]
    assert rec["peak"] <= budget
    assert rec["name"] == max(fitting, key=lambda r: r["tokens_per_sec"])["name"]
    assert data["reading"]["tokens"]["verdict"] == "grows"
    assert data["reading"]["length"]["verdict"] == "linear"  # SDPA: no materialized attention matrix

    md = (out / "profile.md").read_text()
    assert "| none_mb2_seq32 |" in md and "Recommendation:" in md
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in names:
        events = list((out / "tb" / name).glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 0, name


@pytest.mark.slow
def test_injected_oom_is_a_result_not_a_crash(in_tmp):
    report = profile("_profile_models:OOMAboveGPT", dict(oom_above_tokens=32, n_layer=2, n_embd=32, n_head=2,
                                                         block_size=32),
                     policies="none", micro_batches="1,2", seq_lens="32", steps=1, warmup=0, out=in_tmp / "o",
                     progress=False, tensorboard=False, plot=False)
    oom = report.result("none", 2, 32)
    assert oom.oom and oom.error is None and oom.fits is False and oom.tokens_per_sec is None
    ok = report.result("none", 1, 32)
    assert not ok.oom and ok.activations > 0
    assert report.result("none", 1, 32, accumulate=2).oom is False  # 1 x 2 never holds more than 32 tokens
    assert report.recommendation["name"] != oom.name
    data = json.loads((in_tmp / "o" / "profile.json").read_text())
    assert [r["oom"] for r in data["results"] if r["name"] == "none_mb2_seq32"] == [True]
    assert "Out of memory: none_mb2_seq32" in (in_tmp / "o" / "profile.md").read_text()


def test_batches_from_a_datamodule_and_a_lightningcli_yaml(in_tmp):
    config = in_tmp / "config.yaml"
    config.write_text(
        "model:\n  class_path: _profile_models.NoHookGPT\n  init_args:\n    n_layer: 2\n    n_embd: 32\n"
        "    n_head: 2\n    block_size: 32\n"
        "data:\n  class_path: lightning_ckpt.demos.lightning_gpt.CharDataModule\n  init_args:\n    batch_size: 8\n")
    report = profile(None, config=str(config), policies="all", micro_batches="2", seq_lens="16", accumulate=0,
                     steps=1, warmup=0, out=in_tmp / "o", progress=False, tensorboard=False, plot=False)
    assert report.settings["batch"] == "datamodule"
    [r] = report.results
    assert r.ok and r.tokens_per_step == 32 and r.micro_batch == 2 and r.seq_len == 16


@pytest.mark.parametrize(
    "extra, words",
    [
        (["no_such_pkg.models:GPT"], "cannot import module 'no_such_pkg.models'"),
        (["lightning_ckpt.demos.lightning_gpt:NoSuchClass"], "has no attribute 'NoSuchClass'"),
        (["_profile_models:NoHookModule"], "no example_batch(micro_batch, seq_len) hook"),
        ([GPT, "--init-args", TINY, "--budget", "12 parsecs"], "unknown unit"),
        ([GPT, "--init-args", TINY, "--budget", "12"], "needs a unit"),
        ([GPT, "--init-args", TINY, "--capacity", "lots"], "is not a size"),
        ([GPT, "--init-args", "{n_layer: 2}"], "not valid JSON"),
        ([GPT, "--init-args", TINY, "--micro-batches", "1,two"], "comma-separated list of positive integers"),
        ([GPT, "--init-args", TINY, "--seq-lens", "16,64"], "exceeds the model's context length"),
        ([GPT, "--init-args", TINY, "--policies", "none,every:0"], "every:0"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(in_tmp, extra, words, capsys):
    assert main(["profile", *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("lightning-ckpt profile: error:") and words in err[0], err[0]
    assert captured.out == ""
    assert [p.name for p in in_tmp.iterdir()] == []


@pytest.mark.slow
def test_console_script_exit_code_on_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_ckpt", "profile", "nope.nothing:X"], cwd=tmp_path,
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("lightning-ckpt profile: error: model='nope.nothing:X'")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- the conclusions, pure


def _row(policy, mb, seq, act, state=1000, tps=1.0, acc=1, oom=False):
    return ProfileResult(name=f"{policy}_{mb}_{seq}_{acc}", policy=policy, micro_batch=mb, seq_len=seq, accumulate=acc,
                         tokens_per_step=mb * seq * acc, activations=None if oom else act,
                         model_state=None if oom else state, peak=None if oom else state + act,
                         tokens_per_sec=None if oom else tps, oom=oom)


def test_reading_flat_peak_means_activations_are_not_the_problem():
    rows = [_row("none", 1, 512, 10, state=10_000), _row("none", 2, 512, 20, state=10_000),
            _row("none", 1, 256, 5, state=10_000)]
    reading = read_slopes(rows, micro_batch=1, seq_len=512)
    assert reading["tokens"]["verdict"] == "flat"
    assert "activations are not the problem" in reading["text"][0]


def test_reading_growing_peak_and_quadratic_length():
    rows = [_row("none", 1, 1024, 4000), _row("none", 4, 1024, 16000), _row("none", 1, 256, 250),
            _row("none", 1, 512, 1000)]
    reading = read_slopes(rows, micro_batch=1, seq_len=1024)
    assert reading["tokens"]["verdict"] == "grows"
    assert "checkpointing" in reading["text"][0] and "credible" in reading["text"][0]
    assert reading["length"]["verdict"] == "quadratic" and reading["length"]["exponent"] == pytest.approx(2.0)
    assert "attention is materialized" in reading["text"][1]


def test_reading_linear_length_and_oom_rows_ignored():
    rows = [_row("none", 1, 256, 100), _row("none", 1, 512, 200), _row("none", 1, 1024, 0, oom=True)]
    reading = read_slopes(rows, micro_batch=1, seq_len=256)
    assert reading["length"]["verdict"] == "linear" and reading["length"]["exponent"] == pytest.approx(1.0)


def test_recommendation_is_fastest_that_fits():
    rows = [_row("none", 4, 128, 5000, tps=900), _row("all", 4, 128, 1000, tps=700), _row("all", 1, 128, 300, tps=400),
            _row("none", 1, 128, 1000, acc=4, tps=650), _row("none", 8, 128, 0, oom=True)]
    assert recommend(rows, budget=None)["name"] == rows[0].name
    assert recommend(rows, budget=2500)["name"] == rows[1].name
    assert recommend(rows, budget=1500)["name"] == rows[2].name
    nothing = recommend(rows, budget=100)
    assert nothing["name"] is None and "no configuration fits" in nothing["text"]


@pytest.mark.slow
def test_profile_measures_the_phase_peaks_and_marks_the_limiting_phase(in_tmp):
    """The forward, backward and optimizer peaks of each configuration (steady state: the optimizer state exists),
    the step's peak is the highest, and profile.md marks that phase."""
    report = profile(GPT, TINY, policies="none,all", micro_batches="4", seq_lens="32", steps=1, warmup=2,
                     accumulate=0, out=str(in_tmp / "p"), progress=False, tensorboard=False, plot=False)
    by = {r.policy: r for r in report.results}
    for r in report.results:
        assert set(r.phase_peaks) == {"forward", "backward", "optimizer"}
        assert r.peak == max(r.phase_peaks.values()) and r.peak_phase == max(r.phase_peaks, key=r.phase_peaks.get)
        # the optimizer step holds the model state (Adam's moments exist from the first step) and no activations
        assert r.phase_peaks["optimizer"] >= r.model_state
    assert by["none"].peak_phase == "forward"
    assert by["all"].phase_peaks["forward"] < by["none"].phase_peaks["forward"]
    md = (in_tmp / "p" / "profile.md").read_text()
    assert "◀" in md and "the phase that limits the configuration" in md
    peaks = [v for r in report.results for v in (r.peak, r.activations, *r.phase_peaks.values())]
    assert f"fwd peak {unit_for(max(peaks))[0]}" in md  # the unit of the table's largest value
    # each configuration's reference step, named: checkpointed blocks keep their inputs, one hidden-width tensor
    assert [b["hidden_tensors"] for b in by["all"].anatomy["per_block"]] == [1.0] * len(by["all"].anatomy[
        "per_block"])
    assert by["none"].anatomy["activation_peak"]["bytes"] == by["none"].activations


def _report(rows, device="cpu"):
    settings = dict(budget=None, capacity=None, accumulate=1, precision="32-true", warmup=2, steps=3, seq_len=32,
                    micro_batch=1, batch="example_batch", policies=["none"])
    return ProfileReport(model="m", device=device, settings=settings, results=rows, recommendation=None,
                         reading={})


@pytest.mark.parametrize("act, unit, cell", [(300 * 1024, "KiB", "300.0"), (5 * MiB, "MiB", "5.0"),
                                             (3 * 2**30, "GiB", "3.0")])
def test_the_profile_tables_print_bytes_in_the_unit_of_their_largest_value(act, unit, cell):
    """One unit per table, named in the column headers: a small model reads '300.0' under KiB, not '0.3' under MiB."""
    rows = [_row("none", 1, 32, act, state=act // 4), _row("all", 1, 32, act // 2, state=act // 4)]
    rows[0].phase_peaks = {"forward": act + act // 4, "backward": act, "optimizer": act // 2}
    report = _report(rows)
    t = table(report)
    headers = [c.header for c in t.columns]
    assert f"act. peak {unit}" in headers and f"est. peak {unit}" in headers and f"fwd peak {unit}" in headers
    assert list(t.columns[headers.index(f"act. peak {unit}")].cells)[0] == cell
    md = markdown(report)
    assert f"| act. peak {unit} |" in md and f"| {cell} |" in md
    other = {"KiB", "MiB", "GiB"} - {unit}
    assert not any(f"peak {u}" in md for u in other)
