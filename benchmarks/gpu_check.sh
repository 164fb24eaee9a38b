#!/usr/bin/env bash
# The prepared GPU check for a lent CUDA machine: the GPU-marked tests, then the CUDA overhead benchmark.
# Run from the repository root:  bash benchmarks/gpu_check.sh   (about 5 minutes after the install)
set -u
python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" || exit 1
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
.venv/bin/python -m pytest -m gpu -q -p no:cacheprovider -rs
.venv/bin/python benchmarks/overhead.py --accelerator gpu
