"""Open MPI's in-place allreduce of one buffer on 4 KB pages against the same on huge pages,
interleaved in one run: what the host fusion buffer's pages cost a fused unit's reduction.

    mpirun -np 2 python benchmarks/huge_pages.py
    mpirun -np 2 python benchmarks/huge_pages.py --kib 64 256 1200 4096 --repeats 5

For each size (``--kib``, float32), two buffers: an ordinary ``torch.empty`` and
:func:`baguahvd.backends.memory.empty_huge` with no lower bound (whole 2 MB pages, advised
before they are touched, as the engine allocates its host fusion buffer). Each repetition
times ``--calls`` in-place ``Allreduce`` (Sum) of each buffer, the order of the two
alternating, every call after a barrier and after the buffer is written anew (as the copy
into the fusion buffer does); rank 0 prints the median call of each, per repetition, and
the ratio of the medians over repetitions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from mpi4py import MPI

from baguahvd.backends import memory


def _median_call(comm: MPI.Comm, buffer: torch.Tensor, source: torch.Tensor, calls: int) -> float:
    seconds = []
    for _ in range(calls):
        buffer.copy_(source)
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, [buffer.numpy(), MPI.FLOAT], op=MPI.SUM)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 256, 1200, 4096],
                        help="buffer sizes in KiB")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per buffer")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"in-place Allreduce on {comm.size} ranks, median call in ms; "
              f"load average {os.getloadavg()[0]:.2f}")
    for kib in args.kib:
        count = kib * 1024 // 4
        buffers = {
            "4 KB pages": torch.empty(count),
            "huge pages": memory.empty_huge(count, torch.float32, min_bytes=0),
        }
        source = torch.ones(count)
        medians: dict[str, list[float]] = {kind: [] for kind in buffers}
        for repeat in range(args.repeats):
            kinds = list(buffers) if repeat % 2 == 0 else list(reversed(buffers))
            for kind in kinds:
                medians[kind].append(_median_call(comm, buffers[kind], source, args.calls))
        if comm.rank == 0:
            small, huge = (statistics.median(medians[kind]) for kind in buffers)
            runs = "  ".join(
                f"{kind} " + " ".join(f"{1e3 * s:.3f}" for s in medians[kind]) for kind in buffers
            )
            print(f"{kib:>6} KiB  {runs}   huge / 4 KB: {huge / small:.2f}")
    if comm.rank == 0:
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
