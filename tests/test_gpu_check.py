"""``benchmarks/gpu_check.py``, the prepared GPU check: it must start on the lent machine as it is, so its driver and
every part's code path are exercised here on the CPU (``--smoke-cpu``: tiny sizes, CUDA-only verdicts informative).
The driver's own behaviour (budget, timeouts, kills, the summary written after every part) is tested with its hidden
``selftest`` parts, which need no torch and take seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(*args, timeout=60, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def _summary(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper counts as dead: it holds no memory or device)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _dies(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_non_zero_within_seconds(tmp_path):
    start = time.perf_counter()
    proc = _run(OUT=str(tmp_path))
    assert proc.returncode == 2 and time.perf_counter() - start < 30
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stdout + proc.stderr


def test_an_unknown_part_is_refused_naming_the_parts(tmp_path):
    proc = _run("--only", "rng,nope", OUT=str(tmp_path))
    assert proc.returncode == 2 and "nope" in proc.stderr and "rng" in proc.stderr and "oom" in proc.stderr
    assert "selftest" not in proc.stderr  # the driver's own test parts are not offered


def test_a_budget_that_is_not_positive_is_refused_naming_the_fix(tmp_path):
    proc = _run("--budget-s", "0", OUT=str(tmp_path))
    assert proc.returncode == 2 and "--budget-s 0.0: give a positive number of seconds" in proc.stderr


def test_the_core_parts_run_first_and_the_pytest_run_last_among_them():
    spec = importlib.util.spec_from_file_location("gpu_check_order", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    order = module._default_order()
    tiers = [module.PARTS[name].tier for name in order]
    core = tiers.count("core")
    assert tiers == ["core"] * core + ["rest"] * (len(order) - core) and order[core - 1] == "tests"
    assert module.PARTS["snapshot"].env == {"TORCH_SYMBOLIZE_MODE": "fast"}


def test_a_hung_part_is_killed_with_its_grandchild_at_the_budget_and_the_next_part_is_skipped(tmp_path):
    start = time.monotonic()
    proc = _run("--smoke-cpu", "--only", "selftest_hang,selftest", "--budget-s", "15", timeout=90, OUT=str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    hung, skipped = _summary(tmp_path)["parts"]
    # its own timeout is 60 s: the budget capped it, and the checks it finished before hanging are kept
    assert hung["part"] == "selftest_hang" and hung["verdict"] == "FAIL" and hung["seconds"] <= 15, hung
    assert hung["error"].startswith("timeout after") and [c["name"] for c in hung["details"]] == [
        "selftest before the hang"]
    assert skipped["part"] == "selftest" and skipped["verdict"] == "SKIP" and "--budget-s" in skipped["error"]
    assert _dies(int((tmp_path / "selftest_grandchild.pid").read_text()))
    log = (tmp_path / "gpu_check.log").read_text()
    assert "selftest: half a line" in log and "1 SKIP" in log  # a partial line is not lost
    assert time.monotonic() - start < 60


def test_a_part_whose_exit_would_hang_passes_as_soon_as_its_result_is_written(tmp_path):
    proc = _run("--smoke-cpu", "--only", "selftest", timeout=60, OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = _summary(tmp_path)["parts"]
    # its non-daemon thread would hold a normal exit until the part's 30 s timeout
    assert row["verdict"] == "PASS" and row["note"] is None and row["seconds"] < 20, row


def test_the_summary_is_written_after_every_part_and_a_stop_signal_keeps_it(tmp_path):
    driver = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke-cpu", "--only",
                               "selftest,selftest_hang", "--budget-s", "120", "--out", str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid_file = tmp_path / "selftest_grandchild.pid"
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid_file.exists(), "the hanging part never started"
        while (running := _summary(tmp_path))["running"] != "selftest_hang" and time.monotonic() < deadline:
            time.sleep(0.2)
        # while the second part runs, the first one's verdict is on disk already (an outer kill would keep it)
        assert [(r["part"], r["verdict"]) for r in running["parts"]] == [("selftest", "PASS")], running
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            driver.kill()
    summary = _summary(tmp_path)
    assert summary["interrupted"] == "SIGTERM" and summary["running"] is None
    assert [(r["part"], r["verdict"]) for r in summary["parts"]] == [("selftest", "PASS"), ("selftest_hang", "FAIL")]
    assert summary["parts"][1]["error"].startswith("interrupted by SIGTERM")
    assert _dies(int(pid_file.read_text()))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_part_runs_on_the_cpu_and_writes_the_log_and_the_summary(tmp_path):
    proc = _run("--smoke-cpu", timeout=880, OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = {row["part"]: row for row in summary["parts"]}
    assert set(parts) >= {"tests", "rng", "offload", "attention", "ledger", "oom", "budget", "fsdp2", "snapshot",
                          "compile", "seed", "overhead"}
    for name, row in parts.items():
        assert row["verdict"] == "PASS" and row["checks"] >= 1, (name, row)
    compile_checks = {c["name"]: c for c in parts["compile"]["details"]}
    # the compared step ran compiled (not an exact step, which runs eagerly) in the smoke too
    assert compile_checks["compile_blocks step 3 ran compiled (its reading is not an exact, eager step)"]["ok"]
    assert any(c["name"].startswith("rng control") for c in parts["rng"]["details"])
    log = (tmp_path / "gpu_check.log").read_text()
    assert "torch " + torch.__version__ in log and "CHECK rng" in log and "parts PASS" in log
