"""FSDP2 through Lightning's ``ModelParallelStrategy`` (``fully_shard`` per block, then the root, in
``configure_model``) on 2 CPU processes with gloo: every policy, the auto-toggle and the budget train, and the full
gradients (``full_tensor()``) equal the un-checkpointed run's under the same sharding, bitwise in float32;
``group:K`` over sharded blocks is refused before the first step. Also Lightning's FSDP1 (``fsdp_ac``): the
refusal on the CPU, training on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "fsdp2_script.py"
POLICIES = ("none", "all", "every:2", "selective", "offload", "auto", "budget:200KiB", "group:2")


def _run(tmp_path, policies, *extra) -> dict:
    out = tmp_path / "results.pt"
    from conftest import DISTRIBUTED_ENV

    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}  # rank 1 must be launched, not assumed
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--policies", ";".join(policies), "--out", str(out),
                           *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _assert_bitwise(results, policy, reference="none"):
    got, want = results[policy]["grads"], results[reference]["grads"]
    assert len(got) == len(want) > 0
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), f"{policy}: step {step} {name}"


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fsdp2"), POLICIES)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("none", "group:2")])
def test_every_policy_trains_sharded_with_the_gradients_of_the_plain_run(sharded_runs, policy):
    result = sharded_runs[policy]
    assert "error" not in result, result.get("error")
    _assert_bitwise(sharded_runs, policy)
    assert result["activations"] > 0
    if policy in ("all", "every:2", "selective", "offload"):
        assert result["spec"] == policy
    if policy == "auto":
        assert result["spec"] == "all"  # a 1-byte threshold: none -> every:2 -> all


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_group_regions_over_sharded_blocks_are_refused_before_the_first_step(sharded_runs):
    error = sharded_runs["group:2"].get("error", "")
    assert "ValueError" in error and "sharded by FSDP" in error and "layers.0" in error
    assert "policy='all' or 'every:N'" in error


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_plan_applied_before_sharding_and_accumulation(tmp_path):
    results = _run(tmp_path, ("none", "all"), "--plan-first", "--accumulate", "2")
    _assert_bitwise(results, "all")


def test_fsdp1_group_regions_are_refused_on_the_cpu():
    from unittest import mock

    from _lightning_models import TinyTransformer
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_ckpt.lightning.strategy import FSDPActivationCheckpointingStrategy

    strategy = FSDPActivationCheckpointingStrategy(policy="group:2")
    strategy._parallel_devices = [torch.device("cpu")]
    strategy.accelerator = mock.Mock()
    model = TinyTransformer()
    strategy.connect(model)
    trainer = mock.Mock(callbacks=[strategy.checkpointing], strategy=strategy, lightning_module=model,
                        state=mock.Mock(fn=TrainerFn.FITTING), world_size=1, accumulate_grad_batches=1)
    strategy.checkpointing.setup(trainer, model, "fit")
    with pytest.raises(ValueError, match=r"group:2.*sharded by FSDP.*layers\.0"):
        strategy.setup(trainer)
