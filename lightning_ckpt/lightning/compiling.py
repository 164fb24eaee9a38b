"""The blocks compiled one by one, as a feature of the run: :class:`CompiledBlocks`.

``compile_blocks=True`` compiles each block as its own graph right after the plan is applied (with the user's
backend and options, see :func:`~lightning_ckpt.lightning.compiled.compile_blocks_one_by_one`). At fit start a fixed
plan's ``compiler:<f>`` modes are checked against how the model compiles: refused inside one whole-model graph, a
warning when the blocks run eagerly. After each batch, where something compiles, the graph breaks the checkpointed
blocks caused are named (not always at the first step: a model may compile later).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

from lightning_ckpt.core.policy import MODES, compiler_modes
from lightning_ckpt.lightning import conflicts
from lightning_ckpt.lightning.compiled import (
    blocks_in_one_compiled_graph,
    compile_blocks_one_by_one,
    compiled_block_caller,
    graph_breaks_so_far,
    model_compiles,
    warn_checkpoint_graph_breaks,
)
from lightning_ckpt.lightning.feature import Feature
from lightning_ckpt.lightning.port import PlanPort

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["CompiledBlocks"]


class CompiledBlocks(Feature):
    """What the run does about compiled blocks (see the module docstring).

    Args:
        port: what the feature reaches of the run.
    """

    def __init__(self, port: PlanPort) -> None:
        self.port = port
        self._breaks_before: Optional[int] = None  # graph breaks counted so far, where something compiles

    def plan_applied(self, trainer: "pl.Trainer") -> None:
        """``compile_blocks=True``: each block its own graph."""
        if self.port.settings.compile_blocks:
            for change in compile_blocks_one_by_one(self.port.module, self.port.plan.blocks):
                self.port.info(f"compile_blocks: {change}")

    def fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # compared after each batch, only where something is compiled: no work on eager steps
        self._breaks_before = graph_breaks_so_far() if model_compiles(pl_module) else None
        self._check_compiler_modes(pl_module)

    def after_micro_batch(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A batch compiled (not always the first): name the breaks the checkpointed blocks made."""
        if self._breaks_before is not None:
            plan = self.port.plan
            self._breaks_before = warn_checkpoint_graph_breaks(pl_module, plan.num_checkpointed if plan else 0,
                                                               self._breaks_before)

    def _check_compiler_modes(self, pl_module: "pl.LightningModule") -> None:
        """``compiler:<f>`` blocks in a fixed plan: refused inside one whole-model graph (PyTorch takes one budget
        per graph, covering all of it, and fails at the first compile); a warning when the blocks run eagerly."""
        plan, spec = self.port.plan, self.port.settings.start.spec
        modes = compiler_modes(plan.modes)
        if not modes:
            return
        if blocks_in_one_compiled_graph(pl_module, plan.blocks):
            raise ValueError(
                f"policy {spec!r} puts blocks in modes {modes}, but the whole model is one compiled graph, "
                "where PyTorch applies one activation memory budget covering the whole graph. Pass compile_blocks=True "
                "(each block its own graph, with your backend and options), compile block by block yourself (for "
                "block in blocks: block.compile()) instead of torch.compile(model), or use the modes "
                f"{[m for m in MODES if m != 'offload']} with a whole-model compile.")
        sharded = any(conflicts.is_fsdp_module(m) for m in pl_module.modules())  # no block caller: not "eager"
        if compiled_block_caller(pl_module, plan.blocks) is None and not sharded:
            warnings.warn(f"lightning_ckpt: policy {spec!r} uses {modes}, which act only on blocks "
                          "compiled one by one (block.compile()); these blocks run eagerly, so they run as 'off'.",
                          RuntimeWarning, stacklevel=2)
