"""lightning_ckpt: activation checkpointing as a scheduling decision, for PyTorch Lightning.

Importing the package registers the ``*_ac`` strategies (``single_device_ac``, ``ddp_ac``, ``ddp_spawn_ac``,
``ddp_fork_ac``, ``fsdp_ac``) in Lightning's ``StrategyRegistry``.
"""

from lightning_ckpt.blocks import find_blocks
from lightning_ckpt.budget import plan_budget
from lightning_ckpt.callback import ActivationCheckpointing
from lightning_ckpt.controller import Controller
from lightning_ckpt.ledger import Ledger, build_ledger
from lightning_ckpt.meter import StepMeter, count_tokens
from lightning_ckpt.oom import OutOfMemoryDiagnosis
from lightning_ckpt.planner import LedgerInputs, plan_from_numbers
from lightning_ckpt.policy import GRAMMAR, MODES, Policy, parse_policy
from lightning_ckpt.safety import preflight
from lightning_ckpt.strategy import (
    ActivationCheckpointingMixin,
    DDPActivationCheckpointingStrategy,
    FSDPActivationCheckpointingStrategy,
    SingleDeviceActivationCheckpointingStrategy,
    register_strategies,
)
from lightning_ckpt.trace import plan_model
from lightning_ckpt.units import format_bytes, parse_size
from lightning_ckpt.verify import verify_equivalence
from lightning_ckpt.wrap import CheckpointPlan, ForeignCheckpointingError, apply_policy, get_plan, remove_checkpointing

__version__ = "0.1.0"

register_strategies()

# the profiler is `from lightning_ckpt.profile import profile` (a function of that name here would hide the module)
__all__ = [
    "GRAMMAR",
    "MODES",
    "ActivationCheckpointing",
    "ActivationCheckpointingMixin",
    "CheckpointPlan",
    "Controller",
    "DDPActivationCheckpointingStrategy",
    "FSDPActivationCheckpointingStrategy",
    "ForeignCheckpointingError",
    "Ledger",
    "LedgerInputs",
    "OutOfMemoryDiagnosis",
    "Policy",
    "SingleDeviceActivationCheckpointingStrategy",
    "StepMeter",
    "apply_policy",
    "build_ledger",
    "count_tokens",
    "find_blocks",
    "format_bytes",
    "get_plan",
    "parse_policy",
    "parse_size",
    "plan_budget",
    "plan_from_numbers",
    "plan_model",
    "preflight",
    "register_strategies",
    "remove_checkpointing",
    "verify_equivalence",
]
