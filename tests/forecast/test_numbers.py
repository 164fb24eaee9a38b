import json
import subprocess
import sys

import pytest

from lightning_ckpt.cli.main import main
from lightning_ckpt.forecast.numbers import ForecastInputs, forecast_from_numbers

GiB, MiB = 2**30, 2**20
SEED = ["plan", "--params", "1.3e9", "--param-dtype", "bf16", "--grad-dtype", "bf16", "--optimizer", "adam",
        "--moment-dtype", "fp32", "--master-dtype", "fp32", "--layers", "24", "--hidden", "2048",
        "--micro-batch", "2", "--seq-len", "2048", "--act-dtype", "bf16", "--capacity", "24GiB"]


def _seed_plan(**kw):
    inputs = ForecastInputs(params=1.3e9, master_dtype="fp32", micro_batch=2, capacity=24 * GiB, **kw)
    return forecast_from_numbers(inputs)


def test_reproduces_every_number_of_the_seed_example():
    plan = _seed_plan(tensors_per_block=6)
    assert round(plan.params / GiB, 2) == 2.42
    assert round(plan.grads / GiB, 2) == 2.42
    assert round(plan.optimizer / GiB, 2) == 9.69
    assert round(plan.master / GiB, 2) == 4.84
    assert round(plan.model_state / GiB, 1) == 19.4
    assert (plan.params, plan.optimizer, plan.master) == (2_600_000_000, 10_400_000_000, 5_200_000_000)
    assert plan.hidden_tensor == 16_777_216 == 16 * MiB
    assert plan.boundary_all == 384 * MiB
    assert plan.activations["none"] == 2304 * MiB  # 24 × 6 × 16 MiB = 2.25 GiB
    # boundaries, plus one block's interior while it replays: its input is one of the boundaries already
    assert plan.activations["all"] == 384 * MiB + 5 * 16 * MiB


def test_which_line_crosses_capacity():
    plan = _seed_plan()
    assert plan.crosses["none"] == "activations" and plan.fits["none"] is False
    assert plan.crosses["all"] is None and plan.fits["all"] is True
    big = forecast_from_numbers(ForecastInputs(params=7e9, master_dtype="fp32", capacity=24 * GiB))
    assert big.crosses["all"] == "gradients"  # 13.04 GiB of bf16 weights + 13.04 GiB of grads


def test_cli_table_and_json(capsys):
    assert main(SEED) == 0
    out = capsys.readouterr().out
    for text in ("line                         GiB", "2.42", "9.69", "4.84", "19.37", "16.0 MiB", "384.0 MiB",
                 "verdict (GiB; the highest phase decides)", "activations line crosses 24.00 GiB",
                 "fits, 1.25 GiB to spare", "fits, 4.00 GiB to spare"):
        assert text in out
    assert main(SEED + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("params", "grads", "optimizer", "master", "model_state", "capacity", "fits", "activations", "peak"):
        assert key in data
    assert data["params"] == 2_600_000_000 and data["capacity"] == 24 * GiB
    assert set(data["activations"]) == {"none", "every:2", "group:sqrt", "all"}


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--capacity", "24 parsecs"], "unknown unit"),
        (["--capacity", "24"], "needs a unit"),
        (["--param-dtype", "fp13"], "not a known dtype"),
        (["--optimizer", "adamq"], "not known"),
        (["--policies", "selective"], "cannot be predicted from numbers"),
        (["--layers", "0"], "positive"),
        (["--params", "1e308"], "--params=1e+308 is too large"),
        (["--tensors-per-block", "1e308"], "--tensors-per-block=1e+308 is too large"),
        (["--policies", ""], "--policies='' names no policy"),
        (["--policies", " , "], "names no policy"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, extra, words, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(SEED + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("lightning-ckpt plan: error:")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "lightning_ckpt"] + SEED + ["--json"], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out)["model_state"] == 20_800_000_000


def test_module_entry_point_in_process(monkeypatch, capsys):
    """``python -m lightning_ckpt`` without a new interpreter: the fast tier covers ``__main__`` too."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["lightning_ckpt", *SEED, "--json"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("lightning_ckpt", run_name="__main__")
    assert done.value.code == 0 and json.loads(capsys.readouterr().out)["model_state"] == 20_800_000_000


def test_phase_peaks_from_numbers_and_the_foreach_temporary():
    fused = _seed_plan()
    assert fused.phase_peaks["all"]["optimizer"] == fused.model_state  # a fused step holds no temporaries
    assert fused.phase_peaks["none"]["forward"] == fused.model_state + fused.activations["none"]
    foreach = _seed_plan(foreach=True)  # one fp32 sqrt(v) per parameter during the multi-tensor Adam step
    assert foreach.phase_peaks["all"]["optimizer"] == foreach.model_state + 1.3e9 * 4
    assert foreach.peak_phase["all"] == "optimizer" and foreach.fits["all"] is False
    assert foreach.crosses["all"] == "optimizer step's temporaries"


def test_every_n_replays_a_checkpointed_block_after_the_blocks_behind_it_are_freed():
    """every:N checkpoints blocks 0, N, 2N, ... Backward runs from the last block: when a checkpointed block replays,
    the blocks after it are freed, so its interior is added to the blocks up to it, not to all of them."""
    policies = ("none", "every:2", "every:23", "every:24", "all")
    plan = _seed_plan(policies=policies)
    boundary, interior = plan.hidden_tensor, plan.block_interior
    assert plan.activations["every:2"] == 12 * boundary + 12 * interior  # block 22 replays once block 23 is freed
    assert round(plan.activations["every:2"] / GiB, 2) == 3.38
    assert plan.activations["every:24"] == boundary + 23 * interior < plan.activations["none"]
    # every:23 checkpoints the last block too: its replay comes with every block before it still kept (the first
    # a boundary), its own input a boundary that the replayed interior does not count twice
    assert plan.activations["every:23"] == boundary + 22 * interior + interior
    assert plan.activations["all"] == 23 * boundary + interior
    assert plan.activations["none"] == 24 * interior


def test_the_foreach_help_says_one_parameter_sized_temporary(capsys):
    """torch's multi-tensor Adam step holds one parameter-sized temporary in total (sqrt of the second moment for
    every parameter at once), as the forecast counts it: not one per moment."""
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "one parameter-sized temporary" in text and "per moment" not in text


def test_plan_model_refuses_a_length_past_the_models_learned_positions(capsys):
    """GPT-2's position table has n_positions rows: a longer sequence fails on the real step (an index past the
    table), so the forecast refuses it naming the limit, before tracing anything."""
    gpt2 = ["plan", "--model", "lightning_ckpt.demos.factories:gpt2_config", "--policies", "none"]
    assert main(gpt2 + ["--seq-len", "2048"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len=2048" in err and "128 positions" in err and "--seq-len 128" in err
    assert main(gpt2 + ["--seq-len", "256", "--init-args", '{"n_positions": 256}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["activations"]["none"] > 0


@pytest.mark.parametrize("config", ["tiny", "benchmark"])
def test_adafactor_from_numbers_is_its_factored_state(config):
    """torch.optim.Adafactor keeps a matrix's second moment as a row and a column vector (r + c values, not r·c)
    and a vector's in full: the demo GPT's real state, measured after a step, against the numbers route."""
    import torch

    from lightning_ckpt.demos.gpt import GPT, GPTConfig
    from lightning_ckpt.measure.ledger import model_state_bytes

    cfg = getattr(GPTConfig, config)()
    model = GPT(cfg)
    opt = torch.optim.Adafactor(model.parameters())
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    model(idx, idx)[1].backward()
    opt.step()
    real = model_state_bytes(model, opt).optimizer
    n = sum(p.numel() for p in model.parameters())
    plan = forecast_from_numbers(ForecastInputs(params=n, optimizer="adafactor", layers=cfg.n_layer,
                                                hidden=cfg.n_embd, param_dtype="fp32", grad_dtype="fp32"))
    assert plan.optimizer == pytest.approx(real, rel=0.03)
    assert plan.optimizer < n  # under a byte per parameter, where one full fp32 moment is four


def test_plan_takes_the_model_from_a_config_that_names_its_class_path(tmp_path, capsys):
    """The LightningCLI-style YAML ``profile --config`` accepts (model.class_path and init_args, a data section)
    plans without --model; --params with it is still refused."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model:\n  class_path: lightning_ckpt.demos.lightning_gpt.GPTLightningModule\n  init_args:\n"
                   "    n_layer: 2\n    n_embd: 32\n    n_head: 2\n    block_size: 32\n"
                   "data:\n  class_path: lightning_ckpt.demos.lightning_gpt.CharDataModule\n")
    assert main(["plan", "--config", str(cfg), "--seq-len", "32", "--policies", "none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blocks"] == 2 and data["activations"]["none"] > 0
    assert main(["plan", "--config", str(cfg), "--params", "1e9"]) == 2
    assert "only applies with --model" in capsys.readouterr().err


def test_the_vocabulary_adds_the_head_to_every_policys_forward_end(capsys):
    """``--vocab-size`` counts what the forward holds after the blocks: the final norm's input and output and two
    logits-sized tensors (the logits and the loss's log-softmax); a bad value is refused with the fix."""
    blocks = _seed_plan(policies=("none", "all"))
    headed = _seed_plan(policies=("none", "all"), vocab=32000)
    logits = 2 * 2048 * 32000 * 2
    head = 2 * blocks.hidden_tensor + 2 * logits
    assert headed.activations["none"] == blocks.activations["none"] + head
    # with every block checkpointed, the forward's end (boundaries and the head) outweighs one block's replay
    assert headed.activations["all"] == 24 * blocks.hidden_tensor + head > blocks.activations["all"]
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="--vocab-size=.*positive whole number"):
            ForecastInputs(params=1e9, vocab=bad)
    assert main([*SEED, "--vocab-size", "32000", "--policies", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["activations"]["none"] == headed.activations["none"]
