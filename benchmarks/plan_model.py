"""Issue 37 (5): ``lightning-ckpt plan --model`` with ``--remedies`` on a 7B Llama config, timed and weighed.

Runs the command a user types, in a child process, and reads its wall time and its peak resident memory
(``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``, as ``/usr/bin/time -v`` reports it). Targets: under 60 s and
6 GiB on the project's 2-core CPU machine. The model is built under fake tensors: nothing is allocated or
downloaded, so the memory is the tracer's, not the model's 7B weights.

Usage::

    python benchmarks/plan_model.py
    python benchmarks/plan_model.py --factory lightning_ckpt.demos.factories:gpt2_config --seq-len 128
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_average  # noqa: E402

SECONDS_TARGET, MEMORY_TARGET = 60.0, 6 * 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factory", default="lightning_ckpt.demos.factories:llama_7b_config")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    command = [sys.executable, "-m", "lightning_ckpt.cli.main", "plan", "--model", args.factory,
               "--param-dtype", "bf16", "--master-dtype", "fp32", "--seq-len", str(args.seq_len),
               "--capacity", "80GiB", "--remedies"]
    print("$ " + " ".join(command[2:]) + f"   (load average {load_average()})")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    if done.returncode != 0:
        sys.exit(f"the command failed ({done.returncode}):\n{done.stderr[-2000:]}")
    tail = [line for line in done.stdout.splitlines() if line.startswith(("try first", "cheapest"))]
    print("\n".join(tail))
    for name, value, target, shown in (("wall time", seconds, SECONDS_TARGET, f"{seconds:.1f} s"),
                                       ("peak memory", rss, MEMORY_TARGET, f"{rss / 2**30:.2f} GiB")):
        limit = f"{target:.0f} s" if name == "wall time" else f"{target / 2**30:.0f} GiB"
        print(f"{name:<12} {shown:>10}  target < {limit}  {'PASS' if value < target else 'MISS'}")


if __name__ == "__main__":
    main()
