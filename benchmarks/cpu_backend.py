"""``hvd.allreduce`` over MPI against over gloo: the measurement behind BAGUAHVD_CPU_BACKEND.

The same script runs under each launcher, so the engine, the tensors and the host are the
same and only the transport differs::

    mpirun -np 2 python benchmarks/cpu_backend.py                      # MPI
    torchrun --nproc_per_node 2 benchmarks/cpu_backend.py              # gloo
    baguahvdrun -np 2 --gloo python benchmarks/cpu_backend.py          # gloo

Rank 0 prints the transport and, per size, the slowest rank's median seconds per
``hvd.allreduce`` (Sum, out of place), then 256 named 16 KB ``allreduce_async`` calls
followed by ``synchronize`` (fused by the engine).
"""

from __future__ import annotations

import statistics
import time

import torch

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime

SIZES = (16 << 10, 1 << 20, 16 << 20, 64 << 20)


def _slowest(samples: list[float]) -> float:
    return float(max(hvd.allgather_object(statistics.median(samples))))


def main() -> None:
    hvd.init()
    rows = []
    for nbytes in SIZES:
        tensor = torch.ones(nbytes // 4)
        iters = max(5, min(100, (16 << 20) // nbytes))
        for _ in range(3):
            hvd.allreduce(tensor, op=hvd.Sum, name="warmup")
        samples = []
        for _ in range(3):
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                hvd.allreduce(tensor, op=hvd.Sum, name="timed")
            samples.append((time.perf_counter() - start) / iters)
        rows.append((f"{nbytes >> 10} KB", _slowest(samples)))
    samples = []
    for _ in range(3):
        hvd.barrier()
        start = time.perf_counter()
        handles = [
            hvd.allreduce_async(torch.ones(4096), op=hvd.Sum, name=f"fused.{i}")
            for i in range(256)
        ]
        for handle in handles:
            hvd.synchronize(handle)
        samples.append(time.perf_counter() - start)
    rows.append(("256 x 16 KB fused", _slowest(samples)))
    if hvd.rank() == 0:
        transport = type(runtime.require_engine().control).__name__
        print(f"{hvd.size()} ranks, {transport}")
        for label, seconds in rows:
            print(f"  {label:>18}: {seconds * 1e3:.3f} ms")
    hvd.shutdown()


if __name__ == "__main__":
    main()
