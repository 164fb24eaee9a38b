import json

import pytest

from lightning_ckpt.cli.main import main
from lightning_ckpt.forecast.numbers import ForecastInputs, forecast_from_numbers
from lightning_ckpt.forecast.remedies import (
    Layout,
    Remedy,
    deepspeed_zero2_reference,
    deepspeed_zero3_reference,
    lora_fraction,
    price,
    recommend,
    remedies,
)

GiB = 2**30
P = 1.3e9
STATE = ("parameters", "gradients", "optimizer state", "master copy")
SEED = ["plan", "--params", "1.3e9", "--master-dtype", "fp32", "--micro-batch", "2", "--capacity", "16GiB"]


def _seed(**kw) -> ForecastInputs:
    return ForecastInputs(params=P, master_dtype="fp32", micro_batch=2, capacity=16 * GiB, **kw)


def _state(row: Remedy) -> int:
    return sum(row.lines[k] for k in STATE)


def test_the_seeds_example_at_16_gib_no_row_that_keeps_its_model_state_fits():
    rows = remedies(_seed())
    kept = [r for r in rows if _state(r) == 20_800_000_000]  # 19.4 GiB: 2.42 + 2.42 + 9.69 + 4.84
    assert round(_state(kept[0]) / GiB, 1) == 19.4
    names = {r.name for r in kept}
    assert {"none", "every:2", "all", "activation offload", "zero gradients before forward"} <= names
    assert not any(r.fits for r in kept)
    assert any(r.fits for r in rows)


def test_an_8_bit_adam_state_is_about_2_03_bytes_per_parameter():
    row = price(_seed(), Layout("8-bit", moment_bytes=2 * (1 + 4 / 256)))
    assert row.lines["optimizer state"] == round(P * 2.03125)
    assert round(row.lines["optimizer state"] / P, 2) == 2.03
    assert round(row.lines["optimizer state"] / GiB, 2) == 2.46  # 9.69 GiB of fp32 moments down to 2.46


def test_zeroing_gradients_before_the_forward_takes_them_off_the_forward_peak():
    base, zero = price(_seed(), Layout("none")), price(_seed(), Layout("zero", zero_grad_before_forward=True))
    assert base.phases["forward"] - zero.phases["forward"] == 2_600_000_000  # the seed's 2.42 GiB of gradients
    assert round((base.phases["forward"] - zero.phases["forward"]) / GiB, 2) == 2.42
    assert zero.phases["backward"] == base.phases["backward"] and not zero.changes_training
    # under accumulation the later micro-batches' forwards hold this step's gradients anyway
    acc = price(_seed(), Layout("acc", accumulation=2, zero_grad_before_forward=True))
    assert acc.phases["forward"] == price(_seed(), Layout("acc", accumulation=2)).phases["forward"]


def test_each_row_has_its_ledger_phases_verdict_cost_and_changes():
    rows = remedies(_seed())
    names = [r.name for r in rows]
    for wanted in ("none", "every:2", "all", "micro-batch 1 × 2 accumulated", "bf16 moments", "no master copy",
                   "8-bit optimizer state", "4-bit optimizer state", "Adafactor (factored)", "LoRA rank 16",
                   "QLoRA rank 16", "optimizer-state offload", "activation offload", "zero gradients before forward"):
        assert wanted in names
    for prefix in ("FSDP2 × ", "ZeRO-2 × ", "ZeRO-3 × "):
        assert any(n.startswith(prefix) for n in names)
    for row in rows:
        assert row.peak == max(row.phases.values()) and row.fits == (row.peak <= 16 * GiB)
        assert set(row.cost) == {"recompute", "host_device_bytes", "communicated_bytes", "gpus_added",
                                 "micro_batches"}
        assert row.changes_training == bool(row.changes)
    by = {r.name: r for r in rows}
    assert by["every:2"].cost["recompute"] == 0.5 and by["all"].cost["recompute"] == 1.0
    assert by["optimizer-state offload"].cost["host_device_bytes"] == 2_600_000_000 * 2  # grads down, params up
    assert by["8-bit optimizer state"].changes_training and not by["micro-batch 1 × 2 accumulated"].changes_training


def test_a_combination_fits_where_the_remedy_alone_does_not():
    by = {r.name: r for r in remedies(_seed())}
    assert by["8-bit optimizer state"].fits is False
    combo = [r for n, r in by.items() if n.startswith("8-bit optimizer state + ")]
    assert len(combo) == 1 and combo[0].fits and "every:2" in combo[0].name


def test_the_two_recommendations_are_the_cheapest_rows_that_fit():
    rows = remedies(_seed())
    keep, any_ = recommend(rows)
    assert keep.fits and not keep.changes_training and _state(keep) < 20_800_000_000
    assert all(keep.price_key() <= r.price_key() for r in rows if r.fits and not r.changes_training)
    assert all(any_.price_key() <= r.price_key() for r in rows if r.fits)
    roomy = remedies(ForecastInputs(params=P, master_dtype="fp32", micro_batch=2, capacity=80 * GiB))
    free = recommend(roomy)[0]  # what fits as it is costs nothing; a tie goes to the lower peak
    assert free.name == "zero gradients before forward" and free.cost["recompute"] == 0
    assert free.peak < next(r for r in roomy if r.name == "none").peak


def test_lora_counts_gradients_and_state_for_its_adapters_only():
    share = lora_fraction(16, 24, 2048, P)
    row = price(_seed(), Layout("LoRA", trainable=share, changes=("trainable",)))
    assert row.lines["gradients"] == round(share * P * 2)
    assert row.lines["optimizer state"] == round(share * P * 8) and row.lines["master copy"] == round(share * P * 4)
    assert row.lines["parameters"] == round(P * 2 + share * P * 2)  # the frozen model and its adapters
    assert row.lines["activations"] == price(_seed(), Layout("none")).lines["activations"]


@pytest.mark.parametrize("gpus", range(1, 9))
def test_zero2_and_zero3_against_deepspeeds_published_estimators(gpus):
    """DeepSpeed's estimate_zero2_model_states_mem_needs (4·P + 16·P/N) and estimate_zero3_model_states_mem_needs
    (4·largest_layer + 18·P/N), no offload, bf16 weights with fp32 moments and master copy: ZeRO-2 here holds the bf16
    gradient partition (2·P/N) where the estimator counts every bf16 gradient (2·P); ZeRO-3 here adds the bf16
    gradient partition the estimator leaves out, and takes one block as the largest layer."""
    inputs = ForecastInputs(params=P, master_dtype="fp32")
    z2 = price(inputs, Layout("z2", strategy="deepspeed_stage_2", world_size=gpus))
    assert _state(z2) + 2 * P - 2 * P / gpus == pytest.approx(deepspeed_zero2_reference(P, gpus), abs=8)
    z3 = price(inputs, Layout("z3", strategy="deepspeed_stage_3", world_size=gpus))
    block = 12 * 2048**2 + 13 * 2048
    in_flight_forward = z3.phases["forward"] - z3.lines["activations"] - _state(z3)
    assert in_flight_forward == 4 * block
    assert _state(z3) + in_flight_forward - 2 * P / gpus == pytest.approx(
        deepspeed_zero3_reference(P, block, gpus), abs=8)
    # with offload (Lightning's deepspeed_stage_2_offload / _3_offload): the bf16 weights, or the gathered blocks
    z2o = price(inputs, Layout("z2o", strategy="deepspeed_stage_2_offload", world_size=gpus))
    assert _state(z2o) == deepspeed_zero2_reference(P, gpus, cpu_offload=True)
    z3o = price(inputs, Layout("z3o", strategy="deepspeed_stage_3_offload", world_size=gpus))
    assert _state(z3o) == 0 and z3o.lines["host"] > 0
    assert z3o.phases["forward"] - z3o.lines["activations"] == deepspeed_zero3_reference(P, block, gpus,
                                                                                        cpu_offload=True)


def test_fsdp_and_ddp_per_gpu():
    inputs = ForecastInputs(params=P, master_dtype="fp32")
    fsdp = price(inputs, Layout("fsdp", strategy="fsdp", world_size=4))
    assert fsdp.lines["parameters"] == 650_000_000 and fsdp.lines["optimizer state"] == 2_600_000_000
    assert fsdp.lines["activations"] == price(inputs, Layout("one")).lines["activations"]  # each rank's own
    assert fsdp.cost["communicated_bytes"] == round(0.75 * (2 * 2.6e9 + 2.6e9)) and fsdp.cost["gpus_added"] == 3
    ddp = price(inputs, Layout("ddp", strategy="ddp", world_size=2))
    assert ddp.lines["in flight"] == 2_600_000_000  # its buckets: one more gradient-sized buffer
    assert ddp.cost["communicated_bytes"] == 2_600_000_000  # all-reduce: 2·(N−1)/N·G
    off = price(inputs, Layout("off", strategy="deepspeed_stage_2_offload", world_size=2))
    assert off.lines["optimizer state"] == 0 and off.lines["host"] > 0


def test_zero_1_and_the_offload_forms_per_gpu():
    """ZeRO-1 shards the optimizer state and master copy only: the gradients stay whole on every GPU, plus the fp32
    partition an fp32 master copy needs (T·4/N); with offload only that partition, the state and the master copy
    leave the GPU (the whole gradients stay: stage 1 does not partition them). FSDP2 with offload keeps nothing of
    the model state on the GPU between steps."""
    inputs = ForecastInputs(params=P, master_dtype="fp32")
    one = price(inputs, Layout("one")).lines
    stage1 = price(inputs, Layout("z1", strategy="deepspeed_stage_1", world_size=4))
    assert stage1.lines["parameters"] == one["parameters"]
    assert stage1.lines["optimizer state"] == one["optimizer state"] / 4
    assert stage1.lines["master copy"] == one["master copy"] / 4
    assert stage1.lines["gradients"] == one["gradients"] + 4 * P / 4
    off1 = price(inputs, Layout("z1o", strategy="deepspeed_stage_1_offload", world_size=4))
    assert off1.lines["gradients"] == one["gradients"]
    assert off1.lines["optimizer state"] == off1.lines["master copy"] == 0
    assert off1.lines["host"] == (one["optimizer state"] + one["master copy"] + 4 * P) / 4
    assert off1.phases["backward"] >= off1.lines["parameters"] + off1.lines["gradients"]
    fsdp_off = price(inputs, Layout("fo", strategy="fsdp_offload", world_size=4))
    assert all(fsdp_off.lines[k] == 0 for k in ("parameters", "gradients", "optimizer state", "master copy"))
    assert fsdp_off.lines["host"] == (one["parameters"] + one["gradients"] + one["optimizer state"]
                                      + one["master copy"]) / 4


def test_fsdp2_holds_two_blocks_unsharded_in_the_forward_and_one_blocks_gradients_more_in_backward():
    from lightning_ckpt.forecast.remedies import Job

    job = Job.from_numbers(ForecastInputs(params=P, master_dtype="fp32"))
    gathered = job.block_params * job.param_bytes
    for world in (2, 4):
        row = price(job, Layout("fsdp", strategy="fsdp", world_size=world))
        held = sum(row.lines[k] for k in ("parameters", "gradients", "optimizer state", "master copy", "activations"))
        assert row.phases["forward"] - held == pytest.approx(2 * gathered, abs=4)  # the running and prefetched block
        assert row.lines["parameters"] == pytest.approx(job.params * job.param_bytes / world, abs=1)


@pytest.mark.parametrize("strategy, sharded", [("ddp", ""), ("deepspeed_stage_1", "o"), ("deepspeed_stage_2", "go"),
                                               ("deepspeed_stage_3", "pgo"), ("fsdp", "pgo")])
def test_plan_model_lays_each_strategy_out_per_rank(strategy, sharded, capsys):
    """With --model, each rank's lines are the traced model's, divided by the world size where the strategy shards
    them (an fp32 model: no master copy, so no fp32 gradient partition)."""
    assert main(["plan", "--model", "lightning_ckpt.demos.factories:tiny_gpt", "--seq-len", "32", "--policies",
                 "none", "--strategy", strategy, "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lines = data["per_rank"]["none"]["lines"]
    for line, key, letter in (("parameters", "params", "p"), ("gradients", "grads", "g"),
                              ("optimizer state", "optimizer", "o")):
        assert lines[line] == pytest.approx(data[key] / (2 if letter in sharded else 1), abs=2), line
    assert lines["activations"] == data["activations"]["none"]  # each rank's own micro-batch


def test_cli_remedies_json_and_table(capsys):
    assert main(SEED + ["--remedies", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"remedies", "recommended", "recommended_any"} <= set(data)
    for row in data["remedies"]:
        assert {"name", "lines", "peak", "fits", "cost", "changes_training"} <= set(row)
    names = [r["name"] for r in data["remedies"]]
    assert data["recommended"] in names and data["recommended_any"] in names
    assert main(SEED + ["--remedies"]) == 0
    out = capsys.readouterr().out
    assert "try first (fits, training unchanged): " in out and "cheapest that fits at all: " in out
    assert "zero gradients before forward" in out
    assert "how: ActivationCheckpointing(zero_grad_before_forward=True)" in out  # the callback's option
    assert "how: bitsandbytes.optim.AdamW8bit or torchao.optim.AdamW8bit" in out


def test_cli_strategy_per_gpu(capsys):
    assert main(SEED + ["--strategy", "fsdp", "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["per_rank"]["none"]["lines"]["parameters"] == 650_000_000
    assert main(SEED + ["--strategy", "deepspeed_stage_3_offload", "--world-size", "2"]) == 0
    assert "per GPU, deepspeed_stage_3_offload over 2 GPU(s)" in capsys.readouterr().out


@pytest.mark.parametrize("extra, words", [
    (["--world-size", "0", "--strategy", "fsdp"], "--world-size=0"),
    (["--world-size", "4"], "pass --strategy"),
    (["--remedies", "--trainable", "2"], "--trainable=2.0"),
    (["--remedies", "--lora-rank", "0"], "--lora-rank=0"),
    (["--lora-rank", "8"], "--lora-rank=8 prices the LoRA rows of --remedies; add --remedies"),
    (["--trainable", "0.01"], "--trainable=0.01 prices the LoRA rows"),
])
def test_bad_rank_input_is_refused_naming_the_value(extra, words, capsys):
    assert main(SEED + extra) == 2
    assert words in capsys.readouterr().err


def test_backward_from_numbers_frees_the_previous_gradients_first():
    """Lightning calls zero_grad between training_step and backward: backward starts without the previous step's
    gradients and builds them while it frees activations, so its peak is below the forward's."""
    plan = forecast_from_numbers(_seed())
    static = plan.model_state - plan.grads
    assert plan.phase_peaks["none"]["backward"] < plan.phase_peaks["none"]["forward"]
    assert plan.phase_peaks["all"]["backward"] == static + plan.grads  # ends with every gradient built


def _frozen_embedding_gpt():
    from lightning_ckpt.demos.factories import tiny_gpt

    model = tiny_gpt()
    for name, p in model.named_parameters():
        if "wte" in name or "wpe" in name:
            p.requires_grad_(False)
    return model


def test_remedies_from_a_traced_model_keep_its_measured_phases_and_read_its_trainable_share():
    """plan --model: the job's own rows are the trace's phases exactly; zeroing gradients early takes the traced
    gradients off the forward; a model that already freezes part of itself prices LoRA at its own share."""
    from lightning_ckpt.forecast.remedies import Job
    from lightning_ckpt.forecast.trace import forecast_model

    forecast = forecast_model(_frozen_embedding_gpt, micro_batch=2, seq_len=32, policies=("none", "all"))
    job = Job.from_forecast(forecast)
    n = forecast.num_params
    assert job.trainable == pytest.approx(forecast.grads / forecast.params) and 0.3 < job.trainable < 1
    none = price(job, Layout("none"))
    assert none.phases == forecast.phase_peaks["none"]
    assert _state(none) == forecast.model_state and none.lines["activations"] == forecast.activations["none"]
    zero = price(job, Layout("zero", zero_grad_before_forward=True))
    assert none.phases["forward"] - zero.phases["forward"] == forecast.grads
    lora = next(r for r in remedies(job) if r.name.startswith("LoRA"))
    assert lora.lines["gradients"] == pytest.approx(forecast.grads, rel=1e-6)
    assert lora.layout["trainable"] == pytest.approx(job.trainable) and n > 0


def test_cli_remedies_and_strategy_with_a_model(capsys):
    model = ["plan", "--model", "lightning_ckpt.demos.factories:tiny_gpt", "--seq-len", "32", "--policies", "all",
             "--capacity", "1GiB"]
    assert main(model + ["--remedies", "--strategy", "fsdp", "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["remedies"][0]["name"] == "none" and data["recommended"] == data["recommended_any"]
    assert data["per_rank"]["all"]["lines"]["parameters"] == data["params"] // 2


_FSDP2_RANKS = r'''
import json, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_ckpt.demos.factories import tiny_gpt
    from lightning_ckpt.measure.ledger import model_state_bytes
    from lightning_ckpt.measure.meter import StepMeter
    torch.manual_seed(0)
    model = tiny_gpt()
    if os.environ["STRATEGY"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 96, (2, 32))
    meter = StepMeter("cpu", model=model)
    with meter.step(exact=True) as box:
        wrapped(idx, idx)[1].backward()
    opt.step()
    state = model_state_bytes(model, opt)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(dict(params=state.params, grads=state.grads, optimizer=state.optimizer,
                       activations=box.reading.activations), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), sys.argv[2]), nprocs=int(sys.argv[1]))
'''


@pytest.mark.slow
@pytest.mark.parametrize("strategy, world", [("fsdp", 2), ("fsdp", 4), ("ddp", 2)])
def test_each_rank_holds_what_the_plan_says_under_fsdp2_and_ddp_on_gloo(tmp_path, strategy, world):
    """``fully_shard`` on every block and the root (or ``DistributedDataParallel``), AdamW, one step on ``world``
    gloo processes: each rank's parameters, gradients and optimizer state (the ledger's walk: DTensors as their
    local shards) and its activations (the meter's, unsharded parameters in flight not among them) within 2 % of
    the plan's for that strategy."""
    import os
    import socket
    import subprocess
    import sys

    from lightning_ckpt.forecast.remedies import Job
    from lightning_ckpt.forecast.trace import forecast_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ranks.py"
    script.write_text(_FSDP2_RANKS)
    env = {**os.environ, "PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "STRATEGY": strategy}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), str(world), str(tmp_path / "rank")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from lightning_ckpt.demos.factories import tiny_gpt

    job = Job.from_forecast(forecast_model(tiny_gpt, micro_batch=2, seq_len=32, policies=("none",),
                                           optimizer="adamw"))
    plan = price(job, Layout(strategy, strategy=strategy, world_size=world)).lines
    for rank in range(world):
        got = json.loads((tmp_path / f"rank.{rank}").read_text())
        assert got["params"] == pytest.approx(plan["parameters"], rel=0.02)
        assert got["grads"] == pytest.approx(plan["gradients"], rel=0.02)
        assert got["optimizer"] == pytest.approx(plan["optimizer state"] + plan["master copy"], rel=0.02)
        assert got["activations"] == pytest.approx(plan["activations"], rel=0.02)


def test_a_traced_models_width_is_read_in_the_dtype_its_activations_run_in():
    """--param-dtype bf16 without autocast: the activations are bf16, so one hidden-width tensor of 2 x 32 tokens
    is 2 bytes a value (the width was read as half the model's with 4)."""
    from lightning_ckpt.demos.factories import tiny_gpt
    from lightning_ckpt.forecast.remedies import Job
    from lightning_ckpt.forecast.trace import forecast_model

    for dtype in (None, "bf16"):
        job = Job.from_forecast(forecast_model(tiny_gpt, micro_batch=2, seq_len=32, policies=("none",),
                                               param_dtype=dtype))
        assert job.hidden == tiny_gpt().config.n_embd
