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


# what Lightning leaves in os.environ after a distributed run in this process: a later run (or a subprocess that
# inherits them) would bind a port an earlier group may still hold, or believe its ranks were already launched
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _fresh_distributed_env(monkeypatch):
    """Every test starts without the variables of an earlier test's distributed run (see ``DISTRIBUTED_ENV``)."""
    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _fresh_compiler_caches():
    """dynamo keeps compiled code per code object across tests, up to its recompile limit (then it runs that code
    eagerly for good): a test that compiles ``GPT.forward`` must not find the limit spent by earlier tests."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
