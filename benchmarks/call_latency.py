"""The latency of one blocking ``hvd.allreduce``: every rank waits at a barrier, then times a
named allreduce (Average, out of place) of ``--bytes`` bytes; rank 0 prints its median.

    mpirun -np 2 python benchmarks/call_latency.py --bytes 4096

Barriers line the ranks up before each call, as a loss or metric averaged once per step
would be, so the figure is what one call costs a job whose ranks arrive together (the
engine's hand-offs, its negotiation and the reduction), not the throughput of calls in a
row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

import baguahvd.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=4096, help="float32 bytes per call")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    hvd.init()
    tensor = torch.ones(max(1, args.bytes // 4))
    world = MPI.COMM_WORLD
    times = []
    for _ in range(args.warmup + args.calls):
        world.Barrier()
        start = time.perf_counter()
        hvd.allreduce(tensor, name="call_latency")
        times.append(time.perf_counter() - start)
    median = statistics.median(times[args.warmup :])
    if hvd.rank() == 0:
        print(f"{args.bytes} bytes, {hvd.size()} ranks: median {median * 1e6:.1f} us "
              f"over {args.calls} calls")
    hvd.shutdown()


if __name__ == "__main__":
    main()
