"""The examples run end to end (short runs) and print what they checkpointed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("script, block", [("train_gpt.py", "Block"), ("hf_model.py", "GPT2Block")])
def test_example_trains_and_reports_its_plan(tmp_path, script, block):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--max-steps", "4", "--logdir", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "policy 'every:2', 3/6 blocks checkpointed" in out.stdout and f"× {block} at" in out.stdout
    # the validation metrics the demo modules log (torchmetrics objects), printed at the end
    final = next(line for line in out.stdout.splitlines() if line.startswith("final metrics:"))
    assert all(f"{key}=" in final for key in ("train_loss", "val_loss", "val_ppl", "val_acc")), final
    assert any(tmp_path.rglob("events.out.tfevents.*"))
