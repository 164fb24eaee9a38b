"""The ActivationCheckpointing callback inside real ``Trainer.fit`` runs (CPU, tiny Transformer)."""

from __future__ import annotations

import warnings
from unittest.mock import Mock

import pytest
import torch
from _lightning_models import CallRecorder, CountingBlock, CrashAt, TinyTransformer, params_of, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from lightning_ckpt.core.wrap import ForeignCheckpointingError, apply_policy, get_plan, remove_checkpointing
from lightning_ckpt.lightning.callback import ActivationCheckpointing

_OURS = ("lightning_ckpt", "reentrant", "requires_grad=True", "recompute")


def _ours(records) -> list:
    """Warnings from checkpointing (ours or torch.utils.checkpoint), not Lightning's own chatter."""
    return [str(w.message) for w in records if any(k in str(w.message) for k in _OURS)]


def _fit(model, callbacks, tmp_path, ckpt_path=None, **overrides):
    trainer = Trainer(callbacks=callbacks, **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


# ------------------------------------------------------------------------------------------- recompute


@pytest.mark.parametrize(
    ("build_in", "policy", "per_step"),
    [
        ("init", "all", [2, 2, 2, 2]),
        ("setup", "every:2", [2, 1, 2, 1]),
        ("configure_model", "blocks:1-2", [1, 2, 2, 1]),
    ],
)
def test_recompute_in_training_not_in_validation(tmp_path, build_in, policy, per_step):
    seed_everything(0)
    model = TinyTransformer(build_in=build_in)
    rec, cb = CallRecorder(), ActivationCheckpointing(policy=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, [cb, rec], tmp_path, val_check_interval=2)
    assert cb.plan is get_plan(model) and cb.plan.spec == policy
    assert rec.records["train"] == [per_step] * 4
    assert rec.records["sanity"] == [[1, 1, 1, 1]]
    assert len(rec.records["val"]) == 4 and all(r == [1, 1, 1, 1] for r in rec.records["val"])
    assert _ours(caught) == []  # no use_reentrant warning, nothing from the plugin


def test_validate_test_predict_never_recompute(tmp_path):
    model = TinyTransformer()
    rec = CallRecorder()
    trainer = Trainer(callbacks=[ActivationCheckpointing(), rec], **trainer_kwargs(tmp_path, max_steps=2))
    trainer.validate(model)
    assert get_plan(model) is None  # validate alone does not wrap
    trainer.fit(model)
    plan = get_plan(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(model)
        trainer.test(model, verbose=False)
        trainer.predict(model)
    assert get_plan(model) is plan
    for kind in ("val", "test", "predict"):
        assert rec.records[kind] and all(r == [1, 1, 1, 1] for r in rec.records[kind]), kind
    assert _ours(caught) == []


def test_fit_twice_and_refit_do_not_double_wrap(tmp_path):
    model = TinyTransformer()
    cb = ActivationCheckpointing()
    _fit(model, [cb], tmp_path, max_steps=2)
    plan, forwards = cb.plan, [layer.__dict__["forward"] for layer in model.layers]
    rec = CallRecorder()
    _fit(model, [cb, rec], tmp_path, max_steps=2)  # same callback, new Trainer
    assert cb.plan is plan and [layer.__dict__["forward"] for layer in model.layers] == forwards
    assert all(f.prior is None for f in forwards)  # our forward never wraps our forward
    assert rec.records["train"] == [[2, 2, 2, 2]] * 2

    other, rec2 = ActivationCheckpointing(policy="every:2"), CallRecorder()
    with pytest.warns(RuntimeWarning, match="re-targeting it to 'every:2'"):
        _fit(model, [other, rec2], tmp_path, max_steps=2)
    assert other.plan is plan and plan.spec == "every:2"
    assert rec2.records["train"] == [[2, 1, 2, 1]] * 2


def test_a_run_failing_before_strategy_setup_leaves_the_strategy_untouched(tmp_path):
    class Broken(TinyTransformer):
        def configure_model(self):
            raise RuntimeError("broken configure_model")

    cb = ActivationCheckpointing()
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=1))
    with pytest.raises(RuntimeError, match="broken configure_model"):
        trainer.fit(Broken())
    assert "setup" not in vars(trainer.strategy) and cb.plan is None  # the one-shot hook was removed
    model = TinyTransformer()
    Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=1)).fit(model)
    assert cb.plan is get_plan(model)


def test_policy_object_is_accepted_and_reported_as_its_string(tmp_path):
    from lightning_ckpt.core.policy import parse_policy

    cb = ActivationCheckpointing(policy=parse_policy("group:2"))
    model = TinyTransformer()
    _fit(model, [cb], tmp_path, max_steps=1)
    assert repr(cb) == "ActivationCheckpointing(policy='group:2')" and cb.state_dict()["policy"] == "group:2"


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "evry:2"}, ValueError, r"Unknown policy 'evry:2'.*Did you mean 'every'.*every:N"),
        ({"policy": "every:0"}, ValueError, r"every:0"),
        ({"policy": 3}, TypeError, r"policy=3"),
        ({"policy": "budget:0.5"}, ValueError, r"budget:0.5.*capacity='24GiB'"),  # a fraction needs a capacity on CPU
        ({"determinism_check": "sometimes"}, ValueError, r"'sometimes'.*\['default', 'none'\]"),
        ({"preserve_rng_state": "yes"}, TypeError, r"preserve_rng_state='yes'"),
        ({"blocks": 3}, TypeError, r"blocks=3.*class name"),
        ({"blocks": []}, ValueError, r"blocks=\[\]"),
        ({"compile_blocks": "yes"}, TypeError, r"compile_blocks='yes' must be True or False"),
    ],
)
def test_bad_arguments_raise_in_init(kwargs, error, match):
    with pytest.raises(error, match=match):
        ActivationCheckpointing(**kwargs)


def test_model_without_repeated_blocks_fails_before_training(tmp_path):
    model = BoringModel()
    before = params_of(model)
    with pytest.raises(ValueError, match=r"No repeated blocks found in BoringModel.*Pass `blocks=`"):
        _fit(model, [ActivationCheckpointing()], tmp_path)
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())  # no step was taken


def test_explicit_blocks_selector(tmp_path):
    model = BoringModel()
    cb = ActivationCheckpointing(blocks="layer")
    _fit(model, [cb], tmp_path, max_steps=1)
    assert cb.plan.names == ("layer",)
    with pytest.raises(ValueError, match=r"'layr' matched no module.*Closest paths: \['layer'\]"):
        _fit(BoringModel(), [ActivationCheckpointing(blocks="layr")], tmp_path, max_steps=1)


def test_two_instances_are_refused(tmp_path):
    with pytest.raises(
        RuntimeError, match="more than one stateful callback of type `ActivationCheckpointing`"
    ):
        Trainer(callbacks=[ActivationCheckpointing(), ActivationCheckpointing()], **trainer_kwargs(tmp_path))

    class Renamed(ActivationCheckpointing):  # a different state_key slips past Lightning's own check
        pass

    with pytest.raises(
        RuntimeError,
        match=r"configured 2 times: ActivationCheckpointing\(policy='all'\), "
        r"Renamed\(policy='every:2'\)",
    ):
        _fit(TinyTransformer(), [ActivationCheckpointing(), Renamed(policy="every:2")], tmp_path)


def _setup_with(strategy):
    cb = ActivationCheckpointing()
    trainer = Mock(callbacks=[cb], strategy=strategy)
    cb.setup(trainer, TinyTransformer(), "fit")


def test_fsdp_activation_checkpointing_policy_is_refused():
    # Lightning's FSDPStrategy needs a GPU to run; constructing it and calling the hook is enough (as in
    # Lightning's own tests_pytorch/strategies/test_fsdp.py::test_activation_checkpointing)
    with pytest.raises(RuntimeError, match="activation_checkpointing_policy.*recomputed twice"):
        _setup_with(FSDPStrategy(activation_checkpointing_policy={CountingBlock}))
    _setup_with(FSDPStrategy(auto_wrap_policy={CountingBlock}))  # sharding alone is fine


def test_deepspeed_activation_checkpointing_is_refused():
    strategy = Mock(spec=DeepSpeedStrategy)
    strategy.config = {
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False}
    }
    with pytest.raises(
        RuntimeError, match=r"DeepSpeed activation checkpointing.*\['partition_activations'\]"
    ):
        _setup_with(strategy)
    strategy.config = {
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False}
    }
    _setup_with(strategy)  # Lightning's default DeepSpeed config has the section with everything off


def test_model_checkpointed_by_another_library_is_refused(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = TinyTransformer()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    with pytest.raises(ForeignCheckpointingError, match="checkpoint_wrapper"):
        _fit(model, [ActivationCheckpointing()], tmp_path)


# -------------------------------------------------------------------------------- state and checkpoints


def _primitive(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _primitive(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_primitive(v) for v in x)
    return isinstance(x, (str, int, float, bool, type(None)))


def test_checkpoint_is_weights_only_and_loads_into_a_plain_model(tmp_path):
    model = TinyTransformer()
    _fit(
        model,
        [ActivationCheckpointing(policy="every:2"), ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        tmp_path,
        max_steps=2,
        enable_checkpointing=True,
    )
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    state = ckpt["callbacks"]["ActivationCheckpointing"]
    assert state == {
        "version": 1,
        "policy": "every:2",
        "plan_policy": "every:2",
        "names": ["layers.0", "layers.1", "layers.2", "layers.3"],
        "modes": ["recompute", "off", "recompute", "off"],
    }
    assert _primitive(state)

    plain = TinyTransformer.load_from_checkpoint(tmp_path / "last.ckpt", strict=True)
    assert get_plan(plain) is None
    torch.testing.assert_close(params_of(plain), params_of(model), rtol=0, atol=0)
    fresh = TinyTransformer()
    fresh.load_state_dict(ckpt["state_dict"], strict=True)

    # and the reverse: a checkpoint written without the plugin loads into a checkpointed model
    plain_model = TinyTransformer()
    _fit(
        plain_model,
        [ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True)],
        tmp_path,
        max_steps=2,
        enable_checkpointing=True,
    )
    wrapped = TinyTransformer()
    apply_policy(wrapped, "all")
    wrapped.load_state_dict(torch.load(tmp_path / "plain" / "last.ckpt", weights_only=True)["state_dict"])
    torch.testing.assert_close(params_of(wrapped), params_of(plain_model), rtol=0, atol=0)


class _Names(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        self.names = _module_names(pl_module)


def _module_names(model):
    return (
        list(model.state_dict()),
        [n for n, _ in model.named_parameters()],
        [n for n, _ in model.named_buffers()],
        [n for n, _ in model.named_modules()],
    )


def test_module_paths_identical_before_during_after(tmp_path):
    model = TinyTransformer()
    before = _module_names(model)
    spy = _Names()
    _fit(model, [ActivationCheckpointing(), spy], tmp_path, max_steps=1)
    assert spy.names == before
    assert _module_names(model) == before
    assert not any("_checkpoint_wrapped_module" in n for n in before[0])
    remove_checkpointing(model)
    assert _module_names(model) == before and get_plan(model) is None


# ------------------------------------------------------------------------------------------------- resume


class _SetModes(Callback):
    """Changes the per-block modes at a step, as a run-time controller would."""

    def __init__(self, step: int, modes) -> None:
        self.step, self.modes = step, list(modes)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            get_plan(pl_module).set_modes(self.modes)


_CUSTOM = ("recompute", "recompute", "off", "off")
_RESUME = dict(max_steps=8, limit_val_batches=0, num_sanity_val_steps=0)  # 4 steps per epoch


def _crashed_run(tmp_path):
    """Steps 0-5: a mode change at step 1, a checkpoint after step 4 (end of epoch 0), a crash at step 6.

    The checkpoint sits on the epoch boundary because Lightning replays a partial epoch from its first batch
    when resuming with a plain DataLoader, and treats a checkpoint saved in ``on_train_epoch_end`` as
    mid-epoch; only a step-based save at the boundary resumes on the batches an uninterrupted run sees.
    """
    seed_everything(0)
    model = TinyTransformer(n_samples=32)
    callbacks = [
        ActivationCheckpointing(policy="every:2"),
        _SetModes(1, _CUSTOM),
        CrashAt(6),
        ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4),
    ]
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, callbacks, tmp_path, enable_checkpointing=True, **_RESUME)
    return tmp_path / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """``last.ckpt`` of :func:`_crashed_run`, shared read-only by the resume tests."""
    return _crashed_run(tmp_path_factory.mktemp("crashed"))


def _uninterrupted_run(tmp_path):
    seed_everything(0)
    model = TinyTransformer(n_samples=32)
    trainer = _fit(
        model, [ActivationCheckpointing(policy="every:2"), _SetModes(1, _CUSTOM)], tmp_path, **_RESUME
    )
    return model, trainer


def _optimizer_state(trainer):
    return trainer.optimizers[0].state_dict()["state"]


def test_resume_after_crash_equals_uninterrupted_run(tmp_path, crashed):
    reference, ref_trainer = _uninterrupted_run(tmp_path / "a")
    last = crashed

    model, rec = TinyTransformer(n_samples=32), CallRecorder()
    cb = ActivationCheckpointing(policy="every:2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(model, [cb, rec], tmp_path / "c", ckpt_path=last, **_RESUME)
    assert _ours(caught) == []
    assert rec.modes_at_first_step == _CUSTOM  # the saved plan was in place before the first resumed step
    assert rec.records["train"] == [[2, 2, 1, 1]] * 4
    assert trainer.global_step == 8
    torch.testing.assert_close(params_of(model), params_of(reference), rtol=0, atol=0)
    torch.testing.assert_close(_optimizer_state(trainer), _optimizer_state(ref_trainer), rtol=0, atol=0)


def test_resume_into_a_model_that_already_holds_the_plan(tmp_path, crashed):
    last = crashed
    model, cb = TinyTransformer(n_samples=32), ActivationCheckpointing(policy="every:2")
    _fit(model, [cb], tmp_path / "first", max_steps=1)  # fit once: the plan now exists
    rec = CallRecorder()
    _fit(model, [cb, rec], tmp_path, ckpt_path=last, **_RESUME)  # restore comes before the re-targeting
    assert rec.modes_at_first_step == _CUSTOM
    _fit(model, [cb, rec], tmp_path / "again", max_steps=1)  # a later fit without ckpt_path starts fresh
    assert cb.plan.modes == ("recompute", "off", "recompute", "off")


def test_resume_with_a_different_policy_the_configured_one_wins(tmp_path, crashed):
    last = crashed
    rec = CallRecorder()
    with pytest.warns(
        UserWarning, match="trained with policy 'every:2'.*configured with 'all'.*configured policy wins"
    ):
        _fit(
            TinyTransformer(n_samples=32),
            [ActivationCheckpointing(policy="all"), rec],
            tmp_path,
            ckpt_path=last,
            **_RESUME,
        )
    assert rec.modes_at_first_step == ("recompute",) * 4
    assert rec.records["train"] == [[2, 2, 2, 2]] * 4


def test_resume_when_the_strategy_restores_after_setup(tmp_path, monkeypatch, crashed):
    last = crashed
    # the FSDP order: strategy.setup (model wrapped, plan applied) and on_fit_start come before the restore
    monkeypatch.setattr(SingleDeviceStrategy, "restore_checkpoint_after_setup", property(lambda self: True))
    model, rec = TinyTransformer(n_samples=32), CallRecorder()
    trainer = _fit(
        model, [ActivationCheckpointing(policy="every:2"), rec], tmp_path, ckpt_path=last, **_RESUME
    )
    assert trainer.strategy.restore_checkpoint_after_setup
    assert rec.modes_at_first_step == _CUSTOM
    assert rec.records["train"][0] == [2, 2, 1, 1]


def test_checkpoint_without_plugin_state_starts_fresh_and_the_reverse_warns(tmp_path, crashed):
    model = TinyTransformer(n_samples=32)
    _fit(
        model,
        [ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True)],
        tmp_path,
        enable_checkpointing=True,
        **dict(_RESUME, max_steps=4),
    )
    rec, cb = CallRecorder(), ActivationCheckpointing(policy="every:2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            TinyTransformer(n_samples=32),
            [cb, rec],
            tmp_path,
            ckpt_path=tmp_path / "plain" / "last.ckpt",
            **_RESUME,
        )
    assert _ours(caught) == []
    assert rec.modes_at_first_step == ("recompute", "off", "recompute", "off")

    last = crashed
    with pytest.warns(
        UserWarning, match=r"Please add the following callbacks: \[.*'ActivationCheckpointing'"
    ):
        _fit(TinyTransformer(n_samples=32), [], tmp_path, ckpt_path=last, **_RESUME)


def test_unreadable_or_unknown_state_warns():
    cb = ActivationCheckpointing()
    with pytest.warns(UserWarning, match="ignoring unreadable saved state"):
        cb.load_state_dict({"nonsense": 1})
    with pytest.warns(UserWarning) as caught:
        cb.load_state_dict({"version": 99, "policy": "all", "future_key": 1})
    assert any("version 99" in str(w.message) for w in caught)
    assert any("['future_key']" in str(w.message) for w in caught)
    assert cb.state_dict()["policy"] == "all"  # restored-but-not-applied state is kept, not dropped


# ------------------------------------------------------------------------------------------------ toggling


class _Toggle(Callback):
    def __init__(self, schedule) -> None:
        self.schedule = schedule

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.schedule:
            get_plan(pl_module).retarget(self.schedule[trainer.global_step])


def test_toggling_on_off_on_equals_a_run_without_the_plugin(tmp_path):
    kwargs = dict(max_steps=7, limit_val_batches=0, num_sanity_val_steps=0, deterministic=True)
    seed_everything(0)
    plain = TinyTransformer(dropout=0.1)
    _fit(plain, [], tmp_path, **kwargs)

    seed_everything(0)
    model, rec = TinyTransformer(dropout=0.1), CallRecorder()
    _fit(model, [ActivationCheckpointing(), _Toggle({3: "none", 5: "all"}), rec], tmp_path, **kwargs)
    assert [r[0] for r in rec.records["train"]] == [2, 2, 2, 1, 1, 2, 2]
    torch.testing.assert_close(params_of(model), params_of(plain), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ the report's folder


def _files(folder) -> list:
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


def test_without_a_logger_the_report_goes_under_default_root_dir_never_the_cwd(tmp_path, monkeypatch):
    """logger=False: the report JSON lands under trainer.default_root_dir, as Lightning's own files do; the current
    directory (elsewhere) gets nothing."""
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cb = ActivationCheckpointing()
    with pytest.warns(UserWarning, match="no logger"):
        _fit(TinyTransformer(), [cb], root, logger=False, max_steps=2, log_every_n_steps=1)
    assert (root / "lightning_ckpt_report.json").is_file()
    assert _files(cwd) == []


def test_with_a_logger_the_report_goes_beside_its_logs(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger, Logger

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _fit(TinyTransformer(), [ActivationCheckpointing()], tmp_path / "a", max_steps=2, log_every_n_steps=1,
         logger=CSVLogger(str(tmp_path / "logs"), name="run"))
    assert (tmp_path / "logs" / "run" / "version_0" / "lightning_ckpt_report.json").is_file()

    class NoDir(Logger):  # a logger that keeps no files (save_dir None): the report goes under default_root_dir
        name, version = "nodir", 0

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    _fit(TinyTransformer(), [ActivationCheckpointing()], tmp_path / "b", max_steps=2, log_every_n_steps=1,
         logger=NoDir())
    assert (tmp_path / "b" / "lightning_ckpt_report.json").is_file()
    assert _files(cwd) == []


# ------------------------------------------------------------------------------------ Hugging Face's use_cache


class _HFModule(TinyTransformer):
    """A LightningModule training a tiny Hugging Face GPT-2 (built from a config: nothing downloaded)."""

    def _build(self) -> None:
        if self.layers is not None:
            return
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=64,
                                         bos_token_id=0, eos_token_id=0)
        self.layers = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        ids = torch.randint(0, 64, (2, 16))
        return self.layers(input_ids=ids, labels=ids).loss


def test_the_use_cache_warning_through_the_trainer_points_at_the_users_fit_call(tmp_path):
    pytest.importorskip("transformers")
    model = _HFModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, [ActivationCheckpointing(policy="all")], tmp_path, max_steps=1, limit_val_batches=0,
             num_sanity_val_steps=0)
    ours = [w for w in caught if "use_cache=False" in str(w.message)]
    assert len(ours) == 1 and model.layers.config.use_cache is False
    assert ours[0].filename == __file__, ours[0].filename  # _fit's trainer.fit line: the user's, not Lightning's
