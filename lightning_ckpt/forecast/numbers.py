"""Forecast the training-memory ledger for hardware you do not have, from numbers alone.

Model state (exact given the dtypes): parameters, gradients, optimizer moments, an optional master copy.
Adafactor's factored moment depends on the shapes: :func:`adafactor_values` assumes GPT-2's block layout.
Activations (an estimate): one hidden-width tensor is ``micro_batch × seq_len × hidden × act_bytes``; a block
keeps ``tensors_per_block`` of them when not checkpointed (A) and one (its input, B) when checkpointed; eager
attention adds ``5·a·s²·b`` bytes per block (Korthikanti et al. 2022). A fused attention call that PyTorch runs
with the math kernel on the target GPU (``attention_backend="math"``, e.g. bf16 before SM 8.0: the rule is
:func:`lightning_ckpt.forecast.sdpa.select_backend`) adds, per block, what the math kernel saves beyond a fused
kernel: the float32 B·H·L·S probabilities (with dropout also its mask and the dropped copy) and float32 q, k, v,
instead of the fused kernel's q, k, v and logsumexp (:func:`math_attention_extra`). Per policy:

======================  =====================================================================================
``none``                L·A + H
``all``                 max(L·B + H, L·B + A − B)   (boundaries, plus one block's interior while it replays: its
                        input is already a boundary)
``every:N``             max(c·B + (L − c)·A + H, (c − 1)·B + (i − c + 2)·A) with c = ⌈L/N⌉ blocks checkpointed,
                        the last at i = N·(c−1), replayed with every block before it
``group:K``/``sqrt``    max(n·B + H, max over regions r of r·B + K_r·A) with n = ⌈L/K⌉ regions, K_r blocks in
                        region r
======================  =====================================================================================

H is the head at the end of the forward, counted when the vocabulary ``V`` is given (``vocab``): the final norm's
input and output (two hidden-width tensors) and two ``micro_batch × seq_len × V`` tensors in the activation dtype
(the logits and the loss's log-softmax). A model whose loss upcasts the logits to float32 keeps more (``plan
--model`` traces it). Without ``vocab`` the blocks alone are counted, as in the worked example below.

Phases, in Lightning's order: the forward holds the model state with the previous step's gradients (Lightning
frees them between ``training_step`` and ``backward``) plus the activations; backward starts without gradients and
builds them while it frees activations, so its peak is the larger of all activations plus the first gradients built
(the head and embeddings, and the last block's: :func:`backward_first_fraction`) and every gradient at its end; the
optimizer step holds the model state and its temporaries.

``every:N`` checkpoints blocks 0, N, 2N, ... Backward runs from the last block, so when a checkpointed block
replays its interior, the blocks after it (and the head) are already freed: the peak is the end of the forward, or
the replay of the last checkpointed block with everything before it.

The worked example (1.3 B parameters, bf16 parameters and gradients, Adam with fp32 moments and an fp32
master copy, 24 blocks of width 2048, micro-batch 2 × 2048 tokens, bf16 activations) gives 2.42 GiB of
parameters, 2.42 GiB of gradients, 9.69 GiB of moments, 4.84 GiB of master copy — 19.4 GiB of model state —
16 MiB per hidden-width tensor and 384 MiB of boundaries with every block checkpointed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from lightning_ckpt.core.policy import EveryPolicy, GroupPolicy, parse_policy
from lightning_ckpt.forecast.sdpa import BACKENDS, SdpaCall, saved_bytes, saved_for_backward

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZER_MOMENTS",
    "PHASE_LINES",
    "ForecastInputs",
    "LedgerForecast",
    "adafactor_values",
    "attention_call",
    "backward_first_fraction",
    "check_positions",
    "crossing_line",
    "forecast_from_numbers",
    "head_activations",
    "math_attention_extra",
    "optimizer_temporaries",
    "phase_crossing",
    "policy_activations",
    "recomputed_fraction",
]

DTYPE_BYTES: Dict[str, int] = {
    "fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
    "float16": 2, "fp8": 1, "int8": 1, "none": 0,
}
OPTIMIZER_MOMENTS: Dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "momentum": 1, "adafactor": 1, "lion": 1}
DEFAULT_POLICIES = ("none", "every:2", "group:sqrt", "all")
KORTHIKANTI_TENSORS = 17  # 34·s·b·h bytes at 2 bytes per value, fused attention


def _dtype_bytes(name: str, arg: str) -> int:
    key = name.lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"{arg}={name!r} is not a known dtype; choose one of {sorted(set(DTYPE_BYTES))}.")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class ForecastInputs:
    params: float
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    optimizer: str = "adam"
    moment_dtype: str = "fp32"
    master_dtype: str = "none"
    layers: int = 24
    hidden: int = 2048
    micro_batch: int = 1
    seq_len: int = 2048
    act_dtype: str = "bf16"
    heads: int = 16
    tensors_per_block: float = KORTHIKANTI_TENSORS
    attention: str = "fused"
    capacity: Optional[int] = None
    policies: Tuple[str, ...] = DEFAULT_POLICIES
    foreach: bool = False
    attention_backend: Optional[str] = None
    attn_dropout: float = 0.0
    vocab: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "micro_batch", "seq_len", "heads", "tensors_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive number.")
        if self.vocab is not None and (isinstance(self.vocab, bool) or not isinstance(self.vocab, int)
                                       or self.vocab <= 0):
            raise ValueError(f"--vocab-size={self.vocab!r} must be a positive whole number (the vocabulary), or "
                             "left out to count the blocks alone.")
        if self.optimizer.lower() not in OPTIMIZER_MOMENTS:
            raise ValueError(f"--optimizer={self.optimizer!r} is not known; choose one of {sorted(OPTIMIZER_MOMENTS)}.")
        if self.attention not in ("fused", "eager"):
            raise ValueError(f"--attention={self.attention!r}: choose 'fused' or 'eager'.")
        if self.attention_backend not in (None, *BACKENDS):
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of {list(BACKENDS)} or None.")
        if not (isinstance(self.attn_dropout, (int, float)) and 0 <= self.attn_dropout < 1):
            raise ValueError(f"--attn-dropout={self.attn_dropout!r} must be a probability in [0, 1).")
        for arg in ("param_dtype", "grad_dtype", "moment_dtype", "master_dtype", "act_dtype"):
            _dtype_bytes(getattr(self, arg), "--" + arg.replace("_", "-"))
        if not self.policies:
            raise ValueError(f"--policies={self.policies!r} names no policy; pass one or more, e.g. "
                             f"{','.join(DEFAULT_POLICIES)!r}.")
        for policy in self.policies:
            parsed = parse_policy(policy)
            if parsed.name not in ("none", "all", "every", "group"):
                raise ValueError(f"policy {policy!r} cannot be predicted from numbers alone; use none, all, "
                                 "every:N or group:K/sqrt (or --model to trace the real model).")


@dataclass(frozen=True)
class LedgerForecast:
    """The predicted ledger; every figure in bytes.

    ``phase_peaks[policy]`` holds the peak of the step's ``forward`` (model state + activations), ``backward``
    (gradients building while activations are freed, plus the replay transient) and ``optimizer`` phase (model
    state + the optimizer step's temporaries); ``peak[policy]`` is the highest of the three, the figure the
    verdict (``fits``) uses.
    """

    params: int
    grads: int
    optimizer: int
    master: int
    model_state: int
    hidden_tensor: int
    boundary_all: int
    block_interior: int
    activations: Dict[str, int]
    peak: Dict[str, int]
    capacity: Optional[int]
    fits: Dict[str, Optional[bool]]
    crosses: Dict[str, Optional[str]]
    inputs: Dict[str, object] = field(default_factory=dict)
    phase_peaks: Dict[str, Dict[str, int]] = field(default_factory=dict)

    @property
    def peak_phase(self) -> Dict[str, str]:
        """Per policy, the phase (``forward``, ``backward``, ``optimizer``) whose peak is the step's peak."""
        return {p: max(by_phase, key=by_phase.get) for p, by_phase in self.phase_peaks.items() if by_phase}

    def as_json(self) -> Dict[str, object]:
        return asdict(self)

    def lines(self) -> List[Tuple[str, int]]:
        return [("parameters", self.params), ("gradients", self.grads), ("optimizer moments", self.optimizer),
                ("master copy", self.master)]


def forecast_from_numbers(inputs: ForecastInputs) -> LedgerForecast:
    """Compute the ledger for ``inputs``; see the module docstring for the formulas."""
    n = inputs.params
    params = _whole(n * _dtype_bytes(inputs.param_dtype, "--param-dtype"), "--params", n)
    grads = _whole(n * _dtype_bytes(inputs.grad_dtype, "--grad-dtype"), "--params", n)
    moment_bytes = _dtype_bytes(inputs.moment_dtype, "--moment-dtype")
    if inputs.optimizer.lower() == "adafactor":
        optimizer = _whole(adafactor_values(n, inputs.layers, inputs.hidden) * moment_bytes, "--params", n)
    else:
        optimizer = _whole(n * OPTIMIZER_MOMENTS[inputs.optimizer.lower()] * moment_bytes, "--params", n)
    master = _whole(n * _dtype_bytes(inputs.master_dtype, "--master-dtype"), "--params", n)
    model_state = params + grads + optimizer + master
    act_bytes = _dtype_bytes(inputs.act_dtype, "--act-dtype")
    hidden_tensor = inputs.micro_batch * inputs.seq_len * inputs.hidden * act_bytes
    interior = _whole(inputs.tensors_per_block * hidden_tensor, "--tensors-per-block", inputs.tensors_per_block)
    if inputs.attention == "eager":
        interior += 5 * inputs.heads * inputs.seq_len**2 * inputs.micro_batch
    elif inputs.attention_backend == "math":
        interior += math_attention_extra(inputs)
    head = head_activations(inputs, hidden_tensor)
    activations = {p: policy_activations(p, inputs.layers, hidden_tensor, interior, head) for p in inputs.policies}
    temporaries = optimizer_temporaries(n, inputs.optimizer, inputs.moment_dtype, inputs.foreach)
    # Lightning's order: the previous step's gradients live through the forward; zero_grad frees them before
    # backward, which then builds them while it frees activations (peak at its start or its end)
    first = round(grads * backward_first_fraction(n, inputs.layers, inputs.hidden))
    static = model_state - grads
    phases = {p: {"forward": model_state + a, "backward": static + max(a + first, grads),
                  "optimizer": model_state + temporaries} for p, a in activations.items()}
    peak = {p: max(by_phase.values()) for p, by_phase in phases.items()}
    fits = {p: None if inputs.capacity is None else v <= inputs.capacity for p, v in peak.items()}
    crosses = {p: phase_crossing(crossing_line(params, grads, optimizer, master, activations[p], inputs.capacity),
                                 phases[p], inputs.capacity) for p in inputs.policies}
    return LedgerForecast(params, grads, optimizer, master, model_state, hidden_tensor, inputs.layers * hidden_tensor,
                          interior, activations, peak, inputs.capacity, fits, crosses, asdict(inputs), phases)


_POSITION_TABLE = re.compile(r"wpe|pos", re.IGNORECASE)
_POSITION_FIELDS = ("n_positions", "max_position_embeddings", "block_size")


def check_positions(model: torch.nn.Module, seq_len: int) -> None:
    """Refuse ``seq_len`` past a learned position table (GPT-2's ``wpe``: a longer sequence indexes past its rows
    and the real step fails), naming the limit: the config's ``n_positions``/``max_position_embeddings``/
    ``block_size`` when set (OPT's table has two extra rows), else the table's rows. Rotary and other computed
    positions have no table and no limit here: a config's maximum positions alone never refuses a length."""
    config = getattr(model, "config", None)
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Embedding) and _POSITION_TABLE.search(name.rsplit(".", 1)[-1])):
            continue
        field = next((f for f in _POSITION_FIELDS if isinstance(getattr(config, f, None), int)), None)
        limit = min(getattr(config, field), module.num_embeddings) if field else module.num_embeddings
        if seq_len > limit:
            more = f"a larger {field} in --init-args" if field else "a longer position table"
            raise ValueError(f"--seq-len={seq_len} is past the model's {limit} positions (its position table "
                             f"{name!r}); pass --seq-len {limit} or less, or build the model with {more}.")


def adafactor_values(params: float, layers: int, hidden: int) -> float:
    """Values of Adafactor's factored second moment (``torch.optim.Adafactor``: no first moment; an r×c matrix keeps
    r + c values, a vector all of its own) for a GPT-2-layout model: per block four matrices (3h×h, h×h, 4h×h,
    h×4h: 16h values) and their biases and two LayerNorms (13h, kept whole); the parameters outside the blocks
    (embeddings) as two h-wide matrices. Exact on the demo GPT up to the step counters (0.7 %); another layout of
    the same width differs by a few h per block, a few bytes against gigabytes of weights."""
    outside = max(params - layers * (12 * hidden * hidden + 13 * hidden), 0)
    return layers * 29 * hidden + outside / hidden + 2 * hidden


def _whole(value: float, arg: str, given: float) -> int:
    """``value`` bytes as an ``int``; a figure so large that its bytes overflow a float is refused, naming it."""
    if not math.isfinite(value):
        raise ValueError(f"{arg}={given!r} is too large: its bytes overflow; pass a realistic figure (e.g. --params "
                         "1.3e9, --tensors-per-block 17).")
    return round(value)


_TORCH_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64,
                 "float64": torch.float64}


def attention_call(inputs: ForecastInputs) -> SdpaCall:
    """The attention call of one block the numbers describe: causal self-attention, no mask, head dim
    ``hidden // heads``, in the activation dtype, with ``attn_dropout``."""
    dtype = _TORCH_DTYPES.get(inputs.act_dtype.lower())
    if dtype is None:
        raise ValueError(f"--act-dtype={inputs.act_dtype!r} is not a dtype attention runs in with --sm; choose one "
                         f"of {sorted(_TORCH_DTYPES)}.")
    return SdpaCall(dtype=dtype, head_dim=max(1, int(inputs.hidden) // int(inputs.heads)),
                    batch=int(inputs.micro_batch), heads=int(inputs.heads), q_len=int(inputs.seq_len),
                    dropout=float(inputs.attn_dropout), is_causal=True)


def math_attention_extra(inputs: ForecastInputs) -> int:
    """Bytes per block the math kernel saves beyond a fused kernel for :func:`attention_call`: the math kernel's
    list minus flash's q, k, v, logsumexp and RNG state (flash's output is the output projection's saved input,
    which the math path's projection saves as well)."""
    call = attention_call(inputs)
    fused = sum(t.nbytes for t in saved_for_backward("flash", call) if t.name != "output")
    return saved_bytes("math", call) - fused


def optimizer_temporaries(params: float, optimizer: str, moment_dtype: str, foreach: bool) -> int:
    """Bytes the optimizer step holds beyond the model state, from numbers: the multi-tensor (``foreach``)
    Adam/AdamW step builds ``sqrt(v)`` for every parameter at once (one moment-sized copy, torch's
    ``_multi_tensor_adam``); the single-tensor step holds one parameter's worth at a time (left out here; the
    ``--model`` trace counts it). SGD and momentum update in place."""
    if not foreach or optimizer.lower() not in ("adam", "adamw"):
        return 0
    return round(params * _dtype_bytes(moment_dtype, "--moment-dtype"))


PHASE_LINES = {"forward": "activations", "backward": "backward's gradients and replay",
               "optimizer": "optimizer step's temporaries"}


def phase_crossing(line: Optional[str], phase_peaks: Dict[str, int], capacity: Optional[int]) -> Optional[str]:
    """What crosses capacity: the ledger line (``line``, from :func:`crossing_line`) when one does, otherwise the
    transient of the phase that peaks above capacity (``None`` when every phase fits)."""
    if line is not None or capacity is None or not phase_peaks:
        return line
    phase = max(phase_peaks, key=phase_peaks.get)
    return PHASE_LINES[phase] if phase_peaks[phase] > capacity else None


def backward_first_fraction(params: float, layers: int, hidden: int) -> float:
    """The share of the gradients backward has built while every activation is still alive: the parameters outside
    the blocks (the head and embeddings, GPT-2 layout: :func:`adafactor_values`) and the last block's."""
    block = 12 * hidden * hidden + 13 * hidden
    outside = max(params - layers * block, 0)
    return min(1.0, (outside + min(block, params / layers)) / params)


def recomputed_fraction(policy: str, layers: int) -> float:
    """The share of the blocks' forward that ``policy`` runs again in backward (0 for ``none``, 1 for ``all`` and
    ``group:K``, whose every region replays; ``every:N`` replays its ⌈L/N⌉ checkpointed blocks)."""
    parsed = parse_policy(policy)
    if parsed.name == "none":
        return 0.0
    if isinstance(parsed, EveryPolicy):
        return math.ceil(layers / parsed.n) / layers
    return 1.0


def head_activations(inputs: ForecastInputs, hidden_tensor: int) -> int:
    """H of the module docstring: what the forward holds after the blocks when the vocabulary is given (the final
    norm's input and output, the logits and the loss's log-softmax), else 0."""
    if inputs.vocab is None:
        return 0
    logits = inputs.micro_batch * inputs.seq_len * inputs.vocab * _dtype_bytes(inputs.act_dtype, "--act-dtype")
    return 2 * hidden_tensor + 2 * logits


def policy_activations(policy: str, layers: int, boundary: int, interior: int, head: int = 0) -> int:
    """Activation bytes at the step's peak under ``policy`` for ``layers`` blocks, each keeping ``boundary`` bytes
    when checkpointed and ``interior`` bytes when not, with ``head`` bytes after the blocks at the end of the forward
    (the table in the module docstring): the larger of the forward's end and the largest replay."""
    parsed = parse_policy(policy)
    if parsed.name == "none":
        return layers * interior + head
    if parsed.name == "all":
        return max(layers * boundary + head, layers * boundary + interior - boundary)
    if isinstance(parsed, EveryPolicy):
        # blocks 0, N, 2N, ... are checkpointed; when the last of them (i) replays, the blocks after it are freed
        checkpointed = math.ceil(layers / parsed.n)
        last = parsed.n * (checkpointed - 1)
        forward_end = checkpointed * boundary + (layers - checkpointed) * interior + head
        replay = (checkpointed - 1) * boundary + (last - checkpointed + 1) * interior + interior
        return max(forward_end, replay)
    assert isinstance(parsed, GroupPolicy)
    k = parsed.size(layers)
    sizes = [min(k, layers - start) for start in range(0, layers, k)]
    # region r replays with the r regions before it kept as boundaries: its own input plus its interior minus it
    replay = max(r * boundary + size * interior for r, size in enumerate(sizes))
    return max(len(sizes) * boundary + head, replay)


def crossing_line(params, grads, optimizer, master, activations, capacity, copies: int = 0) -> Optional[str]:
    """The first ledger line at which the running total passes capacity (``None`` when everything fits)."""
    if capacity is None:
        return None
    total = 0
    for name, size in (("parameters", params), ("gradients", grads), ("optimizer moments", optimizer),
                       ("master copy", master), ("activations", activations), ("autocast copies", copies)):
        total += size
        if total > capacity:
            return name
    return None

