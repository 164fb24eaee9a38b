"""Plan a real model's training memory without allocating it: fake tensors, one traced step per policy.

``lightning-ckpt plan --model pkg.module:factory`` (and :func:`plan_model`) builds the model under
``torch._subclasses.fake_tensor.FakeTensorMode``: every parameter, gradient, optimizer moment and activation is a
*fake tensor* with the real shape, dtype and device but no storage, so a 7-billion-parameter model plans on a
laptop in seconds. Then, per policy, the policy is applied with :func:`lightning_ckpt.wrap.apply_policy` and one
forward and backward is run on a fake batch while :class:`ActivationTracker` counts what the activation meter
(:mod:`lightning_ckpt.meter`, default mode) counts on a real run: the bytes saved for backward, once per storage
while it is alive, parameters and buffers excluded, plus the live interior of every checkpointed region while it
is replayed in backward (the *replay transient*). After the first backward the real optimizer steps once on the
fake parameters, so the model-state lines (parameters, gradients, optimizer state, master copies) are read from
the tensors the optimizer actually creates: exact, not estimated.

What ``--model`` accepts (``pkg.module:attr``, ``attr`` may be dotted, e.g. ``pkg.mod:Config.preset``; the
LightningCLI spelling ``pkg.module.Class`` works too):

- a callable returning an ``nn.Module`` (a class, a function); a ``LightningModule`` is stepped with its own
  ``training_step`` and ``configure_optimizers``;
- a callable returning, or an instance of, a Hugging Face ``PretrainedConfig`` (built with
  ``AutoModelForCausalLM.from_config``), or a path to a ``config.json`` / a directory holding one.

Keyword arguments come from ``init_args`` (JSON on the command line) or a LightningCLI-style YAML ``--config``
(``model: {class_path: ..., init_args: {...}}`` or ``model: {...}``). Factories for the demos live here:
:func:`benchmark_gpt`, :func:`tiny_gpt`, :func:`gpt2_config` and :func:`llama_7b_config`.

The batch is the module's ``example_batch(micro_batch, seq_len)`` when it has one (see :mod:`lightning_ckpt.profile`
for the hook's contract), else ``{"input_ids", "labels"}`` of random token ids below the vocabulary size (from
``vocab_size=``, ``model.config.vocab_size`` or the first ``nn.Embedding``). The loss of a step is
:func:`step_loss`: ``training_step(batch, 0)`` for a ``LightningModule``, ``model(**batch).loss`` for a Hugging
Face model, else the model called on ``(input_ids, labels)`` or ``(input_ids)`` (per its signature) with the
loss taken from the output (a scalar, a ``.loss``, the scalar in a tuple, or cross-entropy of logits).

Known limitations:
    - Code that reads tensor *values* (``.item()``, data-dependent shapes, ``if mask.all()``) cannot run on fake
      tensors; the error names the model and suggests the numbers route.
    - Kernel workspaces, allocator rounding and the CUDA context are not tensors and are not predicted
      (``peak = model state + activation peak``, as in the numbers route).
    - Modes that move saved tensors elsewhere (``offload``) are counted as the meter counts them.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import json
import os
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_ckpt.planner import LedgerPlan

__all__ = [
    "TORCH_OPTIMIZERS",
    "ActivationTracker",
    "ModelPlan",
    "benchmark_gpt",
    "build_model",
    "gpt2_config",
    "import_object",
    "llama_7b_config",
    "load_init_args",
    "make_batch",
    "optimizers_from",
    "plan_model",
    "step_loss",
    "tiny_gpt",
]

DEFAULT_POLICIES = ("none", "every:2", "group:sqrt", "all")
TORCH_OPTIMIZERS = ("adamw", "adam", "sgd", "momentum", "adafactor")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


# ------------------------------------------------------------------------------------------- demo factories


def benchmark_gpt(**overrides: Any) -> nn.Module:
    """The demo benchmark GPT (12 blocks, width 512, 8 heads, context 512, vocab 512); fields overridable."""
    from lightning_ckpt.demos.gpt import GPT, GPTConfig

    return GPT(GPTConfig.benchmark(**overrides))


def tiny_gpt(**overrides: Any) -> nn.Module:
    """The demo tiny GPT (4 blocks, width 64, context 64, vocab 96); fields overridable."""
    from lightning_ckpt.demos.gpt import GPT, GPTConfig

    return GPT(GPTConfig.tiny(**overrides))


def gpt2_config(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, n_positions: int = 128, vocab_size: int = 96,
                dropout: float = 0.1, **extra: Any):
    """A Hugging Face ``GPT2Config`` with the demo's defaults (:func:`lightning_ckpt.demos.hf.tiny_gpt2`).

    ``gpt2_config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)`` is GPT-2 small.
    """
    from transformers import GPT2Config

    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=vocab_size,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                      use_cache=False, **extra)


def llama_7b_config(**overrides: Any):
    """A Hugging Face ``LlamaConfig`` of the 7-billion-parameter Llama-2 shape (6.74 B parameters)."""
    from transformers import LlamaConfig

    base = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    return LlamaConfig(**{**base, **overrides})


# ---------------------------------------------------------------------------------------- import and build


def import_object(path: str, *, arg: str = "--model") -> Any:
    """Resolve ``pkg.module:attr.sub`` (or ``pkg.module.Attr``) to the object; ``ValueError`` naming ``arg``."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{arg}={path!r} is not an import path; pass 'pkg.module:Name' (e.g. "
                         "'lightning_ckpt.demos.lightning_gpt:GPTLightningModule').")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{arg}={path!r} is not an import path; pass 'pkg.module:Name' (e.g. "
                         "'lightning_ckpt.demos.lightning_gpt:GPTLightningModule').")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{arg}={path!r}: cannot import module {module_name!r} ({err}); check the spelling and "
                         "that the package is installed or on PYTHONPATH.") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))[:12]
            raise ValueError(f"{arg}={path!r}: {module_name!r} has no attribute {attr!r}; some public names there: "
                             f"{names}.")
        obj = getattr(obj, part)
    return obj


def load_init_args(init_args: Any = None, config: Optional[str] = None) -> Tuple[Optional[str], Dict[str, Any],
                                                                               Optional[Dict[str, Any]]]:
    """Keyword arguments for the target from JSON and/or a LightningCLI-style YAML file.

    Returns:
        ``(class_path, kwargs, data)``: ``class_path`` from ``model.class_path`` in the YAML (or ``None``),
        the merged keyword arguments (JSON wins over YAML), and the YAML's ``data`` section (or ``None``).
    """
    class_path, kwargs, data = None, {}, None
    if config is not None:
        import yaml

        if not os.path.isfile(config):
            raise ValueError(f"--config={config!r} is not a file; pass a YAML file like LightningCLI's "
                             "(model: {class_path: ..., init_args: {...}}).")
        try:
            with open(config, encoding="utf-8") as fh:
                doc = yaml.safe_load(fh) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"--config={config!r} is not valid YAML: {str(err).splitlines()[0]}") from None
        if not isinstance(doc, Mapping):
            raise ValueError(f"--config={config!r} must hold a mapping, not {type(doc).__name__}.")
        model = doc.get("model", doc if "data" not in doc and "trainer" not in doc else {})
        if not isinstance(model, Mapping):
            raise ValueError(f"--config={config!r}: 'model' must be a mapping, not {model!r}.")
        if "class_path" in model:
            class_path = str(model["class_path"])
            kwargs.update(model.get("init_args") or {})
        else:
            kwargs.update(model)
        data = doc.get("data") if isinstance(doc.get("data"), Mapping) else None
    if init_args is not None:
        if isinstance(init_args, str):
            try:
                parsed = json.loads(init_args) if init_args.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"--init-args={init_args!r} is not valid JSON ({err.msg}); pass an object such as "
                                 "'{\"n_layer\": 4}'.") from None
        else:
            parsed = init_args
        if not isinstance(parsed, Mapping):
            raise ValueError(f"--init-args={init_args!r} must be a JSON object of keyword arguments, e.g. "
                             "'{\"n_layer\": 4}'.")
        kwargs.update(parsed)
    return class_path, dict(kwargs), data


def _call(obj: Any, kwargs: Dict[str, Any], label: str, arg: str) -> Any:
    try:
        return obj(**kwargs)
    except TypeError as err:
        raise ValueError(f"{arg}={label!r} rejected the init args {kwargs!r}: {err}") from None


def _is_hf_config(obj: Any) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return isinstance(obj, PretrainedConfig)


def build_model(target: Any, kwargs: Optional[Dict[str, Any]] = None, *, arg: str = "--model") -> nn.Module:
    """Instantiate ``target`` (see the module docstring for what it may be); ``ValueError`` when it cannot.

    Call it under ``FakeTensorMode`` (as :func:`plan_model` does) to build without allocating.
    """
    kwargs = dict(kwargs or {})
    label = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))
    if isinstance(target, str) and (os.path.isdir(target) or target.endswith(".json")):
        if not os.path.exists(target):
            raise ValueError(f"{arg}={target!r}: no such config file.")
        from transformers import AutoConfig

        obj = AutoConfig.from_pretrained(target, **kwargs)
    else:
        obj = import_object(target, arg=arg) if isinstance(target, str) else target
        if isinstance(obj, nn.Module) or _is_hf_config(obj):
            if kwargs:
                raise ValueError(f"{arg}={label!r} is an instance, so it takes no init args (got {kwargs!r}).")
        elif inspect.isclass(obj) and _is_hf_config_class(obj):
            obj = _call(obj, kwargs, label, arg)
        elif callable(obj):
            obj = _call(obj, kwargs, label, arg)
        else:
            raise ValueError(f"{arg}={label!r} is a {type(obj).__name__}, not a callable returning an nn.Module or a "
                             "Hugging Face config.")
    if _is_hf_config(obj):
        from transformers import AutoModelForCausalLM

        try:
            obj = AutoModelForCausalLM.from_config(obj)
        except ValueError as err:
            raise ValueError(f"{arg}={label!r}: Hugging Face cannot build a causal LM from this config ({err}).") \
                from None
    if not isinstance(obj, nn.Module):
        raise ValueError(f"{arg}={label!r} returned a {type(obj).__name__}; it must return a torch.nn.Module or a "
                         "Hugging Face PretrainedConfig.")
    return obj


def _is_hf_config_class(cls: type) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return issubclass(cls, PretrainedConfig)


def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _is_lightning(model: nn.Module) -> bool:
    try:
        from lightning.pytorch import LightningModule
    except ImportError:
        return False
    return isinstance(model, LightningModule)


# ------------------------------------------------------------------------------------------ batches and loss


def vocab_size_of(model: nn.Module) -> Optional[int]:
    """``model.vocab_size``, ``model.config.vocab_size`` (also one level down) or the first embedding's rows."""
    for owner in (model, getattr(model, "model", None)):
        if owner is None:
            continue
        for obj in (owner, getattr(owner, "config", None)):
            value = getattr(obj, "vocab_size", None) if obj is not None else None
            if isinstance(value, int) and value > 0:
                return value
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None


def make_batch(model: nn.Module, micro_batch: int, seq_len: int, vocab_size: Optional[int] = None) -> Any:
    """The module's ``example_batch(micro_batch, seq_len)`` or a synthetic ``{"input_ids", "labels"}`` batch."""
    hook = getattr(model, "example_batch", None)
    if callable(hook):
        return hook(micro_batch, seq_len)
    vocab = vocab_size or vocab_size_of(model)
    if vocab is None:
        raise ValueError(f"cannot make a token batch for {type(model).__name__}: it has no example_batch(micro_batch, "
                         "seq_len) hook, no config.vocab_size and no nn.Embedding; add the hook or pass --vocab-size.")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_from(output: Any, batch: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            return output
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if labels is not None and output.dim() >= 2 and output.shape[:-1] == labels.shape:
            return nn.functional.cross_entropy(output.reshape(-1, output.size(-1)).float(), labels.reshape(-1),
                                               ignore_index=-100)
        return output.float().mean()
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0 and o.requires_grad]
        if scalars:
            return scalars[-1]
        tensors = [o for o in output if isinstance(o, torch.Tensor)]
        if tensors:
            return _loss_from(tensors[0], batch)
    raise ValueError(f"cannot find a loss in the model's output ({type(output).__name__}); return a scalar tensor, "
                     "a dict with 'loss', or an object with .loss.")


def step_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The training loss of one micro-batch (see the module docstring for how it is found)."""
    if _is_lightning(model) and type(model).training_step is not _lightning_training_step():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")
            warnings.filterwarnings("ignore", message=".*self.trainer.*")
            out = model.training_step(batch, 0)
        if out is None:
            raise ValueError(f"{type(model).__name__}.training_step returned None (manual optimization?); return the "
                             "loss so it can be profiled.")
        return _loss_from(out, batch)
    if _is_hf_model(model) and isinstance(batch, Mapping):
        return _loss_from(model(**batch), batch)
    if isinstance(batch, Mapping):
        ids, labels = batch.get("input_ids"), batch.get("labels")
        if ids is None:
            return _loss_from(model(**batch), batch)
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        out = model(ids, labels) if labels is not None and len(params) >= 2 else model(ids)
        return _loss_from(out, batch)
    if isinstance(batch, (tuple, list)):
        return _loss_from(model(*batch), batch)
    return _loss_from(model(batch), batch)


def _lightning_training_step():
    from lightning.pytorch import LightningModule

    return LightningModule.training_step


# ----------------------------------------------------------------------------------------------- optimizers


def optimizers_from(configured: Any) -> List[torch.optim.Optimizer]:
    """The optimizers in any shape ``configure_optimizers`` may return (Lightning's documented shapes)."""
    if configured is None:
        return []
    if isinstance(configured, torch.optim.Optimizer) or (hasattr(configured, "param_groups")
                                                         and hasattr(configured, "state")):
        return [configured]
    if isinstance(configured, Mapping):
        return optimizers_from(configured.get("optimizer"))
    if isinstance(configured, (tuple, list)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)) and isinstance(configured[1],
                                                                                             (list, tuple)):
            return optimizers_from(list(configured[0]))  # ([optimizers], [schedulers])
        out: List[torch.optim.Optimizer] = []
        for item in configured:
            out.extend(optimizers_from(item))
        return out
    return []


def make_optimizers(model: nn.Module, name: Optional[str] = None, lr: float = 1e-3) -> List[torch.optim.Optimizer]:
    """``name`` (one of :data:`TORCH_OPTIMIZERS`), or the module's ``configure_optimizers``, or AdamW."""
    if name is None and callable(getattr(model, "configure_optimizers", None)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opts = optimizers_from(model.configure_optimizers())
        except Exception as err:  # e.g. it reads self.trainer, which does not exist here
            raise ValueError(f"{type(model).__name__}.configure_optimizers() failed outside a Trainer ({err!r}); pass "
                             f"--optimizer ({', '.join(TORCH_OPTIMIZERS)}) instead.") from None
        if opts:
            return opts
    name = (name or "adamw").lower()
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return [torch.optim.AdamW(params, lr=lr)]
    if name == "adam":
        return [torch.optim.Adam(params, lr=lr)]
    if name == "sgd":
        return [torch.optim.SGD(params, lr=lr)]
    if name == "momentum":
        return [torch.optim.SGD(params, lr=lr, momentum=0.9)]
    if name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return [torch.optim.Adafactor(params, lr=lr)]
    raise ValueError(f"--optimizer={name!r} cannot be built with --model; choose one of {list(TORCH_OPTIMIZERS)} "
                     "(or omit it to use the module's configure_optimizers()).")


# ------------------------------------------------------------------------------------ activation tracking


def _storage_key(t: torch.Tensor) -> Optional[int]:
    """Identity of a tensor's storage that also works for fake and meta tensors (their data pointer is 0)."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return st._cdata or None


class _Ref(weakref.ref):
    __slots__ = ("key", "nbytes")


class _LiveScope(TorchDispatchMode):
    """Live bytes of storages created by operators while active (the replay interior), with the peak."""

    def __init__(self, skip: Dict[int, Any]) -> None:
        super().__init__()
        self.skip = skip
        self.tracked: Dict[int, _Ref] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs, _ = tree_flatten(out)
        fresh = [t for t in outs if isinstance(t, torch.Tensor)]
        if not fresh:
            return out
        inputs, _ = tree_flatten((args, kwargs))
        used = {_storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        for t in fresh:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            key = st._cdata
            if key and key not in used and key not in self.tracked and key not in self.skip:
                ref = _Ref(st, self._freed)
                ref.key, ref.nbytes = key, st.nbytes()
                self.tracked[key] = ref
                self.live += ref.nbytes
                self.peak = max(self.peak, self.live)
        return out

    def _freed(self, ref: _Ref) -> None:
        if self.tracked.get(ref.key) is ref:
            del self.tracked[ref.key]
            self.live -= ref.nbytes


class ActivationTracker:
    """The activation meter's default figure, for fake tensors as well as real ones.

    Counts every tensor saved for backward (an outer ``saved_tensors_hooks``) once per storage while its base
    tensor lives, parameters and the model's buffers excluded; while a region checkpointed by
    :mod:`lightning_ckpt.wrap` is replayed in backward, adds the live bytes the replay creates. ``peak`` is the
    maximum of that sum over the step; ``max_replay`` the largest single replay interior. Keys are storage
    identities rather than data pointers, so fake tensors (data pointer 0) are counted.

    Use as a context manager around one forward and backward.
    """

    def __init__(self, model: Optional[nn.Module] = None) -> None:
        self.static = {k for b in (model.buffers() if model is not None else ()) for k in [_storage_key(b)] if k}
        self.tracked: Dict[int, _Ref] = {}
        self.live = 0
        self.peak = 0
        self.replays = 0
        self.max_replay = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._handle = None

    def __enter__(self) -> "ActivationTracker":
        from lightning_ckpt.wrap import register_replay_hook

        self._handle = register_replay_hook(self._on_replay)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        root = t._base if t._base is not None else t
        if isinstance(root, nn.Parameter) or isinstance(t, nn.Parameter):
            return t
        key = _storage_key(root)
        if key and key not in self.tracked and key not in self.static:
            ref = _Ref(root, self._freed)
            ref.key, ref.nbytes = key, root.numel() * root.element_size()
            self.tracked[key] = ref
            self.live += ref.nbytes
            self.peak = max(self.peak, self.live)
        return t

    def _freed(self, ref: _Ref) -> None:
        if self.tracked.get(ref.key) is ref:
            del self.tracked[ref.key]
            self.live -= ref.nbytes

    def _on_replay(self, owner, fn, args, kwargs):
        self.replays += 1
        start = self.live
        scope = _LiveScope(skip=self.tracked)
        try:
            with scope:
                return fn(*args, **kwargs)
        finally:
            self.max_replay = max(self.max_replay, scope.peak)
            self.peak = max(self.peak, start + scope.peak)


# ------------------------------------------------------------------------------------------------ model state


@dataclass
class _StateTally:
    seen: set = field(default_factory=set)
    total: int = 0

    @staticmethod
    def key(t: torch.Tensor) -> Tuple[Any, ...]:
        return (_storage_key(t) or id(t), t.storage_offset(), t.numel(), t.dtype)

    def add(self, t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        local = getattr(t, "_local_tensor", None)
        t = local if isinstance(local, torch.Tensor) else t
        key = self.key(t)
        if key in self.seen:
            return 0
        self.seen.add(key)
        n = t.numel() * t.element_size()
        self.total += n
        return n


_MASTER_KEYS = ("master", "fp32_param", "fp32param", "param_fp32", "full_precision", "hp_param", "high_precision")


def model_state(model: nn.Module, optimizers: Sequence[Any]) -> Tuple[int, int, int, int]:
    """``(params, grads, optimizer, master)`` bytes; the same walk as :func:`lightning_ckpt.ledger.model_state_bytes`
    (``optimizer`` here excludes ``master``), keyed by storage so that fake tensors are counted correctly."""
    params_t, grads_t = _StateTally(), _StateTally()
    model_params = list(model.parameters())
    for p in model_params:
        params_t.add(p)
        grads_t.add(p.grad)
    model_keys = set(params_t.seen)
    opt_t, master_t = _StateTally(seen=set(params_t.seen)), _StateTally()
    for opt in optimizers:
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                if isinstance(p, torch.Tensor) and _StateTally.key(p) not in model_keys:
                    if opt_t.add(p):
                        master_t.add(p)
                    grads_t.add(p.grad)
        for state in getattr(opt, "state", {}).values():
            for path, t in _state_tensors(state):
                if opt_t.add(t) and any(k in path.lower() for k in _MASTER_KEYS):
                    master_t.add(t)
    return params_t.total, grads_t.total, opt_t.total - master_t.total, master_t.total


def _state_tensors(obj: Any, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _state_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _state_tensors(v, f"{prefix}.{i}" if prefix else str(i))


# ------------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class ModelPlan(LedgerPlan):
    """The ledger predicted for a real model; every figure in bytes. Same keys as
    :class:`lightning_ckpt.planner.LedgerPlan` (``params`` … ``crosses``, ``inputs``), plus what the trace saw.

    Attributes (beyond the planner's):
        model: the target as given.
        num_params: parameters (elements).
        blocks: how many repeated blocks were found; ``block_class`` their class.
        replay_interior: per policy, the largest live interior of one replayed region (0 without replays).
        trace_s: per policy, seconds the fake forward and backward took.
    """

    model: str = ""
    num_params: int = 0
    blocks: int = 0
    block_class: str = ""
    replay_interior: Dict[str, int] = field(default_factory=dict)
    trace_s: Dict[str, float] = field(default_factory=dict)


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers in place, tied weights kept tied (``Module.to`` cannot swap fake
    parameters)."""
    memo: Dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)


def parse_dtype(name: Optional[str], arg: str = "--param-dtype") -> Optional[torch.dtype]:
    if name is None:
        return None
    key = name.lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"{arg}={name!r} is not a floating dtype torch can cast to; choose one of {sorted(_DTYPES)}.")
    return _DTYPES[key]


def plan_model(
    target: Any,
    init_args: Optional[Dict[str, Any]] = None,
    *,
    micro_batch: int = 1,
    seq_len: int = 2048,
    policies: Sequence[str] = DEFAULT_POLICIES,
    param_dtype: Optional[str] = None,
    optimizer: Optional[str] = None,
    master_dtype: Optional[str] = None,
    capacity: Optional[int] = None,
    vocab_size: Optional[int] = None,
    blocks: Any = None,
) -> ModelPlan:
    """Predict the ledger of ``target`` per policy without allocating it (see the module docstring).

    Args:
        target: an import path, a callable or a Hugging Face config (see :func:`build_model`).
        init_args: keyword arguments for the target.
        micro_batch, seq_len: the batch shape traced.
        policies: policy strings; any policy :func:`~lightning_ckpt.wrap.apply_policy` accepts.
        param_dtype: cast floating parameters to this dtype (``"bf16"``); ``None`` keeps what the model builds.
        optimizer: one of :data:`TORCH_OPTIMIZERS`; ``None`` uses the module's ``configure_optimizers`` or AdamW.
        master_dtype: add a master copy of every trainable parameter in this dtype (what mixed-precision
            frameworks keep; torch optimizers keep none); ``None``/``"none"`` adds nothing.
        capacity: device capacity in bytes, for ``fits`` and ``crosses``.
        vocab_size: token id range of the synthetic batch (default: read from the model).
        blocks: block selector for :func:`~lightning_ckpt.blocks.find_blocks`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_ckpt.planner import DTYPE_BYTES, _crossing_line
    from lightning_ckpt.policy import parse_policy
    from lightning_ckpt.wrap import apply_policy, remove_checkpointing

    for name, value in (("--micro-batch", micro_batch), ("--seq-len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    policies = tuple(policies)
    if not policies:
        raise ValueError("--policies is empty; pass e.g. 'none,every:2,all'.")
    for p in policies:
        parse_policy(p)
    dtype = parse_dtype(param_dtype)
    master_key = (master_dtype or "none").lower()
    if master_key not in DTYPE_BYTES:
        raise ValueError(f"--master-dtype={master_dtype!r} is not a known dtype; choose one of "
                         f"{sorted(set(DTYPE_BYTES))}.")
    if optimizer is not None and optimizer.lower() not in TORCH_OPTIMIZERS:
        raise ValueError(f"--optimizer={optimizer!r} cannot be built with --model; choose one of "
                         f"{list(TORCH_OPTIMIZERS)} (or omit it to use the module's configure_optimizers()).")
    label = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake:
            model = build_model(target, init_args)
            if dtype is not None:
                cast_floating(model, dtype)
            model.train()
            batch = make_batch(model, micro_batch, seq_len, vocab_size)
        plan = apply_policy(model, "none", blocks)
    num_blocks, block_class = plan.num_blocks, type(plan.blocks[0]).__name__
    boundary = {"bytes": 0}

    def first_input(module, args, kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if tensors and not boundary["bytes"]:
            boundary["bytes"] = tensors[0].numel() * tensors[0].element_size()

    hook = plan.blocks[0].register_forward_pre_hook(first_input, with_kwargs=True)
    activations: Dict[str, int] = {}
    interiors: Dict[str, int] = {}
    times: Dict[str, float] = {}
    state: Optional[Tuple[int, int, int, int]] = None
    try:
        for policy in policies:
            plan.retarget(policy)
            for p in model.parameters():
                p.grad = None
            gc.collect()
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with fake, ActivationTracker(model) as tracker:
                    try:
                        loss = step_loss(model, batch)
                        loss.backward()
                    except (ValueError, TypeError):
                        raise
                    except Exception as err:  # data-dependent code and other things fake tensors cannot run
                        first = str(err).splitlines()[0] if str(err) else ""
                        raise ValueError(f"--model={label!r} could not be traced on fake tensors under policy "
                                         f"{policy!r}: {type(err).__name__}: {first} — plan it from numbers "
                                         "(--params ...) instead.") from None
                    del loss
                    if state is None:
                        opts = make_optimizers(model, optimizer)
                        for opt in opts:
                            opt.step()
                        state = model_state(model, opts)
                        del opts
            times[policy] = time.perf_counter() - t0
            activations[policy] = tracker.peak
            interiors[policy] = tracker.max_replay
    finally:
        hook.remove()
        remove_checkpointing(model)
    assert state is not None
    params, grads, opt_bytes, master = state
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    master += n_trainable * DTYPE_BYTES[master_key]
    total = params + grads + opt_bytes + master
    peak = {p: total + a for p, a in activations.items()}
    fits = {p: None if capacity is None else v <= capacity for p, v in peak.items()}
    crosses = {p: _crossing_line(params, grads, opt_bytes, master, activations[p], capacity) for p in policies}
    single = [v for p, v in interiors.items() if v and parse_policy(p).name != "group"]
    block_interior = interiors.get("all") or (min(single) if single else max(interiors.values(), default=0))
    inputs = dict(model=label, init_args=dict(init_args or {}), micro_batch=micro_batch, seq_len=seq_len,
                  policies=list(policies), param_dtype=param_dtype, optimizer=optimizer, master_dtype=master_dtype,
                  capacity=capacity, vocab_size=vocab_size)
    return ModelPlan(
        params=params, grads=grads, optimizer=opt_bytes, master=master, model_state=total,
        hidden_tensor=boundary["bytes"], boundary_all=boundary["bytes"] * num_blocks, block_interior=block_interior,
        activations=activations, peak=peak, capacity=capacity, fits=fits, crosses=crosses, inputs=inputs,
        model=label, num_params=sum(p.numel() for p in model.parameters()), blocks=num_blocks,
        block_class=block_class, replay_interior=interiors, trace_s=times,
    )
