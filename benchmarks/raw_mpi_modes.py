"""Raw mpi4py ``Allreduce`` alone, timed over a while: does MPI itself keep one speed?

Run under MPI with two ranks on one machine::

    mpirun -np 2 python benchmarks/raw_mpi_modes.py                 # 4 MB, 200 repetitions
    mpirun -np 2 python benchmarks/raw_mpi_modes.py --size 16M --repeats 100

Nothing but mpi4py and NumPy runs in the processes (no baguahvd, no other thread). Each
repetition times ``--iters`` in-place ``Allreduce`` calls of ``--size`` bytes of float32 on
one reused buffer after a barrier (the slowest rank's time per call), and the buffer is
replaced by a fresh one every ``--fresh-every`` repetitions. Printed: the times in order
(one line per 20 repetitions) and their quartiles. On a machine that keeps one speed the
quartiles lie close together; on the 2-core VM these benchmarks run on they did not (see
``benchmarks/README.md``, ``allreduce_paths.py``), which is why ``allreduce_paths.py`` pairs
its ratios within each repetition.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4M", help="bytes per call (suffix K, M or G)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--iters", type=int, default=16, help="calls per repetition")
    parser.add_argument("--fresh-every", type=int, default=20,
                        help="repetitions between two fresh buffers")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    count = _size(args.size) // 4
    times = []
    buffer = np.zeros(count, dtype=np.float32)
    for repetition in range(args.repeats):
        if repetition % args.fresh_every == 0:
            buffer = np.zeros(count, dtype=np.float32)
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)  # first touch, out of the timing
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        elapsed = (time.perf_counter() - start) / args.iters
        times.append(comm.allreduce(elapsed, op=MPI.MAX) * 1e3)
    if comm.Get_rank() == 0:
        print(f"in-place Allreduce of {args.size} on {comm.Get_size()} ranks, ms per call")
        for first in range(0, len(times), 20):
            print("  " + " ".join(f"{t:.2f}" for t in times[first:first + 20]))
        q1, q2, q3 = statistics.quantiles(times, n=4)
        print(f"min {min(times):.3f}  quartiles {q1:.3f} {q2:.3f} {q3:.3f}  max {max(times):.3f}")


if __name__ == "__main__":
    main()
