"""Issue 33 (5): what pricing a batch shape on fake tensors costs, the calibration's stages against the fast way.

For each model, in one process: :func:`~lightning_ckpt.decide.pricing.price_shape_by_stages` (the budget
calibration's five stages, each a whole-model step on fake tensors: how a bucket was priced before) beside
:func:`~lightning_ckpt.decide.pricing.price_shape` (one whole-model step, then one block alone per kind and mode),
then :func:`~lightning_ckpt.decide.pricing.trace_plans` of one plan (every block recomputed) at the model's maximum
length, the check a run makes before its first step. Models: Hugging Face Llama configs of 4 and 24 layers (hidden
256) and Llama-2-7B's config (32 layers, hidden 4096), built under a fake-tensor mode: nothing is allocated, nothing
downloaded. Fake kernels take no time: what is timed is Python dispatch, so the cost grows with the layers and the
operators, not with the width or the length.

Usage::

    python benchmarks/pricing.py                    # 4, 24 layers and 7B, 2 x 512 tokens
    python benchmarks/pricing.py --models 24 --slow-off   # the fast way only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_average  # noqa: E402

from lightning_ckpt.core.wrap import apply_policy  # noqa: E402
from lightning_ckpt.decide.pricing import price_shape, price_shape_by_stages, trace_plans  # noqa: E402


def build(layers: str):
    """A ``LlamaForCausalLM`` whose parameters are fake tensors (a fake-tensor mode's, so pricing swaps nothing real).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ckpt.demos.factories import llama_7b_config

    if layers == "7b":
        config = llama_7b_config()
    else:
        config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=int(layers),
                             num_attention_heads=4, num_key_value_heads=4, vocab_size=32000,
                             max_position_embeddings=4096, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = LlamaForCausalLM(config)
    model.train()
    return model, config


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(name: str, samples: int, length: int, slow_too: bool) -> dict:
    """Seconds of each way of pricing one shape of model ``name``, and of one trace at its maximum length."""
    model, config = build(name)
    plan = apply_policy(model, "none")

    def loss(b):
        return model(input_ids=b["input_ids"], labels=b["labels"]).loss

    ids = torch.randint(0, config.vocab_size, (samples, length))
    batch = {"input_ids": ids, "labels": ids}
    out = {"blocks": plan.num_blocks, "max": config.max_position_embeddings, "stages": None}
    if slow_too:
        out["stages"], _ = timed(lambda: price_shape_by_stages(model, plan, loss, batch))
    out["fast"], _ = timed(lambda: price_shape(model, plan, loss, batch))
    longest = torch.randint(0, config.vocab_size, (samples, config.max_position_embeddings))
    every = ("recompute",) * plan.num_blocks
    out["trace"], _ = timed(lambda: trace_plans(model, plan, loss, {"input_ids": longest, "labels": longest},
                                                [every]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="4,24,7b", help="comma-separated: a layer count (hidden 256) or 7b")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--length", type=int, default=512, help="tokens per sample of the priced shape")
    parser.add_argument("--slow-off", action="store_true", help="skip the calibration's stages (the old way)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load_average()}, "
          f"shape {args.samples} x {args.length}")
    print(f"{'model':>8} {'blocks':>6} {'stages (old)':>13} {'fast':>8} {'x':>6} {'trace, max length':>18}")
    for name in args.models.split(","):
        r = measure(name, args.samples, args.length, not args.slow_off)
        slow = r["stages"]
        ratio = f"{slow / r['fast']:5.1f}x" if slow else "     -"
        print(f"{name:>8} {r['blocks']:>6} {(f'{slow:.2f} s' if slow else '-'):>13} {r['fast']:>6.2f} s {ratio} "
              f"{r['trace']:>10.2f} s at {r['max']}", flush=True)


if __name__ == "__main__":
    main()
