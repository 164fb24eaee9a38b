"""lightning_ckpt: activation checkpointing as a scheduling decision, for PyTorch Lightning."""

from lightning_ckpt.blocks import find_blocks
from lightning_ckpt.policy import GRAMMAR, MODES, Policy, parse_policy
from lightning_ckpt.units import format_bytes, parse_size
from lightning_ckpt.wrap import CheckpointPlan, ForeignCheckpointingError, apply_policy, get_plan, remove_checkpointing

__version__ = "0.1.0"

__all__ = [
    "CheckpointPlan",
    "ForeignCheckpointingError",
    "GRAMMAR",
    "MODES",
    "Policy",
    "apply_policy",
    "find_blocks",
    "format_bytes",
    "get_plan",
    "parse_policy",
    "parse_size",
    "remove_checkpointing",
]
