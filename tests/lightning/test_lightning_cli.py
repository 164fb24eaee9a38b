"""Any LightningCLI script takes the plugin from flags or YAML alone; ``cli_script.py`` has no plugin code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lightning_ckpt

SCRIPT = Path(__file__).parents[1] / "cli_script.py"


def _class_path(name: str, module: str) -> str:
    """``lightning_ckpt.<name>`` once the package exports it, the defining module's path until then."""
    return f"lightning_ckpt.{name}" if hasattr(lightning_ckpt, name) else f"lightning_ckpt.{module}.{name}"


CALLBACK = _class_path("ActivationCheckpointing", "callback")
DDP_AC = _class_path("DDPActivationCheckpointingStrategy", "strategy")


def _run_cli(tmp_path, *args) -> dict:
    report = tmp_path / "report.json"
    env = dict(os.environ, LIGHTNING_CKPT_REPORT=str(report))
    cmd = [
        sys.executable,
        str(SCRIPT),
        "fit",
        "--trainer.max_steps=2",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.n_samples=16",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(report.read_text())


def _saved_config(tmp_path) -> dict:
    return yaml.safe_load((tmp_path / "config.yaml").read_text())


@pytest.mark.slow
def test_callback_from_flags(tmp_path):
    report = _run_cli(tmp_path, f"--trainer.callbacks+={CALLBACK}", "--trainer.callbacks.policy=every:2")
    assert "ActivationCheckpointing" in report["callbacks"]
    assert report["plan"]["policy"] == "every:2"
    assert report["plan"]["modes"] == ["recompute", "off", "recompute", "off"]
    assert report["per_step"] == [[2, 1, 2, 1]] * 2  # checkpointed blocks ran twice per step
    assert report["summary"].startswith("lightning_ckpt plan for TinyTransformer: policy 'every:2', 2/4")
    saved = torch.load(report["ckpt_path"], weights_only=True)["callbacks"]["ActivationCheckpointing"]
    assert saved["policy"] == "every:2" and saved["modes"] == report["plan"]["modes"]
    (cb,) = [
        c
        for c in _saved_config(tmp_path)["trainer"]["callbacks"]
        if "ActivationCheckpointing" in c["class_path"]
    ]
    assert cb["init_args"]["policy"] == "every:2"  # the saved config replays the run


@pytest.mark.slow
def test_strategy_from_flags(tmp_path):
    report = _run_cli(tmp_path, f"--trainer.strategy={DDP_AC}", "--trainer.strategy.policy=selective")
    assert report["strategy"] == "DDPActivationCheckpointingStrategy"
    assert report["plan"]["policy"] == "selective" and report["plan"]["modes"] == ["selective"] * 4
    assert report["per_step"] == [[2, 2, 2, 2]] * 2
    assert _saved_config(tmp_path)["trainer"]["strategy"]["init_args"]["policy"] == "selective"


@pytest.mark.slow
def test_strategy_from_yaml(tmp_path):
    config = tmp_path / "ac.yaml"
    # unquoted on purpose: the policy grammar is plain YAML scalars
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        f"    class_path: {DDP_AC}\n"
        "    init_args:\n"
        "      policy: blocks:0,3\n"
        "      blocks: layers.*\n"
    )
    report = _run_cli(tmp_path, f"--config={config}")
    assert report["strategy"] == "DDPActivationCheckpointingStrategy"
    assert report["plan"]["modes"] == ["recompute", "off", "off", "recompute"]
    assert report["per_step"] == [[2, 1, 1, 2]] * 2


def _cli_in_process(args, capsys) -> tuple:
    from _lightning_models import TinyTransformer, TokenDataModule
    from lightning.pytorch.cli import LightningCLI

    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(TinyTransformer, TokenDataModule, args=args, trainer_defaults={"logger": False})
    out = capsys.readouterr()
    return exit_info.value.code, out.out + out.err


def test_help_shows_the_policy_strings(capsys):
    code, text = _cli_in_process(["fit", "--trainer.callbacks.help", CALLBACK], capsys)
    assert code == 0
    # None means 'all', or the bottom rung of the ladder with auto_threshold; the help says so
    assert "--trainer.callbacks.policy POLICY" in text and "default: null" in text and "``None``:" in text
    assert "every:N" in text or "every:2" in text  # the grammar is documented in the help
    assert "--trainer.callbacks.determinism_check {default,none}" in text

    code, text = _cli_in_process(["fit", "--trainer.strategy.help", DDP_AC], capsys)
    assert code == 0
    assert "--trainer.strategy.policy POLICY" in text
    assert "--trainer.strategy.find_unused_parameters" in text  # DDP's own arguments still reachable


def test_bad_policy_on_the_command_line_fails_before_training(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"Unknown policy 'evry:2'.*Did you mean 'every'"):
        from _lightning_models import TinyTransformer, TokenDataModule
        from lightning.pytorch.cli import LightningCLI

        LightningCLI(
            TinyTransformer,
            TokenDataModule,
            args=[
                "fit",
                f"--trainer.callbacks+={CALLBACK}",
                "--trainer.callbacks.policy=evry:2",
                f"--trainer.default_root_dir={tmp_path}",
            ],
            trainer_defaults={"logger": False},
        )


def test_every_argument_is_declared_once_and_reaches_the_callback_and_each_strategy(capsys):
    """The callback's and each ``*_ac`` strategy's arguments are one declaration (settings.Options): the same names,
    types and defaults, and LightningCLI's help shows each with its type, default and help, for the callback and for
    every strategy (the strategies' help said nothing per argument; their signatures were a copy)."""
    import inspect

    from lightning_ckpt import (
        ActivationCheckpointing,
        DDPActivationCheckpointingStrategy,
        FSDPActivationCheckpointingStrategy,
        SingleDeviceActivationCheckpointingStrategy,
    )
    from lightning_ckpt.lightning.settings import Options

    declared = {n: p for n, p in inspect.signature(Options.__init__, eval_str=True).parameters.items() if n != "self"}
    callback = inspect.signature(ActivationCheckpointing, eval_str=True).parameters
    assert {n: (p.annotation, p.default) for n, p in callback.items()} == \
        {n: (p.annotation, p.default) for n, p in declared.items()}
    for strategy in (SingleDeviceActivationCheckpointingStrategy, DDPActivationCheckpointingStrategy,
                     FSDPActivationCheckpointingStrategy):
        params = inspect.signature(strategy.__init__).parameters
        assert {n: (params[n].annotation, params[n].default) for n in declared} == \
            {n: (p.annotation, p.default) for n, p in declared.items()}, strategy

    helps = {}
    for flag, target in (("callbacks", CALLBACK), ("strategy", DDP_AC)):
        code, helps[flag] = _cli_in_process(["fit", f"--trainer.{flag}.help", target], capsys)
        assert code == 0
    for flag, text in helps.items():
        text = " ".join(text.split())  # argparse wraps the help lines
        for name in declared:
            assert f"--trainer.{flag}.{name} " in text, (flag, name)
        assert "steps of calm before stepping down, and the minimum dwell after a switch. (type: int, default: 20)" \
            in text, flag
        assert "free the previous step's gradients" in text, flag


def test_settings_replace_validates_the_changed_arguments_again():
    """``Settings.replace`` (what ``dataclasses.replace`` did when they were a dataclass; benchmarks/overhead.py
    toggles measurement with it): the other arguments kept, the new ones checked."""
    from lightning_ckpt import ActivationCheckpointing

    settings = ActivationCheckpointing(policy="every:2", cooldown=7).settings
    changed = settings.replace(measure=False, decide_every_n_steps=10**9)
    assert (changed.measure, changed.decide_every_n_steps, changed.cooldown) == (False, 10**9, 7)
    assert changed.start.spec == "every:2" and settings.measure is True
    with pytest.raises(ValueError, match="on_oom='retry' is not valid"):
        settings.replace(on_oom="retry")
    with pytest.raises(AttributeError, match="read-only"):
        settings.measure = False
    # a misspelt argument is named as the user called it
    with pytest.raises(TypeError, match=r"ActivationCheckpointing.__init__\(\) got an unexpected keyword argument"):
        ActivationCheckpointing(polcy="all")
