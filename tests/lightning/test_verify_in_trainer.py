"""verify=True in a real Trainer: it runs inside the precision plugin's autocast, with the plan being verified, block
by block (never two blocks' interiors alive at once), says which precision and plan it verified, raises on a block
that is unsafe only in the trained regime, and is refused under FSDP sharding."""

import pytest
import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import lightning_ckpt.lightning.verifying as verifying_module
from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.decide.verify import EquivalenceError


class Recorder:
    """What each block call saw, and whether verify made it (set around the engine's call of verify)."""

    def __init__(self, device_type="cpu"):
        self.device_type = device_type
        self.in_verify = False
        self.calls = []  # (in verify, autocast enabled, interiors of other calls alive)
        self.alive = []

    def note(self):
        live = [r for r in self.alive if not r.expired()]
        self.alive = live
        self.calls.append((self.in_verify, torch.is_autocast_enabled(self.device_type), len(live)))

    def keep(self, interior):
        self.alive.append(StorageWeakRef(interior.untyped_storage()))

    def verify_calls(self):
        return [c for c in self.calls if c[0]]


class RecordingBlock(nn.Module):
    """A pre-norm MLP block with dropout whose interior (8 x wider) is recorded."""

    def __init__(self, recorder, d=32, dropout=0.1):
        super().__init__()
        self.recorder = recorder
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 8 * d), nn.Linear(8 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        self.recorder.note()
        h = self.up(self.norm(x))
        self.recorder.keep(h)
        return x + self.drop(self.down(nn.functional.gelu(h)))


class RecordingModel(TinyTransformer):
    def __init__(self, recorder, block=RecordingBlock, **kw):
        self._recorder, self._block = recorder, block
        super().__init__(**kw)

    def _build(self):
        super()._build()
        self.layers = nn.ModuleList(self._block(self._recorder) for _ in range(4))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    original = verifying_module.verify_equivalence

    def recorded(*args, **kwargs):
        rec.in_verify = True
        try:
            return original(*args, **kwargs)
        finally:
            rec.in_verify = False

    monkeypatch.setattr(verifying_module, "verify_equivalence", recorded)
    return rec


@pytest.mark.parametrize("policy", ["all", "selective", "offload", "group:2", "every:2"])
def test_verify_runs_inside_the_precision_plugins_autocast_and_says_so(tmp_path, recorder, caplog, policy):
    cb = ActivationCheckpointing(policy=policy, verify=True)
    with caplog.at_level("INFO"):
        Trainer(**trainer_kwargs(tmp_path, max_steps=2, precision="bf16-mixed"),
                callbacks=[cb]).fit(RecordingModel(recorder))  # no EquivalenceError in bf16
    made = recorder.verify_calls()
    assert made and all(autocast for _, autocast, _ in made), made
    assert all(autocast for _, autocast, _ in recorder.calls)  # training's calls too
    assert "every checkpointed block agrees with its plain run" in caplog.text
    assert "precision 'bf16-mixed', autocast cpu bfloat16" in caplog.text
    assert f"plan {policy!r}" in caplog.text
    assert cb.plan.spec == policy  # the plan verified is the plan trained


@pytest.mark.parametrize("policy, most", [("all", 0), ("group:2", 1)])
def test_verify_never_holds_more_than_one_units_interior(tmp_path, recorder, policy, most):
    """A plain step holds all 4 interiors at its last block (3 others alive); verify runs one unit at a time: a
    block, or the 2 blocks of a group region (whose checkpointed backward holds both too)."""
    Trainer(**trainer_kwargs(tmp_path, max_steps=1), callbacks=[ActivationCheckpointing(policy=policy, verify=True)]
            ).fit(RecordingModel(recorder, dropout=0.0))
    made = recorder.verify_calls()
    assert made and max(alive for _, _, alive in made) == most


class AutocastOnlyCounterBlock(RecordingBlock):
    """Reads a Python counter that moves only under autocast: unsafe in the regime trained, safe outside it."""

    def __init__(self, recorder):
        super().__init__(recorder, dropout=0.0)
        self.count = 0

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            self.count += 1
        return super().forward(x) * (1 + self.count)


def test_verify_raises_on_a_block_unsafe_in_the_trained_precision(tmp_path, recorder):
    with pytest.raises(EquivalenceError, match="not replay-safe") as err:
        Trainer(**trainer_kwargs(tmp_path, max_steps=1, precision="bf16-mixed"),
                callbacks=[ActivationCheckpointing(policy="all", verify=True)]
                ).fit(RecordingModel(recorder, block=AutocastOnlyCounterBlock))
    assert "autocast cpu bfloat16" in str(err.value) and "layers.0" in str(err.value)


def test_verify_is_refused_under_fsdp_sharding(tmp_path, recorder, monkeypatch):
    model = RecordingModel(recorder)
    monkeypatch.setattr(verifying_module.conflicts, "is_fsdp_module", lambda m: m is model.layers[1])
    with pytest.raises(ValueError, match=r"verify the plan without FSDP.*'layers\.1' is sharded by FSDP"):
        Trainer(**trainer_kwargs(tmp_path, max_steps=1, num_sanity_val_steps=0),
                callbacks=[ActivationCheckpointing(policy="all", verify=True)]).fit(model)
    assert not recorder.calls  # refused before the first forward


def test_the_refusal_names_the_strategy_that_owns_the_checkpointing(tmp_path, recorder, monkeypatch):
    """A ``*_ac`` strategy names its callback's engine after making it: the message is read with the name then (the
    feature made with the engine kept the callback's name)."""
    from lightning_ckpt.lightning.strategy import SingleDeviceActivationCheckpointingStrategy

    model = RecordingModel(recorder)
    monkeypatch.setattr(verifying_module.conflicts, "is_fsdp_module", lambda m: m is model.layers[1])
    strategy = SingleDeviceActivationCheckpointingStrategy(policy="all", verify=True, device="cpu")
    with pytest.raises(ValueError, match=r"^SingleDeviceActivationCheckpointingStrategy\(verify=True\): verify the"):
        Trainer(strategy=strategy, **trainer_kwargs(tmp_path, max_steps=1, num_sanity_val_steps=0)).fit(model)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["all", "selective", "offload", "group:2"])
@pytest.mark.parametrize("attention", [False, True])
def test_verify_under_bf16_mixed_on_cuda(tmp_path, monkeypatch, caplog, policy, attention):
    """The real regime: CUDA autocast bf16 kernels, CUDA dropout, offload's host copies. With ``attention``, the
    blocks are TinyTransformer's ``nn.TransformerEncoderLayer`` (fused SDPA with dropout_p=0.1 in training, then a
    residual dropout): a failure there under 'selective' is selective's RNG on replay, which verify exists to see."""
    rec = Recorder("cuda")
    original = verifying_module.verify_equivalence

    def recorded(*args, **kwargs):
        rec.in_verify = True
        try:
            return original(*args, **kwargs)
        finally:
            rec.in_verify = False

    monkeypatch.setattr(verifying_module, "verify_equivalence", recorded)
    if attention:
        def note(module, args):
            rec.note()

        model = TinyTransformer(dropout=0.1)
        for layer in model.layers:
            layer.register_forward_pre_hook(note)
    else:
        model = RecordingModel(rec, dropout=0.1)
    with caplog.at_level("INFO"):
        Trainer(**trainer_kwargs(tmp_path, max_steps=2, accelerator="cuda", precision="bf16-mixed"),
                callbacks=[ActivationCheckpointing(policy=policy, verify=True)]).fit(model)
    made = rec.verify_calls()
    assert made and all(autocast for _, autocast, _ in made)
    assert "precision 'bf16-mixed', autocast cuda bfloat16" in caplog.text
    assert "every checkpointed block agrees with its plain run" in caplog.text


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_verify_under_torch_compile(tmp_path, caplog, compile_blocks):
    """verify=True with the whole model compiled, and with its blocks compiled one by one (compile_blocks)."""
    from _lightning_models import CompiledGPT, GraphCount
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    seed_everything(0)
    model = CompiledGPT(GraphCount(), n_layer=2, n_embd=32, n_head=2, block_size=16, dropout=0.1)
    loader = DataLoader([model.example_batch(2, 16)] * 2, batch_size=None)
    cb = ActivationCheckpointing(policy="all", verify=True, compile_blocks=compile_blocks)
    with caplog.at_level("INFO"):
        Trainer(**trainer_kwargs(tmp_path, max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                                 precision="bf16-mixed"), callbacks=[cb]).fit(model, train_dataloaders=loader)
    assert "every checkpointed block agrees with its plain run" in caplog.text
    assert "autocast cpu bfloat16" in caplog.text

