import os

import pytest
import torch

# one intra-op thread: the test models are tiny, and 2-process DDP tests or a busy machine with more threads
# than cores make OpenMP spin (observed: steps up to 100x slower); subprocesses inherit the setting
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
