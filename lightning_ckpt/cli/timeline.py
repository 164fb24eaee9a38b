"""``lightning-ckpt timeline``: a picture of one training step per plan, memory over the step's operations."""

from __future__ import annotations

import json
import os

import torch

from lightning_ckpt.core.policy import parse_policy_list
from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.core.wrap import apply_policy
from lightning_ckpt.forecast.load import build_model, lightning_step, load_init_args, make_batch, make_optimizers
from lightning_ckpt.forecast.precision import PRECISIONS, parse_precision
from lightning_ckpt.measure.ledger import state_tensors
from lightning_ckpt.measure.meter import StepMeter
from lightning_ckpt.measure.timeline import Timeline, draw_timelines, matplotlib_available

__all__ = ["add_parser", "run", "step_timeline"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "timeline", help="memory over one training step's operations, per plan, side by side",
        description="Run the model's training step (forward, backward, optimizer) once per policy, after one step "
                    "that creates the optimizer state, and draw its memory over the step's operations stacked by "
                    "ledger line (parameters, optimizer state, gradients, activations, autocast copies, "
                    "temporaries), the phase boundaries marked and the peak's three largest tensors named. Writes "
                    "memory_timeline.png (with matplotlib) and memory_timeline.json.")
    p.add_argument("model", metavar="PKG.MODULE:FACTORY", help="the model, as for profile and plan --model")
    p.add_argument("--init-args", default=None, metavar="JSON", help="keyword arguments as a JSON object")
    p.add_argument("--config", default=None, help="a LightningCLI-style YAML with the model's init args")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--policies", default="none,all", help="plans drawn side by side (default none,all)")
    p.add_argument("--precision", default="32-true", choices=list(PRECISIONS))
    p.add_argument("--device", default=None, help="cuda, cpu (default: cuda when available)")
    p.add_argument("--out", default="timeline_out", help="output directory (default timeline_out)")


def step_timeline(model, batch, optimizers, policy: str, precision: str, device: torch.device) -> Timeline:
    """One step of ``model`` under ``policy``, measured exactly with its timeline (after a step that creates the
    optimizer state)."""
    plan = apply_policy(model, policy)
    mode = parse_precision(precision)
    lightning_step(model, batch, optimizers, mode, device.type)  # the optimizer's state exists from here on
    meter = StepMeter(device, model=model)
    # a generator, not a list: a list would keep last step's gradients alive through the step's zero_grad
    with meter.step(exact=True, attribute=plan.names, state=state_tensors(model, optimizers)) as box:
        lightning_step(model, batch, optimizers, mode, device.type, meter=meter)
    timeline = box.reading.timeline
    timeline.label = f"{policy}: {plan.num_checkpointed}/{plan.num_blocks} blocks checkpointed"
    return timeline


def run(args) -> int:
    for name, value in (("--micro-batch", args.micro_batch), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1.")
    policies = parse_policy_list(args.policies)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _, kwargs, _ = load_init_args(args.init_args, args.config)
    torch.manual_seed(0)
    model = build_model(args.model, kwargs).to(device)
    model.train()
    batch = make_batch(model, args.micro_batch, args.seq_len)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    timelines = []
    for policy in policies:
        model.load_state_dict(initial)
        optimizers = make_optimizers(model)
        timeline = step_timeline(model, batch, optimizers, policy, args.precision, device)
        timelines.append(timeline)
        print(f"{timeline.label}: peak {format_bytes(timeline.peak_bytes)} at operation {timeline.peak_x}; "
              f"largest there: {'; '.join(timeline.peak_tensors)}")
        del optimizers
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_timeline.json"), "w") as fh:
        json.dump([t.as_dict() for t in timelines], fh)
    written = [os.path.join(args.out, "memory_timeline.json")]
    if matplotlib_available():
        path = os.path.join(args.out, "memory_timeline.png")
        draw_timelines(timelines, path, f"{args.model}, micro-batch {args.micro_batch} x {args.seq_len}, "
                                        f"{args.precision}, {device.type}")
        written.append(path)
    else:
        print("no picture: matplotlib is not installed (pip install 'lightning_ckpt[examples]')")
    print("wrote " + ", ".join(written))
    return 0
