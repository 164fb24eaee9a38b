"""Load what the forecast and the profiler run: a model from an import path or a config, a batch, a loss, optimizers.

What ``--model`` accepts (``pkg.module:attr``, ``attr`` may be dotted, e.g. ``pkg.mod:Config.preset``; the
LightningCLI spelling ``pkg.module.Class`` works too):

- a callable returning an ``nn.Module`` (a class, a function); a ``LightningModule`` is stepped with its own
  ``training_step`` and ``configure_optimizers``;
- a callable returning, or an instance of, a Hugging Face ``PretrainedConfig`` (built with
  ``AutoModelForCausalLM.from_config``), or a path to a ``config.json`` / a directory holding one.

Keyword arguments come from ``init_args`` (JSON on the command line) or a LightningCLI-style YAML ``--config``
(``model: {class_path: ..., init_args: {...}}`` or ``model: {...}``). Demo factories live in
:mod:`lightning_ckpt.demos.factories`.

The batch is the module's ``example_batch(micro_batch, seq_len)`` when it has one (see
:mod:`lightning_ckpt.forecast.profile` for the hook's contract), else ``{"input_ids", "labels"}`` of random token
ids below the vocabulary size (from ``vocab_size=``, ``model.config.vocab_size`` or the first ``nn.Embedding``).
The loss of a step is :func:`step_loss`: ``training_step(batch, 0)`` for a ``LightningModule``,
``model(**batch).loss`` for a Hugging Face model, else the model called on ``(input_ids, labels)`` or
``(input_ids)`` (per its signature) with the loss taken from the output (a scalar, a ``.loss``, the scalar in a
tuple, or cross-entropy of logits).

Lightning itself is never imported here: a module is a ``LightningModule`` only if Lightning is already loaded.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ckpt.decide.anatomy import vocab_size as model_vocab_size

__all__ = [
    "TORCH_OPTIMIZERS",
    "build_model",
    "import_object",
    "lightning_step",
    "load_init_args",
    "make_batch",
    "make_optimizers",
    "optimizers_from",
    "step_loss",
]

TORCH_OPTIMIZERS = ("adamw", "adam", "sgd", "momentum", "adafactor")


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

    Call it under ``FakeTensorMode`` (as :func:`~lightning_ckpt.forecast.trace.forecast_model` does) to build without
    allocating.
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


def _lightning_module_class() -> Optional[type]:
    """``LightningModule`` if Lightning is loaded (an instance of it cannot exist otherwise), else ``None``."""
    pl = sys.modules.get("lightning.pytorch")
    return getattr(pl, "LightningModule", None) if pl is not None else None


def _is_lightning(model: nn.Module) -> bool:
    cls = _lightning_module_class()
    return cls is not None and isinstance(model, cls)


# ------------------------------------------------------------------------------------------ batches and loss


def make_batch(model: nn.Module, micro_batch: int, seq_len: int, vocab_size: Optional[int] = None) -> Any:
    """The module's ``example_batch(micro_batch, seq_len)`` or a synthetic ``{"input_ids", "labels"}`` batch."""
    hook = getattr(model, "example_batch", None)
    if callable(hook):
        return hook(micro_batch, seq_len)
    vocab = vocab_size or model_vocab_size(model)
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
    if _is_lightning(model) and type(model).training_step is not _lightning_module_class().training_step:
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


def lightning_step(model: nn.Module, batch: Any, optimizers: Sequence[Any], precision: Any = None,
                   device_type: str = "cpu", meter: Any = None) -> None:
    """One training step in Lightning's order: forward (under ``precision``'s context), ``zero_grad`` (Lightning
    calls it between ``training_step`` and ``backward``), backward, ``optimizer.step()``; a
    :class:`~lightning_ckpt.measure.meter.StepMeter` given as ``meter`` is told the phase boundaries."""
    with precision.forward_context(device_type) if precision is not None else contextlib.nullcontext():
        loss = step_loss(model, batch)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if meter is not None:
        meter.phase("backward")
    loss.backward()
    del loss
    if meter is not None:
        meter.phase("optimizer")
    for opt in optimizers:
        opt.step()


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


def make_optimizers(model: nn.Module, name: Optional[str] = None, lr: float = 1e-3,
                    foreach: Optional[bool] = None) -> List[torch.optim.Optimizer]:
    """``name`` (one of :data:`TORCH_OPTIMIZERS`), or the module's ``configure_optimizers``, or AdamW.

    ``foreach`` (``None``: the optimizer's own default, which is ``True`` on CUDA and ``False`` on the CPU) is set on
    every parameter group: the multi-tensor implementation holds parameter-sized temporaries during ``step()``.
    """
    opts = _build_optimizers(model, name, lr)
    if foreach is not None:
        for opt in opts:
            for group in opt.param_groups:
                if "foreach" in group:
                    group["foreach"] = foreach
    return opts


def _build_optimizers(model: nn.Module, name: Optional[str], lr: float) -> List[torch.optim.Optimizer]:
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


