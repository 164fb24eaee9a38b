"""Train a tiny Hugging Face GPT-2 (built from a config, never downloaded) with activation checkpointing.

The block finder recognises ``GPT2Block`` through the model's ``_no_split_modules`` hint. Same flags as
``examples/train_gpt.py`` (this script reuses its training loop)::

    python examples/hf_model.py --policy every:2
    python examples/hf_model.py --policy selective --max-steps 30
    tensorboard --logdir runs

Needs ``transformers`` (``pip install 'lightning_ckpt[examples]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_gpt.py beside this file

from train_gpt import main  # noqa: E402

from lightning_ckpt.demos import HFCausalLMModule  # noqa: E402


def build_gpt2(args: argparse.Namespace) -> HFCausalLMModule:
    return HFCausalLMModule(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, n_positions=args.seq_len)


if __name__ == "__main__":
    main(build_model=build_gpt2, run_name="hf_gpt2")
