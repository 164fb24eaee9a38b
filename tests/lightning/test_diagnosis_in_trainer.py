"""Diagnosis in a real Trainer: out-of-memory by phase, the ledger report, replay safety, verify=True."""

import json

import pytest
import torch
from _lightning_models import VOCAB, TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.core.units import unit_for
from lightning_ckpt.decide.diagnosis import OutOfMemoryDiagnosis
from lightning_ckpt.lightning.verifying import Verification

OOM = "CUDA out of memory. Tried to allocate 4.00 GiB (injected)"


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(OOM)


class _OOMAdam(torch.optim.Adam):
    def __init__(self, params, fail_at_step, **kw):
        super().__init__(params, **kw)
        self.fail_at_step, self.calls = fail_at_step, 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.calls += 1
        if self.calls == self.fail_at_step:
            raise torch.OutOfMemoryError(OOM)
        super().step()
        return loss


class PhaseModel(TinyTransformer):
    """Raises an injected out-of-memory error in one phase of the third optimizer step (or the first)."""

    def __init__(self, phase, at_step=2, **kw):
        super().__init__(**kw)
        self.phase, self.at_step = phase, at_step

    def _armed(self):
        return self.trainer.global_step == self.at_step

    def training_step(self, batch, batch_idx):
        if self.phase == "before_forward" and self._armed():
            raise torch.OutOfMemoryError(OOM)
        x, y = batch
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if self.phase == "forward" and self._armed() and i == 2:
                raise torch.OutOfMemoryError(OOM)
            h = layer(h)
        if self.phase == "backward" and self._armed():
            h = _RaiseInBackward.apply(h)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        fail = {"first_optimizer_step": 1, "optimizer_step": self.at_step + 1}.get(self.phase, -1)
        return _OOMAdam(self.parameters(), fail, lr=1e-3)


@pytest.mark.parametrize(
    "phase, at_step, words",
    [
        ("before_forward", 2, "parameters, inputs, initialization"),
        ("forward", 2, "retained activations"),
        ("backward", 2, "replay transient"),
        ("first_optimizer_step", 0, "lazy optimizer-state allocation"),
        ("optimizer_step", 2, "fragmentation"),
    ],
)
def test_out_of_memory_names_the_phase_with_the_last_ledger(tmp_path, phase, at_step, words):
    seed_everything(0)
    cb = ActivationCheckpointing(policy="every:2")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=5, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0, enable_checkpointing=True),
                      callbacks=[cb, ckpt])
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer.fit(PhaseModel(phase, at_step))
    error = err.value
    assert isinstance(error, OutOfMemoryDiagnosis) and error.phase == phase
    assert f"during the {phase.replace('_', ' ')} phase" in str(error) and words in str(error)
    assert isinstance(error.__cause__, torch.OutOfMemoryError) and "injected" in str(error.__cause__)
    if at_step:
        memory = [v for k, v in cb.last_metrics.items() if "memory/" in k]
        unit, scale = unit_for(max(memory) * 2**30)  # the table's one unit, from its largest line
        params = cb.last_metrics["memory/params_gib"] * 2**30 / scale
        assert f"{params:10.2f} {unit}" in str(error)  # the ledger of the last logged step
        saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
        assert len(saved) == at_step  # checkpoints written before the failure are intact and load
        for path in saved:
            torch.load(path, weights_only=True)
    else:
        assert "No step was measured" in str(error)


class Embedder(TinyTransformer):
    """A huge embedding and tiny activations: optimizer state dominates."""

    def _build(self):
        super()._build()
        self.embed = nn.Embedding(200_000, self.hparams.d_model)


def _fit_report(tmp_path, model, **cb_kw):
    seed_everything(0)
    cb = ActivationCheckpointing(**cb_kw)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0), callbacks=[cb])
    trainer.fit(model)
    return cb, cb.report(trainer), json.loads((tmp_path / "csv" / "version_0" / "lightning_ckpt_report.json")
                                              .read_text())


def test_optimizer_dominated_run_is_told_checkpointing_cannot_help(tmp_path):
    cb, text, data = _fit_report(tmp_path, Embedder(), policy="none")
    assert data["dominant"] == "optimizer"
    assert "checkpointing cannot help" in text and "smaller state" in text
    # Adam: two fp32 moments per parameter plus a step counter per tensor
    assert data["lines"]["optimizer"]["bytes"] >= 2 * data["lines"]["params"]["bytes"]


def test_activation_dominated_run_gets_a_policy_suggestion(tmp_path):
    cb, text, data = _fit_report(tmp_path, TinyTransformer(batch_size=64, d_model=32), policy="none")
    assert data["dominant"] == "activations"
    assert "suggest policy 'every:2'" in text and "activation checkpointing" in text


def test_batchnorm_in_a_checkpointed_block_warns_in_the_trainer(tmp_path):
    class NormBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(32, 32), nn.BatchNorm1d(32)

        def forward(self, x):
            return x + self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)

    class NormModel(TinyTransformer):
        def _build(self):
            super()._build()
            self.layers = nn.ModuleList(NormBlock() for _ in range(3))

    with pytest.warns(UserWarning, match=r"layers.0.bn"):
        Trainer(**trainer_kwargs(tmp_path, max_steps=1), callbacks=[ActivationCheckpointing()]).fit(NormModel())
    cb = ActivationCheckpointing(stateful="skip")
    Trainer(**trainer_kwargs(tmp_path / "skip", max_steps=1), callbacks=[cb]).fit(NormModel())
    assert cb.plan.modes == ("off", "off", "off")


def test_verify_passes_on_a_correct_model_and_raises_on_a_mutable_block(tmp_path):
    cb = ActivationCheckpointing(policy="all", verify=True)
    Trainer(**trainer_kwargs(tmp_path, max_steps=2), callbacks=[cb]).fit(TinyTransformer(dropout=0.1))
    assert cb._engine.feature(Verification).verified

    from lightning_ckpt.decide.verify import EquivalenceError

    with pytest.raises(EquivalenceError, match="not replay-safe"):
        Trainer(**trainer_kwargs(tmp_path / "bad", max_steps=2),
                callbacks=[ActivationCheckpointing(policy="all", verify=True)]).fit(MutableCounterModel())


class CounterBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.count = 0

    def forward(self, x):
        self.count += 1  # replay sees a different count: not a pure function
        return x + torch.tanh(self.lin(x)) * self.count


class MutableCounterModel(TinyTransformer):
    def _build(self):
        super()._build()
        self.layers = nn.ModuleList(CounterBlock() for _ in range(3))


class ShapeShifter(nn.Module):
    """Draws a data-dependent shape from mutable state: the replay saves a tensor of another shape."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        rows = x[:, : x.shape[1] - (self.calls % 2)]
        return x + torch.tanh(self.lin(rows)).mean(1, keepdim=True)


class ShapeModel(TinyTransformer):
    def _build(self):
        super()._build()
        self.layers[2] = ShapeShifter()


def test_determinism_check_failure_names_the_block(tmp_path):
    from torch.utils.checkpoint import CheckpointError

    cb = ActivationCheckpointing(policy="all", blocks=["layers.0", "layers.1", "layers.2", "layers.3"])
    with pytest.raises(CheckpointError, match=r"block 'layers.2' computed something different") as err:
        Trainer(**trainer_kwargs(tmp_path, max_steps=2), callbacks=[cb]).fit(ShapeModel())
    assert isinstance(err.value.__cause__, CheckpointError) and "pure function" in str(err.value)


def test_length_reading_separates_linear_from_quadratic_growth():
    from lightning_ckpt.decide.report import length_reading, loglog_slope

    assert loglog_slope([1, 2, 4], [3, 6, 12]) == pytest.approx(1.0)
    assert loglog_slope([1], [1]) is None
    quadratic = length_reading([(64, 64**2 * 10.0), (128, 128**2 * 10.0), (256, 256**2 * 10.0)])
    assert "square of sequence length" in quadratic and "fused attention" in quadratic
    assert "linearly" in length_reading([(64, 640.0), (128, 1280.0)])
    assert length_reading([(64, 1.0)]) is None


class EagerAttention(nn.Module):
    """Materializes the T × T attention matrix (softmax output saved for backward)."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class VariableLength(TinyTransformer):
    def _build(self):
        super()._build()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(EagerAttention() for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        batches = []
        for t in (64, 128, 256, 64, 128, 256):
            x = torch.randint(0, VOCAB, (2, t), generator=g)
            batches.append((x, (x + 1) % VOCAB))
        return torch.utils.data.DataLoader(batches, batch_size=None)  # pre-batched: one length per step


def test_report_reads_quadratic_growth_from_steps_of_different_lengths(tmp_path):
    seed_everything(0)
    cb = ActivationCheckpointing(policy="none")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=6, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0), callbacks=[cb])
    trainer.fit(VariableLength())
    assert sorted(cb._engine.run_report.by_length[("off", "off")]) == [64, 128, 256]  # per plan: one plan here
    assert "square of sequence length" in cb.report(trainer)


# ------------------------------------------------------------------------------------- what is alive at the peak


def test_the_report_names_the_tensors_at_the_peak_in_the_seeds_units(tmp_path, capsys):
    from lightning_ckpt.demos import CharDataModule, GPTLightningModule

    seed_everything(0)
    data = CharDataModule(seq_len=32, batch_size=4)
    data.setup()
    model = GPTLightningModule(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=data.vocab_size,
                               dropout=0.0)
    cb = ActivationCheckpointing(policy="every:2")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0), callbacks=[cb])
    trainer.fit(model, datamodule=data)
    printed = capsys.readouterr().out
    assert "what is alive at the activation peak" in printed and "hidden-width tensors" in printed
    data = json.loads((tmp_path / "csv" / "version_0" / "lightning_ckpt_report.json").read_text())
    peak = data["peak"]
    assert peak["hidden"] == 32 and peak["unit_bytes"] == peak["samples"] * peak["length"] * 32 * 4
    act = peak["activation_peak"]
    assert {"module", "op", "shape", "dtype", "bytes", "role"} <= set(act["tensors"][0])
    assert act["bytes"] == sum(int(v) for v in act["per_block"].values()) + act["outside_blocks"]
    assert [b["name"] for b in peak["per_block"]] == list(cb.plan.names)
    per_block = [b["hidden_tensors"] for b in peak["per_block"]]
    assert per_block[0] == 1.0 and per_block[1] > 5  # every:2: block 0 keeps its input, block 1 its interior
    assert isinstance(peak["findings"], list) and peak["arithmetic"]


def test_an_out_of_memory_error_names_the_last_reference_steps_tensors(tmp_path):
    seed_everything(0)
    cb = ActivationCheckpointing(policy="none")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=4, log_every_n_steps=1), callbacks=[cb])
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer.fit(PhaseModel("forward", at_step=2))
    text = str(err.value)
    assert "At the activation peak of the last reference step (step " in text and ", batch 8 x 8," in text
    table = text[text.index("the largest tensors:"):]
    assert "made by (op) / kept by" in table and " layers." in table  # the tensors, by module


def test_the_reference_steps_memory_timeline_is_drawn_beside_the_report_and_in_tensorboard(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seed_everything(0)
    cb = ActivationCheckpointing(policy="every:2")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, log_every_n_steps=1, logger=logger), callbacks=[cb])
    trainer.fit(TinyTransformer())
    png = tmp_path / "tb" / "version_0" / "memory_timeline.png"
    assert png.is_file() and png.stat().st_size > 10_000
    timeline = cb._engine.last_attribution["timeline"]
    assert [phase for _, phase in timeline.boundaries] == ["backward", "optimizer"]  # the phases, in their order
    assert timeline.peak_bytes == max(sum(layer[i] for layer in timeline.layers.values())
                                      for i in range(len(timeline.x)))
    assert len(timeline.peak_tensors) == 3
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    assert "lightning_ckpt/memory_timeline" in acc.Tags()["images"]


def test_the_timeline_puts_the_batch_with_the_temporaries_not_the_optimizer_state(tmp_path):
    """The reference step's state band holds exactly the optimizer's tensors, as the ledger walks them; the batch's
    tensors (alive through the step) are temporaries. The old engine handed the batch in with the model state, so
    the optimizer band read the batch's bytes too."""
    from lightning_ckpt.measure.ledger import model_state_bytes

    seed_everything(0)
    cb = ActivationCheckpointing(policy="every:2")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0), callbacks=[cb])
    module = TinyTransformer(batch_size=8)
    trainer.fit(module)
    last = cb._engine.last_attribution
    assert last["step"] >= 1  # the optimizer state existed (Adam's moments), unchanged in size since
    timeline = last["timeline"]
    assert timeline.layers["optimizer state"][0] == model_state_bytes(module, trainer.optimizers).optimizer
    batch = next(iter(trainer.train_dataloader))
    batch_bytes = sum(t.numel() * t.element_size() for t in (batch if isinstance(batch, (list, tuple)) else [batch])
                      if isinstance(t, torch.Tensor))
    assert timeline.layers["temporaries"][0] >= batch_bytes > 0


# ---------------------------------------------------------- the first optimizer step is the optimizer's (issue 34)


class FailsAtCall(PhaseModel):
    """Its optimizer's ``call``-th step (in this fit) runs out of memory."""

    def __init__(self, call, **kw):
        super().__init__("none", **kw)
        self.call = call

    def configure_optimizers(self):
        return _OOMAdam(self.parameters(), self.call, lr=1e-3)


def _phase_of_error(tmp_path, cb, model, ckpt_path=None):
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=4, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0), callbacks=[cb])
    with pytest.raises(OutOfMemoryDiagnosis) as err:
        trainer.fit(model, ckpt_path=ckpt_path)
    return err.value


def test_a_second_fit_with_a_fresh_optimizer_is_told_its_first_step(tmp_path):
    """The old tracker counted steps for the callback's lifetime: the second fit's fresh Adam, with no state, was
    told "a later optimizer.step(): the state already existed"."""
    seed_everything(0)
    cb = ActivationCheckpointing(policy="every:2")
    Trainer(**trainer_kwargs(tmp_path / "one", max_steps=2, limit_val_batches=0, num_sanity_val_steps=0),
            callbacks=[cb]).fit(TinyTransformer())
    error = _phase_of_error(tmp_path / "two", cb, FailsAtCall(1))
    assert error.phase == "first_optimizer_step" and "lazy optimizer-state allocation" in str(error)


def test_a_resumed_optimizer_with_state_is_told_a_later_step(tmp_path):
    """A resumed run's first step updates a restored state (the old tracker, counting from 0, blamed lazy
    optimizer-state allocation and said checkpointing would not rescue the run)."""
    seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    Trainer(**trainer_kwargs(tmp_path / "one", max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                             enable_checkpointing=True),
            callbacks=[ActivationCheckpointing(policy="every:2"), ckpt]).fit(TinyTransformer())
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    error = _phase_of_error(tmp_path / "two", ActivationCheckpointing(policy="every:2"), FailsAtCall(1),
                            ckpt_path=str(path))
    assert error.phase == "optimizer_step" and "the optimizer state already existed" in str(error)


def test_sgd_without_state_is_told_its_first_step_only_once(tmp_path):
    """An optimizer that keeps no state (SGD without momentum) has stepped before: a later step."""

    class SGDFails(FailsAtCall):
        def configure_optimizers(self):
            class OOMSGD(torch.optim.SGD):
                calls = 0

                def step(inner, closure=None):  # noqa: N805 - the optimizer's own self
                    loss = closure() if closure is not None else None
                    inner.calls += 1
                    if inner.calls == self.call:
                        raise torch.OutOfMemoryError(OOM)
                    super().step()
                    return loss

            return OOMSGD(self.parameters(), lr=1e-3)

    assert _phase_of_error(tmp_path / "first", ActivationCheckpointing(), SGDFails(1)).phase == "first_optimizer_step"
    assert _phase_of_error(tmp_path / "later", ActivationCheckpointing(), SGDFails(3)).phase == "optimizer_step"


# ------------------------------------------------------------------------- a compiled forward is a forward (issue 34)


@torch.library.custom_op("lightning_ckpt_tests::allocate", mutates_args=())
def _allocate(x: torch.Tensor, fail: bool) -> torch.Tensor:
    """A kernel's allocation inside the compiled graph (opaque to the compiler): fails when ``fail``."""
    if fail:
        raise torch.OutOfMemoryError(OOM)
    return x.clone()


@_allocate.register_fake
def _(x, fail):
    return torch.empty_like(x)


_allocate.register_autograd(lambda ctx, grad: (grad, None))


class CompiledForward(TinyTransformer):
    """The whole forward compiled (the eager backend: no C++ compiler needed); step ``at_step``'s forward runs out
    of memory inside the compiled graph, in block 2."""

    def __init__(self, at_step=2, **kw):
        super().__init__(**kw)
        self.at_step, self.fail = at_step, [False]

    def configure_model(self):
        super().configure_model()
        self.forward = torch.compile(self.forward, backend="eager")

    def forward(self, x):
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            h = layer(_allocate(h, self.fail[0]) if i == 2 else h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        self.fail[0] = self.trainer.global_step == self.at_step
        return super().training_step(batch, batch_idx)


def test_an_oom_inside_a_compiled_forward_is_named_the_forward(tmp_path):
    """The phase hook on block 0 is traced into the compiled graph, whose side effects are applied after it returns:
    the old diagnosis said "before forward ... activation checkpointing cannot help here". (Policy 'none': the test
    blocks count their calls, a mutation dynamo breaks the graph on inside a checkpointed region, which would run the
    hook eagerly.)"""
    seed_everything(0)
    error = _phase_of_error(tmp_path, ActivationCheckpointing(policy="none"), CompiledForward())
    assert error.phase == "forward" and "retained activations" in str(error)
    assert "cannot help here" not in str(error)
