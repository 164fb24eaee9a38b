"""``benchmarks/gpu_check.py``, the prepared GPU check: it must start on the lent machine as it is, so its driver and
every part's code path are exercised here on the CPU (``--smoke-cpu``: tiny sizes, CUDA-only verdicts informative)."""

from __future__ import annotations

import json
import os
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
    log = (tmp_path / "gpu_check.log").read_text()
    assert "torch " + torch.__version__ in log and "CHECK rng" in log and "parts PASS" in log
