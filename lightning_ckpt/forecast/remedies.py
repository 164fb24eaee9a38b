"""Every remedy for a job that does not fit, priced side by side, and how each strategy lays a job out per rank.

Pure arithmetic on a forecast: a :class:`Job` is made from numbers (:mod:`lightning_ckpt.forecast.numbers`) or from
a traced model's forecast (``plan --model``, whose measured phases beyond these formulas are kept as they are); no
torch, no Lightning. A remedy is a :class:`Layout` (what it changes in the job) priced by :func:`price` into a
:class:`Remedy` row: the ledger
one GPU holds after it (``lines``), the step's peak by phase, whether it fits, what it costs and what it changes
in the training. :func:`remedies` builds the rows for one job and :func:`recommend` picks two of them.

Per rank (:data:`STRATEGIES`; N ranks, T trainable parameters, ring collectives moving (N−1)/N of a tensor):

=========================  ================================================================================
``single``, ``ddp``        everything whole; DDP adds its gradient buckets (one more gradient-sized buffer:
                           ``gradient_as_bucket_view=False``, Lightning's default) and all-reduces 2·G
``deepspeed_stage_1``      optimizer state and master copy /N, plus an fp32 gradient partition (T·4/N) when
                           there is an fp32 master copy; gradients whole
``deepspeed_stage_2``      as stage 1 with the gradients /N, plus one reduce bucket (5e8 elements) in backward
``deepspeed_stage_3``      as stage 2 with the parameters /N, plus two blocks' parameters gathered in flight
                           (the one running and the one prefetched) and, in backward, one block's gradients
``fsdp`` (FSDP2)           parameters, gradients, optimizer state, master copy /N, plus two blocks'
                           unsharded parameters in flight and one block's unsharded gradients in backward
``…_offload``              the optimizer state, master copy and fp32 gradient partition on the host (stage 1's
                           whole gradients stay on the GPU; stages 2 and 3 and ``fsdp_offload`` move their sharded
                           gradients, stage 3 and ``fsdp_offload`` the sharded parameters too)
=========================  ================================================================================

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (``4·P + 16·P/N``) and
``estimate_zero3_model_states_mem_needs`` (``4·largest_layer + 18·P/N``) are the reference (tests/forecast/
test_remedies.py), for bf16 weights and gradients, fp32 moments and an fp32 master copy; their offload forms
(2·P; 4·largest_layer) are matched by ``_offload``. Stage 3 here is the latter with one block as the largest layer
(the running block and the prefetched one gathered; DeepSpeed's largest layer is one module's own parameters, so
the plan is higher by 4·(block − that layer)), plus the bf16 gradient partition (2·P/N, the flat buffer the
gradients are reduced into before the fp32 copy, which the estimator leaves out) and, in backward, one reduce
bucket. Stage 2 here is the former less 2·P − 2·P/N: it holds the bf16 gradient partition and one reduce bucket
where the estimator counts every bf16 gradient (``2·P``); the bucketed reduction (``contiguous_gradients``,
DeepSpeed's default) never keeps them all. Neither estimator counts activations; these rows do.

Costs are per optimizer step: ``recompute`` (the share of the blocks' forward run again), ``host_device_bytes``
(PCIe traffic), ``communicated_bytes`` (per rank), ``gpus_added`` and ``micro_batches``. The cheapest row orders
them in that order of price: more GPUs first, then host traffic (PCIe is ~20x slower than the GPU's memory), then
recomputed forward, then extra micro-batches, then bytes communicated; a tie goes to the row that changes less in the
training, then to the lower peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.forecast.numbers import (
    DTYPE_BYTES,
    OPTIMIZER_MOMENTS,
    ForecastInputs,
    adafactor_values,
    backward_first_fraction,
    forecast_from_numbers,
    recomputed_fraction,
)

__all__ = [
    "BLOCKWISE_4BIT",
    "BLOCKWISE_8BIT",
    "NF4_BYTES",
    "STRATEGIES",
    "Job",
    "Layout",
    "Remedy",
    "RunFacts",
    "cost_text",
    "deepspeed_zero2_reference",
    "deepspeed_zero3_reference",
    "lora_fraction",
    "price",
    "recommend",
    "remedies",
]

# bytes per value of a blockwise-quantised Adam moment: the codes plus one fp32 scale per block (bitsandbytes and
# torchao 8-bit: blocks of 256; torchao 4-bit: blocks of 128)
BLOCKWISE_8BIT = 1 + 4 / 256
BLOCKWISE_4BIT = 0.5 + 4 / 128
# NF4 base weights (QLoRA; bitsandbytes and torchao): 4-bit codes, an 8-bit scale per 64 values, and an fp32
# scale per 256 of those (double quantisation)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
DDP_BUCKET = 25 * 2**20
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements (reduce_bucket_size)
STRATEGIES = ("single", "ddp", "fsdp", "fsdp_offload", "deepspeed_stage_1", "deepspeed_stage_1_offload",
              "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload")
_SHARDED = {  # which lines a strategy divides by N: parameters, gradients, optimizer state and master copy
    "single": "", "ddp": "", "fsdp": "pgom", "deepspeed_stage_1": "om", "deepspeed_stage_2": "gom",
    "deepspeed_stage_3": "pgom"}


@dataclass(frozen=True)
class Layout:
    """What a remedy changes in the job (every field's default keeps the job as it is).

    Attributes:
        name: the row's name.
        policy: the activation-checkpointing policy.
        accumulation: micro-batches per optimizer step (the micro-batch divided by it, the effective batch kept).
        moment_bytes: optimizer-state bytes per trainable parameter (``None``: the job's optimizer).
        master: keep the job's master copy.
        trainable: trainable parameters as a share of the model's (LoRA: the adapters, added to the model).
        base_bytes: bytes per frozen base parameter (QLoRA's NF4); ``None`` keeps the parameter dtype.
        strategy: one of :data:`STRATEGIES`; ``world_size`` its ranks.
        activation_offload: saved activations go to the host (one block's interior stays on the GPU).
        zero_grad_before_forward: the previous step's gradients are freed before the first micro-batch's forward.
        split_batch: the micro-batch is divided among the ``world_size`` ranks (the global batch kept).
        changes: what the remedy changes in the training ((): nothing).
        how: where to switch it on (a class, an argument, a Trainer strategy).
    """

    name: str
    policy: str = "none"
    accumulation: int = 1
    moment_bytes: Optional[float] = None
    master: bool = True
    trainable: float = 1.0
    base_bytes: Optional[float] = None
    strategy: str = "single"
    world_size: int = 1
    activation_offload: bool = False
    zero_grad_before_forward: bool = False
    split_batch: bool = False
    changes: Tuple[str, ...] = ()
    how: str = ""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy={self.strategy!r} is not known; choose one of {list(STRATEGIES)}.")
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"--world-size={self.world_size!r} must be a whole number of GPUs, 1 or more.")


@dataclass(frozen=True)
class Remedy:
    """One priced row; every size in bytes, on one GPU (rank 0).

    Attributes:
        name: what the row does.
        lines: the ledger after it (``parameters``, ``gradients``, ``optimizer state``, ``master copy``,
            ``activations``, ``in flight`` for buffers a strategy adds, ``host`` for what lives off the GPU).
        peak: the step's peak on the GPU; ``phases`` the peak of ``forward``, ``backward`` and ``optimizer``.
        fits: ``peak <= capacity`` (``None`` without a capacity).
        cost: ``recompute``, ``host_device_bytes``, ``communicated_bytes``, ``gpus_added``, ``micro_batches``.
        changes_training: whether the training itself changes; ``changes`` says how.
        how: where to switch it on.
    """

    name: str
    lines: Dict[str, int]
    phases: Dict[str, int]
    peak: int
    fits: Optional[bool]
    cost: Dict[str, float]
    changes_training: bool
    changes: List[str] = field(default_factory=list)
    layout: Dict[str, object] = field(default_factory=dict)
    how: str = ""

    def as_json(self) -> Dict[str, object]:
        return asdict(self)

    def price_key(self) -> Tuple[float, ...]:
        """Cheapest first (module docstring): GPUs, host traffic, recompute, micro-batches, communication, then the
        fewer changes to the training, then the lower peak."""
        c = self.cost
        return (c["gpus_added"], c["host_device_bytes"], c["recompute"], c["micro_batches"], c["communicated_bytes"],
                len(self.changes), self.peak)


def lora_fraction(rank: int, layers: int, hidden: int, params: float) -> float:
    """LoRA adapters at ``rank`` on the four matrices of every GPT-2-layout block (h×3h, h×h, h×4h, 4h×h: an r×(in +
    out) pair each, 16·r·h per block), as a share of ``params``."""
    return layers * 16 * rank * hidden / params


@dataclass(frozen=True)
class RunFacts:
    """What a training run is, beside its measured ledger, for :meth:`Job.from_ledger` (read from the model, its
    optimizers and the plan; :func:`lightning_ckpt.forecast.measured.run_facts`).

    Attributes:
        params: parameter elements this process holds; ``trainable`` those that train.
        width: the hidden width (the dimension most frequent among the parameters' shapes).
        blocks: the repeated blocks; ``micro_batch`` the samples of the largest micro-batch (0: not known).
        policy: the plan's name; ``recompute`` the share of the blocks it checkpoints.
        optimizer: the optimizer's kind (``"adamw"``, ``"sgd"``, ``"momentum"``, ``"adamw8bit"``, ...).
        param_dtype: the dtype most of the parameters' elements have.
        zero_grad_before_forward: the run frees the previous step's gradients before the forward.
    """

    params: int
    trainable: int
    width: int
    blocks: int
    micro_batch: int
    policy: str = "none"
    recompute: float = 0.0
    optimizer: str = "adamw"
    param_dtype: str = "float32"
    zero_grad_before_forward: bool = False


@dataclass(frozen=True)
class Job:
    """The job as a remedy sees it: counts, bytes per element and the traced or estimated activations.

    Attributes:
        params: parameters (elements); ``trainable`` the share that trains.
        param_bytes, grad_bytes, master_bytes: bytes per parameter, per trainable gradient, per master value.
        optimizer: the optimizer state's bytes; ``moments`` values per trainable parameter (Adam 2).
        layers, hidden: the repeated blocks and their width (GPT-2 layout for block sizes and LoRA).
        micro_batch: sequences per micro-batch; ``capacity`` the GPU's bytes (or ``None``).
        activations: per policy, activation bytes at the peak; ``interior`` one block's.
        temporaries: per policy, the optimizer step's bytes beyond the model state.
        extra: per policy and phase, what a trace measured beyond these formulas (0 from numbers).
        param_dtype, optimizer_name: as given, for the rows' words.
        recompute: per policy, the share of the blocks' forward it runs again, where the policy's name does not say
            it (a measured run's plan); others are read from the name.
        zero_grad_before_forward: the job already frees the previous step's gradients before the forward.
    """

    params: float
    param_bytes: float
    grad_bytes: float
    master_bytes: float
    optimizer: float
    moments: int
    layers: int
    hidden: int
    micro_batch: int
    capacity: Optional[int]
    activations: Dict[str, int]
    interior: int
    temporaries: Dict[str, int]
    trainable: float = 1.0
    extra: Dict[str, Dict[str, int]] = field(default_factory=dict)
    param_dtype: str = "bf16"
    optimizer_name: str = "adam"
    recompute: Dict[str, float] = field(default_factory=dict)
    zero_grad_before_forward: bool = False

    @property
    def policies(self) -> Tuple[str, ...]:
        return tuple(self.activations)

    @property
    def block_params(self) -> float:
        return min(self.params / self.layers, 12 * self.hidden**2 + 13 * self.hidden)

    @classmethod
    def from_numbers(cls, inputs: ForecastInputs) -> "Job":
        """The job ``plan --params`` describes; ``none`` is always among its policies (the job as it is)."""
        policies = tuple(dict.fromkeys(("none", *inputs.policies)))
        base = forecast_from_numbers(replace(inputs, policies=policies, capacity=None))
        opt = inputs.optimizer.lower()
        return cls(params=inputs.params, param_bytes=DTYPE_BYTES[inputs.param_dtype.lower()],
                   grad_bytes=DTYPE_BYTES[inputs.grad_dtype.lower()],
                   master_bytes=DTYPE_BYTES[inputs.master_dtype.lower()], optimizer=base.optimizer,
                   moments=OPTIMIZER_MOMENTS[opt], layers=inputs.layers, hidden=inputs.hidden,
                   micro_batch=inputs.micro_batch, capacity=inputs.capacity, activations=dict(base.activations),
                   interior=base.block_interior,
                   temporaries={p: v["optimizer"] - base.model_state for p, v in base.phase_peaks.items()},
                   param_dtype=inputs.param_dtype, optimizer_name=opt)

    @classmethod
    def from_forecast(cls, forecast) -> "Job":
        """The job a ``plan --model`` trace measured (:class:`~lightning_ckpt.forecast.trace.ModelForecast`): its
        lines and activations as traced, the width read back from one hidden-width tensor, and what each phase
        measured beyond these formulas kept as ``extra``."""
        inputs = forecast.inputs
        n = forecast.num_params
        trainable = forecast.grads / forecast.params if forecast.params else 1.0  # a gradient has its weight's dtype
        t = trainable * n
        # activations run in autocast's dtype under a mixed precision, else in the weights' own
        act_bytes = 2 if str(forecast.precision).startswith(("bf16", "16")) else max(1, round(forecast.params / n))
        tokens = inputs["micro_batch"] * inputs["seq_len"]
        hidden = max(1, round(forecast.hidden_tensor / (tokens * act_bytes)))
        opt = str(inputs.get("optimizer") or "adamw").lower()
        moments = OPTIMIZER_MOMENTS.get(opt, 2)
        job = cls(params=n, param_bytes=forecast.params / n, grad_bytes=forecast.grads / t if t else 0.0,
                  master_bytes=forecast.master / t if t else 0.0, optimizer=forecast.optimizer, moments=moments,
                  layers=max(1, forecast.blocks), hidden=hidden, micro_batch=inputs["micro_batch"],
                  capacity=forecast.capacity, activations=dict(forecast.activations),
                  interior=forecast.block_interior,
                  temporaries={p: v["optimizer"] - forecast.model_state for p, v in forecast.phase_peaks.items()},
                  trainable=trainable, param_dtype=str(inputs.get("param_dtype") or "as built"), optimizer_name=opt)
        extra = {}
        for policy, measured in forecast.phase_peaks.items():
            formula = price(job, Layout(policy, policy=policy)).phases
            extra[policy] = {k: measured[k] - formula[k] for k in formula}
        return replace(job, extra=extra)

    @classmethod
    def from_ledger(cls, ledger, facts: RunFacts, capacity: Optional[int] = None) -> "Job":
        """The job a training run measured: its lines as its ledger
        (:class:`~lightning_ckpt.measure.ledger.Ledger`) counted them, one policy (the run's own) with its measured
        activations, and what its measured phases hold beyond these formulas kept as ``extra`` (inputs, the
        loss's temporaries, autocast's copies). ``extra`` is never negative: a first step's forward holds no
        previous gradients, and the rows price the steps after it. One block's interior is its share of the
        measured activations; the optimizer step's temporaries are its measured peak less the model state.
        ``capacity`` (default: the ledger's) decides ``fits``."""
        n = max(1, facts.params)
        t = facts.trainable
        policy = facts.policy
        act = int(ledger.activations or 0)
        model_state = ledger.params + ledger.grads + ledger.optimizer
        peaks = dict(ledger.phase_peaks or {})
        job = cls(params=n, param_bytes=ledger.params / n, grad_bytes=ledger.grads / t if t else 0.0,
                  master_bytes=ledger.master / t if t else 0.0, optimizer=ledger.optimizer - ledger.master,
                  moments=OPTIMIZER_MOMENTS.get(facts.optimizer, 2), layers=max(1, facts.blocks),
                  hidden=max(1, facts.width), micro_batch=max(1, facts.micro_batch),
                  capacity=capacity if capacity is not None else ledger.capacity, activations={policy: act},
                  interior=act // max(1, facts.blocks),
                  temporaries={policy: max(0, peaks.get("optimizer", model_state) - model_state)},
                  trainable=t / n, param_dtype=facts.param_dtype, optimizer_name=facts.optimizer,
                  recompute={policy: facts.recompute}, zero_grad_before_forward=facts.zero_grad_before_forward)
        if not peaks:
            return job
        formula = price(job, Layout(policy, policy=policy)).phases
        return replace(job, extra={policy: {k: max(0, peaks[k] - formula[k]) for k in formula if k in peaks}})


def price(job: "Job | ForecastInputs", layout: Layout) -> Remedy:
    """The row for ``layout`` applied to ``job`` (a :class:`Job`, or the numbers it is made from; see the module
    docstring)."""
    if isinstance(job, ForecastInputs):
        job = Job.from_numbers(job)
    n, N = job.params, layout.world_size
    pb, gb = job.param_bytes, job.grad_bytes
    mb = job.master_bytes if layout.master else 0
    # LoRA's adapters are trainable parameters added to the frozen model; otherwise the model's own share trains
    adapters = layout.trainable < 1.0
    t = (layout.trainable if adapters else job.trainable) * n
    share = t / (job.trainable * n)
    params = (n * (layout.base_bytes if layout.base_bytes is not None else pb)) + (t * pb if adapters else 0)
    grads, master = t * gb, t * mb
    optimizer = job.optimizer * share if layout.moment_bytes is None else t * layout.moment_bytes
    sharded = _SHARDED[layout.strategy.replace("_offload", "")]
    deepspeed = layout.strategy.startswith("deepspeed")
    partition = t * mb if deepspeed and mb >= 4 else 0  # DeepSpeed's fp32 gradients for an fp32 master copy
    lines = {"parameters": params / N if "p" in sharded else params,
             "gradients": grads / N if "g" in sharded else grads,
             "optimizer state": optimizer / N if "o" in sharded else optimizer,
             "master copy": master / N if "m" in sharded else master}
    in_flight = _in_flight(layout, job, t)
    lines["gradients"] += partition / N
    host = _offloaded(layout, lines, partition / N)
    micro = job.micro_batch // layout.accumulation // (N if layout.split_batch else 1)
    act_full = job.activations[layout.policy] * micro // job.micro_batch
    act = min(act_full, job.interior * micro // job.micro_batch) if layout.activation_offload else act_full
    host += act_full - act
    lines["activations"] = act
    lines["in flight"] = in_flight["persistent"]
    lines = {k: round(v) for k, v in lines.items()}
    lines["host"] = round(host)
    phases = _phases(job, layout, lines, in_flight, share)
    peak = max(phases.values())
    fits = None if job.capacity is None else peak <= job.capacity
    cost = _cost(job, layout, lines, grads, params, act_full)
    return Remedy(layout.name, lines, phases, peak, fits, cost, bool(layout.changes), list(layout.changes),
                  asdict(layout), _how(layout, own=layout.policy in job.recompute))


def _in_flight(layout: Layout, job: Job, t: float) -> Dict[str, float]:
    """Buffers a strategy adds: DDP's buckets (persistent), DeepSpeed's reduce bucket, the gathered blocks."""
    s = layout.strategy.replace("_offload", "")
    gathered = job.block_params * job.param_bytes
    block_grads = job.block_params * t / job.params * job.grad_bytes
    if s == "ddp" and layout.world_size > 1:
        return {"persistent": t * job.grad_bytes, "forward": 0, "backward": 0}
    if s in ("deepspeed_stage_2", "deepspeed_stage_3"):
        bucket = min(DEEPSPEED_REDUCE_BUCKET, t) * job.grad_bytes
        extra = 2 * gathered if s == "deepspeed_stage_3" else 0
        return {"persistent": 0, "forward": extra, "backward": extra + bucket}
    if s == "fsdp" and layout.world_size > 1:
        return {"persistent": 0, "forward": 2 * gathered, "backward": 2 * gathered + block_grads}
    return {"persistent": 0, "forward": 0, "backward": 0}


def _offloaded(layout: Layout, lines: Dict[str, float], partition: float) -> float:
    """Moves what offload keeps on the host out of ``lines``; returns its bytes. ``partition``: DeepSpeed's fp32
    gradient partition, part of the ``gradients`` line."""
    if not layout.strategy.endswith("_offload"):
        return 0.0
    names = ["optimizer state", "master copy"]
    if layout.strategy in ("deepspeed_stage_3_offload", "fsdp_offload"):
        names += ["parameters"]
    host = 0.0
    if layout.strategy == "deepspeed_stage_1_offload":
        # stage 1 does not partition the gradients: each rank's whole gradients stay on the GPU through backward,
        # only the fp32 partition the host optimizer steps moves
        host, lines["gradients"] = partition, lines["gradients"] - partition
    elif layout.strategy.startswith("deepspeed") or layout.strategy == "fsdp_offload":
        names += ["gradients"]  # the fp32 partition the host optimizer steps (FSDP2: the sharded gradients)
    for name in names:
        host, lines[name] = host + lines[name], 0
    return host


def _phases(job: Job, layout: Layout, lines: Dict[str, int], in_flight: Dict[str, float],
            share: float) -> Dict[str, int]:
    """Forward, backward and optimizer peaks on the GPU, in Lightning's order (numbers.forecast_from_numbers)."""
    grads, act = lines["gradients"], lines["activations"]
    static = lines["parameters"] + lines["optimizer state"] + lines["master copy"] + lines["in flight"]
    zeroed = layout.zero_grad_before_forward or job.zero_grad_before_forward
    held = layout.accumulation > 1 or not zeroed  # the previous step's gradients alive through the forward
    first = round(grads * (1 / job.layers if layout.trainable < 1 else
                           backward_first_fraction(job.params, job.layers, job.hidden)))
    backward = static + (grads + act if layout.accumulation > 1 else max(act + first, grads))
    temporaries = job.temporaries[layout.policy] * share / layout.world_size
    if layout.moment_bytes is not None or layout.strategy.endswith("_offload"):
        temporaries = 0  # a quantised or host optimizer steps without torch's multi-tensor temporaries
    extra = job.extra.get(layout.policy, {})
    return {"forward": round(static + (grads if held else 0) + act + in_flight["forward"]) + extra.get("forward", 0),
            "backward": round(backward + in_flight["backward"]) + extra.get("backward", 0),
            "optimizer": round(static + grads + temporaries) + extra.get("optimizer", 0)}


def _cost(job: Job, layout: Layout, lines: Dict[str, int], grads: float, params: float,
          act_full: int) -> Dict[str, float]:
    N, s = layout.world_size, layout.strategy
    ring = (N - 1) / N
    core = s.replace("_offload", "")
    if core in ("single",) or N == 1:
        communicated = 0.0
    elif core == "ddp":
        communicated = 2 * ring * grads
    elif core in ("deepspeed_stage_1", "deepspeed_stage_2"):
        communicated = ring * (grads + params)
    else:  # parameters gathered in forward and again in backward, every micro-batch; gradients reduce-scattered
        communicated = layout.accumulation * ring * (2 * params + grads)
    host = 0.0
    if s.endswith("_offload"):  # gradients down, updated parameters up (stage 3: parameters up for every gather)
        host = (grads + params) / N
        if s in ("deepspeed_stage_3_offload", "fsdp_offload"):
            host += 2 * layout.accumulation * params / N
    if layout.activation_offload:
        host += 2 * (act_full - lines["activations"]) * layout.accumulation
    recompute = job.recompute.get(layout.policy)
    if recompute is None:
        recompute = recomputed_fraction(layout.policy, job.layers)
    recompute = 0.0 if layout.activation_offload else recompute
    return {"recompute": round(recompute, 4), "host_device_bytes": round(host),
            "communicated_bytes": round(communicated), "gpus_added": N - 1, "micro_batches": layout.accumulation}


def cost_text(row: Remedy) -> str:
    """What ``row`` costs per optimizer step, in words (``"nothing"`` when it costs nothing)."""
    c = row.cost
    parts = []
    if c["recompute"]:
        parts.append(f"recomputes {c['recompute']:.0%} of the blocks' forward")
    if c["micro_batches"] > 1:
        parts.append(f"{c['micro_batches']} micro-batches per step")
    if c["host_device_bytes"]:
        parts.append(f"{format_bytes(c['host_device_bytes'])} host↔GPU per step")
    if c["gpus_added"]:
        parts.append(f"{c['gpus_added']} more GPU(s), {format_bytes(c['communicated_bytes'])} communicated per step")
    return "; ".join(parts) or "nothing"


def _how(layout: Layout, own: bool = False) -> str:
    """Where to switch the row on: the remedy's own ``how``, the checkpointing policy (not a measured run's own plan,
    ``own``), zeroing gradients early."""
    parts = [layout.how] if layout.how else []
    if layout.policy != "none" and not own:
        parts.append(f"ActivationCheckpointing(policy={layout.policy!r})")
    if layout.zero_grad_before_forward:
        parts.append("ActivationCheckpointing(zero_grad_before_forward=True)")
    if layout.accumulation > 1:
        parts.append(f"Trainer(accumulate_grad_batches={layout.accumulation}) with the micro-batch ÷ "
                     f"{layout.accumulation}")
    return "; ".join(parts)


def _single_remedies(job: Job, lora_rank: int, trainable: Optional[float],
                     world_sizes: Sequence[int]) -> List[Layout]:
    rows: List[Layout] = []
    mb, t = job.micro_batch, job.trainable * job.params
    rows += [Layout(f"micro-batch {mb // k} × {k} accumulated", accumulation=k) for k in range(2, mb + 1)
             if mb % k == 0]
    per_value = job.optimizer / (t * job.moments) if job.moments and t else 0.0
    if per_value > 2.5:  # fp32 moments (a step counter or two per tensor aside)
        rows.append(Layout("bf16 moments", moment_bytes=job.optimizer / t * 2 / per_value,
                           changes=("numerics: moments in bf16",),
                           how="an optimizer keeping its moments in bf16 (torch's AdamW keeps them in the dtype of "
                               "the weights it steps)"))
    if job.master_bytes:
        rows.append(Layout("no master copy", master=False,
                           changes=(f"numerics: updates applied to the {job.param_dtype} weights",),
                           how="Trainer(precision='bf16-true') without a float32 copy of the weights"))
    if job.optimizer_name in ("adam", "adamw"):
        rows.append(Layout("8-bit optimizer state", moment_bytes=2 * BLOCKWISE_8BIT,
                           changes=("numerics: blockwise 8-bit moments",),
                           how="bitsandbytes.optim.AdamW8bit or torchao.optim.AdamW8bit"))
        rows.append(Layout("4-bit optimizer state", moment_bytes=2 * BLOCKWISE_4BIT,
                           changes=("numerics: blockwise 4-bit moments",), how="torchao.optim.AdamW4bit"))
    if job.optimizer_name != "adafactor":
        per_param = adafactor_values(job.params, job.layers, job.hidden) * 4 / job.params
        rows.append(Layout("Adafactor (factored)", moment_bytes=per_param,
                           changes=("numerics: another optimizer (factored second moment, no first moment)",),
                           how="torch.optim.Adafactor"))
    if trainable is None and job.trainable < 1:
        trainable = job.trainable  # the model already trains a share of itself (adapters): price that share
    share = trainable if trainable is not None else lora_fraction(lora_rank, job.layers, job.hidden, job.params)
    what = f"trainable parameters: {share:.2%} (adapters only)"
    label = f"rank {lora_rank}" if trainable is None else f"{share:.2%} trainable"
    rows.append(Layout(f"LoRA {label}", trainable=share, changes=(what,),
                       how=f"peft.get_peft_model(model, LoraConfig(r={lora_rank}, target_modules='all-linear'))"))
    rows.append(Layout(f"QLoRA {label}", trainable=share, base_bytes=NF4_BYTES,
                       changes=(what, "numerics: 4-bit (NF4) base weights"),
                       how="the model loaded with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'), "
                           f"then LoraConfig(r={lora_rank})"))
    for strategy in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"):
        for n in world_sizes:
            rows.append(_sharded(job, strategy, n))
    rows.append(Layout("optimizer-state offload", strategy="deepspeed_stage_2_offload",
                       how="Trainer(strategy='deepspeed_stage_2_offload'), or torchao's CPUOffloadOptimizer"))
    rows.append(Layout("activation offload", activation_offload=True,
                       how="ActivationCheckpointing(policy='offload')"))
    if not job.zero_grad_before_forward:
        rows.append(Layout("zero gradients before forward", zero_grad_before_forward=True))
    return rows


def _sharded(job: Job, strategy: str, n: int) -> Layout:
    """Sharding over ``n`` GPUs keeps the global batch when the micro-batch divides among them."""
    name = {"fsdp": "FSDP2", "deepspeed_stage_2": "ZeRO-2", "deepspeed_stage_3": "ZeRO-3"}[strategy]
    split = job.micro_batch % n == 0
    changes = () if split else (f"effective batch ×{n} (micro-batch {job.micro_batch} on every GPU)",)
    per_rank = job.micro_batch // n if split else job.micro_batch
    how = {"fsdp": "Trainer(strategy=ModelParallelStrategy(), devices={n}) with fully_shard on every block",
           "deepspeed_stage_2": "Trainer(strategy='deepspeed_stage_2', devices={n})",
           "deepspeed_stage_3": "Trainer(strategy='deepspeed_stage_3', devices={n})"}[strategy].format(n=n)
    return Layout(f"{name} × {n} GPUs (micro-batch {per_rank} each)", strategy=strategy, world_size=n,
                  split_batch=split, changes=changes, how=how)


def remedies(job: "Job | ForecastInputs", lora_rank: int = 16, trainable: Optional[float] = None,
             world_size: Optional[int] = None) -> List[Remedy]:
    """Every remedy for ``job`` as a priced row: its checkpointing policies, then each other remedy on its own, then,
    for each that does not fit alone, the cheapest combination with a policy (and zeroing the gradients before the
    forward) that does. ``world_size`` fixes the GPUs the sharding rows use; by default each uses the fewest of 2,
    4, 8 that fits (8 when none does)."""
    if isinstance(job, ForecastInputs):
        job = Job.from_numbers(job)
    rows = [price(job, Layout(p, policy=p)) for p in job.policies]
    base = "none" if "none" in job.policies else job.policies[0]  # a measured run: its own plan, kept
    for layout in _single_remedies(job, lora_rank, trainable, [world_size] if world_size else [2, 4, 8]):
        rows.append(price(job, replace(layout, policy=base) if layout.policy == "none" else layout))
    if world_size is None:
        rows = _fewest_gpus(rows)
    combined = []
    for row in rows[len(job.policies):]:
        if row.fits is False:
            combo = _combination(job, Layout(**row.layout))
            if combo is not None:
                combined.append(combo)
    return rows + combined


def _fewest_gpus(rows: List[Remedy]) -> List[Remedy]:
    """Of the sharding rows for one strategy, keep the fewest GPUs that fit (the most when none fits; the fewest
    without a capacity)."""
    out, by_strategy = [], {}
    for row in rows:
        s = row.layout["strategy"]
        if s in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"):
            by_strategy.setdefault(s, []).append(row)
        else:
            out.append(row)
    for group in by_strategy.values():
        out.append(next((r for r in group if r.fits), group[-1] if group[0].fits is False else group[0]))
    return out


def _combination(job: Job, layout: Layout) -> Optional[Remedy]:
    """The cheapest fitting row of ``layout`` plus a checkpointing policy and/or zeroing gradients early."""
    candidates = []
    for policy in job.policies:
        for zero in (False, True) if not job.zero_grad_before_forward else (False,):
            if policy == layout.policy and zero == layout.zero_grad_before_forward:
                continue
            parts = [layout.name] + ([policy] if policy != layout.policy else []) + (["zero gradients"] if zero else [])
            candidates.append(price(job, replace(layout, name=" + ".join(parts), policy=policy,
                                                    zero_grad_before_forward=zero or layout.zero_grad_before_forward)))
    fitting = [r for r in candidates if r.fits]
    return min(fitting, key=Remedy.price_key) if fitting else None


def recommend(rows: Sequence[Remedy]) -> Tuple[Optional[Remedy], Optional[Remedy]]:
    """The cheapest row that fits without changing the training, and the cheapest that fits at all."""
    fitting = [r for r in rows if r.fits]
    keep = [r for r in fitting if not r.changes_training]
    return (min(keep, key=Remedy.price_key) if keep else None,
            min(fitting, key=Remedy.price_key) if fitting else None)


def deepspeed_zero2_reference(params: float, gpus: int, cpu_offload: bool = False) -> int:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs`` GPU bytes: 4·P + 16·P/N, or 2·P with ``cpu_offload``."""
    p = int(params)
    return 2 * p if cpu_offload else 4 * p + int(16 * p / gpus)


def deepspeed_zero3_reference(params: float, largest_layer: float, gpus: int, cpu_offload: bool = False) -> int:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` GPU bytes: 4·largest_layer + 18·P/N, or
    4·largest_layer with ``cpu_offload`` (optimizer and parameters on the host, as Lightning's
    ``deepspeed_stage_3_offload``)."""
    largest = 4 * int(largest_layer)
    return largest if cpu_offload else largest + int(18 * int(params) / gpus)
