"""Tests for ``lightning_ckpt.demos``: the GPT, its Lightning wrapper, the data module and tiny GPT-2."""

from __future__ import annotations

import ast
import csv
import math
from pathlib import Path

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_ckpt import demos
from lightning_ckpt.demos import (
    DEFAULT_TEXT,
    GPT,
    Block,
    CharDataModule,
    CharTokenizer,
    CharWindows,
    GPTConfig,
    GPTLightningModule,
    HFCausalLMModule,
    tiny_gpt2,
)

DEMOS_DIR = Path(demos.__file__).parent


# --- gpt.py -----------------------------------------------------------------------------------


def test_gpt_module_imports_no_lightning():
    # The plain-torch layer must stay usable without Lightning (and without transformers).
    tree = ast.parse((DEMOS_DIR / "gpt.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    roots = {name.split(".")[0] for name in imported}
    assert roots.isdisjoint({"lightning", "pytorch_lightning", "transformers"}), roots


def test_gpt_forward_backward_shapes_and_finite_loss():
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))
    logits, loss = model(idx, targets=torch.roll(idx, -1, dims=1))
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # An untrained model predicts roughly uniformly: loss near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_gpt_without_targets_returns_none_loss():
    model = GPT(GPTConfig.tiny())
    logits, loss = model(torch.zeros(1, 5, dtype=torch.long))
    assert loss is None and logits.shape == (1, 5, 96)


def test_gpt_ignores_minus_100_labels():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 96, (2, 8))
    targets = idx.clone()
    targets[:, 4:] = -100
    _, masked = model(idx, targets)
    _, first_half = model(idx[:, :4], targets[:, :4])  # causal: positions < 4 see the same context
    torch.testing.assert_close(masked, first_half)


def test_gpt_rejects_too_long_sequence():
    model = GPT(GPTConfig.tiny(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt_layout_is_what_block_finders_expect():
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    h = model.transformer.h
    assert isinstance(h, nn.ModuleList) and len(h) == cfg.n_layer
    assert all(type(b) is Block for b in h)
    assert set(model.transformer.keys()) == {"wte", "wpe", "drop", "h", "ln_f"}
    block = h[0]
    assert [n for n, _ in block.named_children()] == ["ln_1", "attn", "ln_2", "mlp"]
    # No nn.Sequential anywhere: a 2-Linear Sequential could be mistaken for a stack of blocks.
    assert not any(isinstance(m, nn.Sequential) for m in model.modules())
    x = torch.randn(2, 5, cfg.n_embd)
    assert block(x).shape == x.shape  # one tensor in, one tensor out


def test_gpt_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(dropout=0.5))
    idx = torch.randint(0, 96, (2, 8))
    model.eval()
    torch.testing.assert_close(model(idx)[0], model(idx)[0])
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])


def test_config_presets():
    b = GPTConfig.benchmark()
    got = (b.n_layer, b.n_embd, b.n_head, b.block_size, b.vocab_size, b.dropout)
    assert got == (12, 512, 8, 512, 512, 0.0)
    t = GPTConfig.tiny()
    assert (t.n_layer, t.n_embd, t.n_head, t.block_size, t.vocab_size) == (4, 64, 4, 64, 96)
    assert GPTConfig.from_name("tiny", n_layer=2).n_layer == 2
    with pytest.raises(ValueError, match="'huge'.*benchmark"):
        GPTConfig.from_name("huge")
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=64, n_head=5)


# --- lightning_gpt.py ---------------------------------------------------------------------------


def test_lightning_module_example_batch_shapes():
    module = GPTLightningModule()
    batch = module.example_batch(micro_batch=3, seq_len=16)
    assert set(batch) == {"input_ids", "labels"}
    for key in ("input_ids", "labels"):
        assert batch[key].shape == (3, 16) and batch[key].dtype == torch.long
    assert batch["input_ids"].max() < module.vocab_size and batch["input_ids"].min() >= 0
    torch.testing.assert_close(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert torch.isfinite(module.compute_loss(batch))


def test_example_batch_leaves_global_rng_alone():
    module = GPTLightningModule()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    module.example_batch(2, 8)
    torch.testing.assert_close(torch.rand(3), expected)


def test_example_batch_rejects_bad_sizes():
    module = GPTLightningModule(block_size=32)
    with pytest.raises(ValueError, match="seq_len=33"):
        module.example_batch(1, 33)
    with pytest.raises(ValueError, match="micro_batch=0"):
        module.example_batch(0, 8)


def test_from_config_round_trips_hparams():
    module = GPTLightningModule.from_config(GPTConfig.tiny(n_layer=2), lr=1e-4)
    assert module.config == GPTConfig.tiny(n_layer=2)
    assert module.hparams.lr == 1e-4 and module.hparams.n_layer == 2


def test_optimizer_groups_split_decay():
    module = GPTLightningModule(weight_decay=0.2)
    opt = module.configure_optimizers()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == sum(p.numel() for p in module.parameters())  # tied weights counted once


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "Memory is a ledger.\nSchedule it!"
    ids = tok.encode(text)
    assert ids.max() < tok.vocab_size and tok.decode(ids) == text
    assert tok.decode(tok.encode("caf\u00e9")) == "caf "  # unknown characters become spaces


def test_bundled_text_ships_and_is_ascii():
    raw = DEFAULT_TEXT.read_bytes()
    assert 20_000 <= len(raw) <= 40_000
    raw.decode("ascii")  # every character is in the fixed vocabulary


def test_datamodule_windows_and_shifted_labels():
    dm = CharDataModule(batch_size=4, seq_len=32)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and batch["labels"].shape == (4, 32)
    torch.testing.assert_close(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape == (4, 32)
    item = dm.train_set[3]
    tokens = dm.train_set.tokens
    start = 3 * dm.train_set.stride
    torch.testing.assert_close(item["labels"], tokens[start + 1 : start + 33])
    assert dm.vocab_size == 96 and len(dm.train_set) > 5 * len(dm.val_set) > 0


def test_datamodule_train_and_val_do_not_overlap():
    dm = CharDataModule(seq_len=16, val_fraction=0.1)
    dm.setup()
    text = DEFAULT_TEXT.read_text()
    assert dm.train_set.tokens.numel() + dm.val_set.tokens.numel() == len(text)


def test_datamodule_reads_a_user_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 10)
    dm = CharDataModule(batch_size=2, seq_len=8, path=str(path))
    dm.setup()
    assert dm.tokenizer.decode(dm.train_set[0]["input_ids"]) == "abcdefgh"


def test_datamodule_seq_len_too_long_names_value(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 50)
    dm = CharDataModule(seq_len=64, path=str(path))
    with pytest.raises(ValueError, match="seq_len=64"):
        dm.setup()


def test_three_step_fit_without_plugin():
    from lightning.pytorch import Trainer, seed_everything

    seed_everything(0)
    model = GPTLightningModule(n_layer=2, n_embd=32, n_head=2, block_size=16, dropout=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=CharDataModule(batch_size=4, seq_len=16))
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert not torch.equal(before["model.transformer.h.0.mlp.c_fc.weight"],
                           model.state_dict()["model.transformer.h.0.mlp.c_fc.weight"])


def test_lightning_cli_carries_plain_init_args(tmp_path, monkeypatch):
    # Every init arg must be expressible on a command line / in YAML.
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["cli.py"])  # pytest's own flags are not CLI arguments

    cli = LightningCLI(
        GPTLightningModule,
        CharDataModule,
        run=False,
        args=["--model.n_layer=2", "--model.n_embd=32", "--model.n_head=2", "--model.lr=0.01",
              "--data.seq_len=16", f"--trainer.default_root_dir={tmp_path}"],
        save_config_kwargs={"overwrite": True},
    )
    assert cli.model.config.n_layer == 2 and cli.model.hparams.lr == 0.01
    assert cli.datamodule.hparams.seq_len == 16


# --- hf.py --------------------------------------------------------------------------------------


def test_tiny_gpt2_builds_from_config_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=96)
    assert len(model.transformer.h) == 2 and model.config.use_cache is False
    assert "GPT2Block" in model._no_split_modules
    logits = model(torch.randint(0, 96, (2, 16))).logits
    assert logits.shape == (2, 16, 96)


def test_hf_module_loss_uses_aligned_labels():
    torch.manual_seed(0)
    module = HFCausalLMModule(n_layer=2, n_embd=32, n_head=2, n_positions=32, dropout=0.0)
    batch = module.example_batch(2, 32)
    assert batch["input_ids"].shape == (2, 32)
    loss = module.compute_loss(batch)
    # HF's internal loss shifts labels itself; with unshifted labels it must agree with ours.
    hf_loss = module.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    logits = module(batch["input_ids"])
    ours_on_same_positions = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 96), batch["labels"][:, :-1].reshape(-1))
    torch.testing.assert_close(hf_loss, ours_on_same_positions)
    assert torch.isfinite(loss)
    loss.backward()
    with pytest.raises(ValueError, match="seq_len=33"):
        module.example_batch(1, 33)


def test_hf_module_honours_attention_mask():
    module = HFCausalLMModule(n_layer=1, n_embd=32, n_head=2, n_positions=16, dropout=0.0)
    batch = module.example_batch(2, 16)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][:, :4] = 0
    assert torch.isfinite(module.compute_loss(batch))


# --- validation metrics (CausalLMMixin, shared by both demo modules) ----------------------------------------------

V, T = 96, 16
MODULES = {
    "gpt": lambda: GPTLightningModule(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0),
    "hf": lambda: HFCausalLMModule(n_layer=2, n_embd=32, n_head=2, n_positions=T, dropout=0.0),
}
# the logits by each model's own road, not through the module code under test
LOGITS = {"gpt": lambda m, ids: m.model(ids)[0], "hf": lambda m, ids: m.model(input_ids=ids).logits}


class _ValWindows(Dataset):
    """Eight validation windows whose text depends on ``part`` (so each validation run reads data of its own).
    Window ``i`` has its first ``i`` labels ignored (-100): the batches hold different numbers of labelled tokens,
    so the mean of the batch losses is not the token mean."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens, self.part = tokens, 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = self.part * 8 * T + i * T
        chunk = self.tokens[start : start + T + 1]
        labels = chunk[1:].clone()
        labels[:i] = -100
        return {"input_ids": chunk[:-1], "labels": labels}


def _by_hand(module, logits_of, dataset) -> tuple[float, float, float]:
    """(perplexity, accuracy, mean of batch losses) over ``dataset``: float64 sums over the labelled tokens."""
    nll = correct = count = 0.0
    batch_losses = []
    module.eval()
    with torch.no_grad():
        for batch in DataLoader(dataset, batch_size=4):
            logits = logits_of(module, batch["input_ids"]).double().reshape(-1, V)
            labels = batch["labels"].reshape(-1).to(logits.device)
            keep = labels != -100
            token_nll = nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
            nll += token_nll[keep].sum().item()
            correct += (logits.argmax(-1) == labels)[keep].sum().item()
            count += keep.sum().item()
            batch_losses.append(token_nll[keep].mean().item())
    return math.exp(nll / count), correct / count, sum(batch_losses) / len(batch_losses)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # validation_step without a Trainer
@pytest.mark.parametrize("name", sorted(MODULES))
def test_validation_metrics_are_torchmetrics_objects_outside_the_state_dict(name):
    module = MODULES[name]()
    assert isinstance(module.val_ppl, torchmetrics.text.Perplexity) and module.val_ppl.ignore_index == -100
    assert isinstance(module.val_acc, torchmetrics.classification.MulticlassAccuracy)
    assert (module.val_acc.num_classes, module.val_acc.ignore_index, module.val_acc.average) == (V, -100, "micro")
    assert {n for n, _ in module.named_children()} == {"model", "val_ppl", "val_acc"}  # attributes: Lightning sees them
    # checkpoints are unchanged: the metric states are not persistent
    assert set(module.state_dict()) == {f"model.{k}" for k in module.model.state_dict()}
    batch = module.example_batch(4, T)
    batch["labels"][:, :3] = -100
    module.validation_step(batch, 0)
    module.validation_step(batch, 1)
    # running sums only: nothing of the [B, T, V] logits is kept past the step
    for metric in (module.val_ppl, module.val_acc):
        assert all(getattr(metric, state).numel() == 1 for state in metric._defaults), metric._defaults
    assert module.val_ppl.count.item() == module.val_acc.tp.item() + module.val_acc.fn.item() == 2 * 4 * (T - 3)


class _Record(Callback):
    """After each validation run (the sanity check included): the epoch's metrics, a copy of the weights, then
    the next run's data. The dataset's part changes only here, after every batch of the run was read."""

    def __init__(self, dataset: _ValWindows) -> None:
        self.dataset, self.runs = dataset, []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            metrics = {k: float(trainer.callback_metrics[k]) for k in ("val_ppl", "val_acc", "val_loss")}
            weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.runs.append((self.dataset.part, metrics, weights))
        self.dataset.part += 1


@pytest.mark.parametrize("name", sorted(MODULES))
def test_fit_logs_token_perplexity_and_accuracy_of_each_epoch(tmp_path, name):
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    seed_everything(0)
    module = MODULES[name]()
    tokens = CharTokenizer().encode(DEFAULT_TEXT.read_text())
    val = _ValWindows(tokens[-4 * 8 * T - 1 :])
    train = DataLoader(CharWindows(tokens[: 20 * T], T, stride=T), batch_size=4, shuffle=False)
    record = _Record(val)
    trainer = Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, num_sanity_val_steps=2,
                      logger=CSVLogger(str(tmp_path), name="csv"), callbacks=[record], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    # the sanity check reads part 0 with the initial weights: were the metrics not reset after it, epoch 0 would
    # carry its tokens; were they not reset between epochs, epoch 1 would carry epoch 0's
    trainer.fit(module, train_dataloaders=train, val_dataloaders=DataLoader(val, batch_size=4))
    assert [part for part, _, _ in record.runs] == [1, 2]

    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    logged = [(float(r["val_ppl"]), float(r["val_acc"])) for r in rows if r.get("val_ppl")]
    assert len(logged) == 2  # one value per epoch, in the logger
    fresh = MODULES[name]()
    for (part, metrics, weights), (ppl_logged, acc_logged) in zip(record.runs, logged):
        fresh.load_state_dict(weights)
        val.part = part
        ppl, acc, mean_batch_loss = _by_hand(fresh, LOGITS[name], val)
        assert metrics["val_ppl"] == pytest.approx(ppl, rel=1e-5) and ppl_logged == pytest.approx(ppl, rel=1e-5)
        assert metrics["val_acc"] == pytest.approx(acc, abs=1e-6) and acc_logged == pytest.approx(acc, abs=1e-6)
        assert metrics["val_loss"] == pytest.approx(mean_batch_loss, rel=1e-5)  # kept as it was
        # the data tell a token mean from a mean of batches (by 3.6e-4 and 5.3e-4 here, 1e-5 is the tolerance)
        assert abs(math.log(ppl) - mean_batch_loss) > 1e-4
    assert record.runs[0][1]["val_ppl"] != record.runs[1][1]["val_ppl"]


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_perplexity_under_cpu_bf16_autocast_is_the_float32_figure_of_the_bf16_logits():
    # CPU autocast keeps softmax in bf16; the metric must still see float32 logits
    torch.manual_seed(0)
    module = MODULES["gpt"]()
    batch = module.example_batch(4, T)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = module.logits_and_loss(batch)
        module.validation_step(batch, 0)
    assert logits.dtype == torch.bfloat16
    nll = nn.functional.cross_entropy(logits.double().reshape(-1, V), batch["labels"].reshape(-1))
    assert module.val_ppl.compute().item() == pytest.approx(math.exp(nll.item()), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODULES))
def test_on_cuda_the_metrics_move_with_the_module_and_match_by_hand(tmp_path, name):
    from lightning.pytorch import Trainer, seed_everything

    seed_everything(0)
    module = MODULES[name]()
    tokens = CharTokenizer().encode(DEFAULT_TEXT.read_text())
    val = _ValWindows(tokens[-8 * T - 1 :])
    seen = {}

    class Devices(Callback):
        def on_validation_end(self, trainer, pl_module):
            seen["devices"] = {pl_module.val_ppl.count.device.type, pl_module.val_acc.tp.device.type}

    trainer = Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, limit_train_batches=2,
                      num_sanity_val_steps=0, logger=False, callbacks=[Devices()], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    train = DataLoader(CharWindows(tokens[: 20 * T], T, stride=T), batch_size=4)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=DataLoader(val, batch_size=4))
    assert seen["devices"] == {"cuda"}
    module.cuda()

    def bf16_logits(m, ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return LOGITS[name](m, ids.cuda())

    ppl, acc, _ = _by_hand(module, bf16_logits, val)
    assert float(trainer.callback_metrics["val_ppl"]) == pytest.approx(ppl, rel=1e-4)
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(acc, abs=1e-6)
