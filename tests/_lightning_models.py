"""Small LightningModules and helper callbacks shared by the Lightning-edge tests (CPU, seconds)."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_ckpt.demos import GPTLightningModule

VOCAB = 16
SEQ = 8


class CountingBlock(nn.TransformerEncoderLayer):
    """A Transformer block whose forward *body* counts its calls, so a recompute counts twice."""

    def __init__(
        self, d_model: int = 32, nhead: int = 4, dim_feedforward: int = 64, dropout: float = 0.0
    ) -> None:
        super().__init__(d_model, nhead, dim_feedforward=dim_feedforward, dropout=dropout, batch_first=True)
        self.calls = 0

    def forward(self, src, *args, **kwargs):
        self.calls += 1
        return super().forward(src, *args, **kwargs)


class SameBatch(torch.utils.data.Dataset):
    """``n`` items, each the same ready-made batch (use with ``DataLoader(..., batch_size=None)``): every step sees
    identical shapes, so figures of different steps compare."""

    def __init__(self, batch, n: int = 8) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.batch


def token_dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    """Next-token task on random sequences: the target of token t is (t + 1) mod VOCAB."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, (x + 1) % VOCAB)


class TinyTransformer(LightningModule):
    """Embedding → ``num_layers`` × :class:`CountingBlock` in ``self.layers`` → linear head.

    Args:
        build_in: where the blocks are created: ``"init"``, ``"setup"`` or ``"configure_model"``.
        unused_param: add a parameter that never receives a gradient (DDP ``find_unused_parameters``).
        optimizer: ``"adam"`` or ``"sgd"``.
    """

    def __init__(
        self,
        num_layers: int = 4,
        d_model: int = 32,
        dropout: float = 0.0,
        lr: float = 1e-2,
        batch_size: int = 8,
        n_samples: int = 64,
        build_in: str = "init",
        unused_param: bool = False,
        optimizer: str = "adam",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = None
        if unused_param:
            self.unused = nn.Linear(2, 2)
        if build_in == "init":
            self._build()

    def _build(self) -> None:
        if self.layers is not None:
            return
        h = self.hparams
        self.embed = nn.Embedding(VOCAB, h.d_model)
        self.layers = nn.ModuleList(CountingBlock(h.d_model, dropout=h.dropout) for _ in range(h.num_layers))
        self.head = nn.Linear(h.d_model, VOCAB)

    def setup(self, stage: str) -> None:
        if self.hparams.build_in == "setup":
            self._build()

    def configure_model(self) -> None:
        if self.hparams.build_in == "configure_model":
            self._build()

    # -- model
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def block_calls(self) -> list:
        return [layer.calls for layer in self.layers]

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    # -- data (deterministic, no shuffling, so runs are comparable)
    def _loader(self, seed: int) -> DataLoader:
        return DataLoader(token_dataset(self.hparams.n_samples, seed), batch_size=self.hparams.batch_size)

    def train_dataloader(self):
        if self.trainer.world_size == 1:
            return self._loader(0)
        # unshuffled shards (rank r: samples r, r + W, ...), so W ranks × batch b see exactly the samples one
        # process sees with batch W × b; pair with Trainer(use_distributed_sampler=False)
        dataset = token_dataset(self.hparams.n_samples, 0)
        sampler = DistributedSampler(
            dataset, self.trainer.world_size, self.trainer.global_rank, shuffle=False
        )
        return DataLoader(dataset, batch_size=self.hparams.batch_size, sampler=sampler)

    def val_dataloader(self):
        return self._loader(1)

    def test_dataloader(self):
        return self._loader(2)

    def predict_dataloader(self):
        return self._loader(3)


class TokenDataModule(LightningDataModule):
    """The same data as :class:`TinyTransformer`'s own loaders, for LightningCLI scripts."""

    def __init__(self, batch_size: int = 8, n_samples: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n_samples = n_samples

    def train_dataloader(self):
        return DataLoader(token_dataset(self.n_samples, 0), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(token_dataset(self.n_samples, 1), batch_size=self.batch_size)


class CallRecorder(Callback):
    """Records, per batch, how many times each block's forward body ran (train/val/test/predict/sanity)."""

    def __init__(self) -> None:
        self.records = {"train": [], "val": [], "sanity": [], "test": [], "predict": []}
        self.modes_at_first_step = None
        self._before = None

    def _start(self, pl_module) -> None:
        self._before = pl_module.block_calls()

    def _end(self, trainer, pl_module, kind: str) -> None:
        delta = [a - b for a, b in zip(pl_module.block_calls(), self._before)]
        if kind == "val" and trainer.sanity_checking:
            kind = "sanity"
        self.records[kind].append(delta)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.modes_at_first_step is None:
            plan = getattr(pl_module, "_lightning_ckpt_plan", None)
            self.modes_at_first_step = None if plan is None else plan.modes
        self._start(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._end(trainer, pl_module, "train")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, pl_module, "val")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(pl_module)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, pl_module, "test")

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(pl_module)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._end(trainer, pl_module, "predict")


class CrashAt(Callback):
    """Raises at the start of global step ``step`` (a simulated failure)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


class DumpState(Callback):
    """Writes each rank's parameters, plan state and per-step block calls to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.calls = CallRecorder()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module):
        plan = getattr(pl_module, "_lightning_ckpt_plan", None)
        torch.save(
            {
                "params": params_of(pl_module),
                "plan": None if plan is None else plan.state_dict(),
                "calls": self.calls.records["train"],
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
            },
            f"{self.out_dir}/rank{trainer.global_rank}.pt",
        )


class BlockCompiledGPT(GPTLightningModule):
    """The demo GPT with each block compiled in ``configure_model`` (``block.compile()``, the torchtitan / FSDP2
    way). ``backend="aot_eager"``: AOTAutograd and its partitioner without code generation (seconds, not minutes)."""

    def __init__(self, backend: str = "aot_eager", **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend = backend

    def configure_model(self) -> None:
        for block in self.model.transformer.h:
            block.compile(backend=self.backend)


class DumpBudget(Callback):
    """Writes each rank's parameters, modes and budget calibration (stages, block prices) to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        from lightning_ckpt import ActivationCheckpointing

        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
        calibration = cb.calibration
        torch.save(
            {
                "params": params_of(pl_module),
                "modes": list(cb.plan.modes),
                "stages": len(calibration.stages),
                "done": calibration.done,
                "worst": calibration.worst_step[0] if calibration.worst_step else None,
                "worst_modes": calibration.worst_step[1] if calibration.worst_step else None,
                "peaks": list(calibration._calibration_peaks),
                "budget": calibration.budget,
                "fits": calibration.chosen is not None and calibration.chosen.fits,
                "measured": calibration.measured,
                "block_seconds": calibration.block_seconds,
                "world_size": trainer.world_size,
            },
            f"{self.out_dir}/rank{trainer.global_rank}.pt",
        )


def trainer_kwargs(tmp_path, **overrides) -> dict:
    """Quiet, CPU, tiny Trainer settings."""
    kwargs = dict(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        max_steps=4,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        # a logger, because the callback warns once (by design) when it measures with nowhere to log
        logger=CSVLogger(str(tmp_path), name="csv"),
        enable_checkpointing=False,
    )
    kwargs.update(overrides)
    return kwargs


def params_of(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class CleanDistributedExit(Callback):
    """Synchronise the ranks and destroy the process group at teardown, before the spawned workers exit.

    Lightning leaves the gloo group alive when a ``ddp_spawn`` worker returns; a rank that exits while its peer
    still holds the connection occasionally aborts in gloo's threads ("terminate called without an active
    exception", seen in about 1 of 20 runs here). Tests add this so a finished run always exits cleanly.
    """

    def teardown(self, trainer, pl_module, stage):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class GraphCount:
    """A compile backend (AOTAutograd, min-cut partitioner) that counts the forward graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

        def forward_compiler(gm, example_inputs):
            self.graphs += 1
            return gm.forward

        self.backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm.forward,
                                    partition_fn=min_cut_rematerialization_partition)


class CompiledGPT(GPTLightningModule):
    """Compiles its model in ``configure_model``, as a Lightning user does."""

    def __init__(self, counter: GraphCount, **kwargs) -> None:
        super().__init__(**kwargs)
        self.counter = counter

    def configure_model(self) -> None:
        if not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, backend=self.counter.backend)


class RankLengthsGPT(GPTLightningModule):
    """The demo GPT fed batches of different lengths on each rank (``lengths[rank]``, micro-batch 2): the ranks
    must still run the same plan in each step."""

    def __init__(self, lengths, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lengths = lengths

    def train_dataloader(self):
        rank = self.trainer.global_rank
        g = torch.Generator().manual_seed(rank)
        batches = []
        for length in self.lengths[rank]:
            ids = torch.randint(0, self.config.vocab_size, (2, length + 1), generator=g)
            batches.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
        return torch.utils.data.DataLoader(batches, batch_size=None)


class DumpModes(Callback):
    """Writes each rank's per-step plan modes, its parameters and its shape plans to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.modes = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lengths = batch["input_ids"].shape[1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = getattr(pl_module, "_lightning_ckpt_plan", None)
        self.modes.append((self.lengths, tuple(plan.modes)))

    def on_train_end(self, trainer, pl_module):
        from lightning_ckpt import ActivationCheckpointing

        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
        torch.save({"modes": self.modes, "params": params_of(pl_module),
                    "buckets": {str(b): list(p.modes) for b, p in cb.shape_plans.items()},
                    "errors": {str(b): p.error for b, p in cb.shape_plans.items() if p.source == "fake"}},
                   f"{self.out_dir}/rank{trainer.global_rank}.pt")


def lm_batch(length: int, samples: int = 4, seed: int = 0, vocab: int = 96) -> dict:
    """A causal-LM batch of ``samples`` x ``length`` token ids and their next-token labels (seeded)."""
    g = torch.Generator().manual_seed(seed * 1000 + length)
    ids = torch.randint(0, vocab, (samples, length + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def step_activations(trainer) -> "int | None":
    """The activation peak the plugin's callback measured for the step that just ended (``None`` unmeasured)."""
    from lightning_ckpt import ActivationCheckpointing

    (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
    result = cb.last_result
    return result.ledger.activations if result is not None and result.ledger is not None else None

