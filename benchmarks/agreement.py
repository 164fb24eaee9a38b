"""What agreeing on a step's batch shape costs under several processes (issue 25): the per-shape budget's one
all-reduce of the shape's integers on a CPU (gloo) process group of its own, per micro-batch, no device sync.

Run from the repository root::

    python benchmarks/agreement.py                 # 2 processes, 2000 all-reduces of a (samples, length) shape
    python benchmarks/agreement.py --lengths 2     # an encoder-decoder shape: 3 integers

Prints the median time per all-reduce over ``--rounds`` rounds (each ``--calls`` calls), as
``lightning_ckpt.lightning.shaped.ShapeReader._agree`` runs it, and the load average.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import header_lines, load_average  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    shape = torch.tensor([4, *([512] * args.lengths)], dtype=torch.int64)
    for _ in range(100):  # warm the connections
        dist.all_reduce(shape.clone(), op=dist.ReduceOp.MAX, group=group)
    rounds = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            dist.all_reduce(shape.clone(), op=dist.ReduceOp.MAX, group=group)
        rounds.append((time.perf_counter() - t0) / args.calls)
    if rank == 0:
        out.put(rounds)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--lengths", type=int, default=1, help="lengths in the shape (1; 2 for an encoder-decoder)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    for line in header_lines([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]):
        print(line)
    print(f"load average at start: {load_average()}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, args=(args.processes, _free_port(), args, out), nprocs=args.processes,
                       start_method="spawn")
    rounds = out.get()
    print(f"{args.processes} processes, gloo on loopback, a shape of {1 + args.lengths} int64: per all-reduce "
          f"median {statistics.median(rounds) * 1e6:.0f} us (rounds {min(rounds) * 1e6:.0f}..{max(rounds) * 1e6:.0f})")
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
