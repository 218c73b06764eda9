"""The CPU allreduce paths of ``hvd.allreduce`` against raw mpi4py, interleaved in one run.

Run under MPI with two ranks on one machine (shared memory)::

    mpirun -np 2 python benchmarks/allreduce_paths.py              # 16 KB, 1 MB, 16 MB, 64 MB
    mpirun -np 2 python benchmarks/allreduce_paths.py --repeats 11 --sizes 16M 64M 256M

Three raw baselines, all honest: ``Allreduce(IN_PLACE, buf)`` on one reused NumPy buffer,
``Allreduce(send, out)`` into a freshly allocated NumPy array (what an out-of-place result
costs when MPI fills new memory: its page faults included), and ``Allreduce(IN_PLACE, buf)``
on the memory of a torch tensor (``tensor.numpy()``). NumPy advises transparent huge pages
for its arrays of 4 MB and more and torch does not; Open MPI's single-copy transfers between
ranks run faster on huge pages, so from 4 MB on the two in-place baselines differ, and the
torch one is what raw MPI costs on the tensors baguahvd is given. Against them, on float32:
``hvd.allreduce`` out of place with ``Sum`` (named, as DistributedOptimizer names its
gradients, and unnamed, as scripts often call it) and with ``Average``, and
``hvd.allreduce_`` in place with ``Sum``. The grouped rows reduce 256 tensors of 16 KB
(``--count``, ``--each``) as ``hvd.grouped_allreduce``, as 256 named ``allreduce_async`` +
``synchronize`` and as 256 ``allreduce_async_`` (in place) + ``synchronize``, against one raw
call of the same bytes.

Every repetition runs every variant once, in the same order, each after a barrier; a
variant's time is the slowest rank's seconds per call, and the table shows the median over
repetitions. Ratios are raw time / baguahvd time: 1.0 is as fast as raw MPI, above 1 faster.
The load average is printed before and after: other processes on the machine distort the
figures, the ratios less than the times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

import baguahvd.torch as hvd

Variant = tuple[str, Callable[[], object]]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024:
            return f"{nbytes:g} {unit}"
        nbytes //= 1024
    return f"{nbytes} TB"


def _interleaved(variants: list[Variant], iters: int, repeats: int, comm: MPI.Comm) -> list[float]:
    """Median over ``repeats`` of the slowest rank's seconds per call, per variant."""
    for _, fn in variants:  # warm-up: response cache, fusion buffer, allocator
        fn()
        fn()
    samples: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for index, (_, fn) in enumerate(variants):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = (time.perf_counter() - start) / iters
            samples[index].append(comm.allreduce(elapsed, op=MPI.MAX))
    return [statistics.median(s) for s in samples]


def _iterations(nbytes: int) -> int:
    return max(3, min(200, (32 << 20) // nbytes))


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _table(title: str, names: list[str], times: list[float], raw: int) -> list[str]:
    lines = [title]
    base_in, base_fresh, base_torch = times[0], times[1], times[2]
    for index, (name, seconds) in enumerate(zip(names, times)):
        line = f"  {name:<38} {seconds * 1e3:9.3f} ms"
        if index >= raw:
            line += f"   vs in-place {base_in / seconds:5.2f}"
            line += f"   vs fresh {base_fresh / seconds:5.2f}"
            line += f"   vs torch in-place {base_torch / seconds:5.2f}"
        lines.append(line)
    return lines


def _check(tensor: torch.Tensor, expected: float, what: str) -> None:
    if not torch.all(tensor == expected):
        raise AssertionError(f"{what}: got {tensor.flatten()[:4].tolist()}, expected {expected}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["16K", "1M", "16M", "64M"],
                        help="message sizes in bytes (suffix K, M or G)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--count", type=int, default=256, help="tensors in the grouped rows")
    parser.add_argument("--each", default="16K", help="bytes per tensor in the grouped rows")
    args = parser.parse_args()

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = hvd.rank(), hvd.size()
    lines = [f"float32 allreduce on {size} ranks; {_load()}"]

    for nbytes in map(_size, args.sizes):
        count = nbytes // 4
        send = torch.full((count,), float(rank + 1))
        send_np = send.numpy()
        inplace = np.zeros(count, dtype=np.float32)
        torch_inplace = torch.zeros(count).numpy()
        ours_inplace = torch.zeros(count)
        total = size * (size + 1) / 2
        _check(hvd.allreduce(send, op=hvd.Sum, name="check.sum"), total, "Sum")
        _check(hvd.allreduce(send, op=hvd.Average, name="check.avg"), total / size, "Average")
        _check(send, float(rank + 1), "input after allreduce")

        def raw_fresh() -> None:
            comm.Allreduce(send_np, np.empty(count, dtype=np.float32), op=MPI.SUM)

        variants: list[Variant] = [
            ("raw Allreduce in place", lambda: comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.SUM)),
            ("raw Allreduce into a fresh array", raw_fresh),
            ("raw Allreduce in place, torch memory",
             lambda: comm.Allreduce(MPI.IN_PLACE, torch_inplace, op=MPI.SUM)),
            ("hvd.allreduce Sum", lambda: hvd.allreduce(send, op=hvd.Sum, name="sum")),
            ("hvd.allreduce Sum, unnamed", lambda: hvd.allreduce(send, op=hvd.Sum)),
            ("hvd.allreduce Average", lambda: hvd.allreduce(send, name="avg")),
            ("hvd.allreduce_ Sum (in place)",
             lambda: hvd.allreduce_(ours_inplace, op=hvd.Sum, name="inplace")),
        ]
        times = _interleaved(variants, _iterations(nbytes), args.repeats, comm)
        lines += _table(_human(nbytes), [n for n, _ in variants], times, raw=3)

    n, each = args.count, _size(args.each) // 4
    tensors = [torch.full((each,), float(rank + i)) for i in range(n)]
    zeros = [torch.zeros(each) for _ in range(n)]
    flat = torch.cat(tensors).numpy()
    flat_inplace = np.zeros(n * each, dtype=np.float32)
    flat_torch = torch.zeros(n * each).numpy()
    names = [f"fused.{i}" for i in range(n)]
    names_ = [f"fused_.{i}" for i in range(n)]
    for i, result in enumerate(hvd.grouped_allreduce(tensors, op=hvd.Sum, name="check.group")):
        _check(result, float(size * i + total - size), f"grouped tensor {i}")

    def async_many() -> None:
        handles = [hvd.allreduce_async(t, op=hvd.Sum, name=m) for t, m in zip(tensors, names)]
        for handle in handles:
            hvd.synchronize(handle)

    def async_many_() -> None:
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=m) for t, m in zip(zeros, names_)]
        for handle in handles:
            hvd.synchronize(handle)

    variants = [
        ("raw Allreduce in place", lambda: comm.Allreduce(MPI.IN_PLACE, flat_inplace, op=MPI.SUM)),
        ("raw Allreduce into a fresh array",
         lambda: comm.Allreduce(flat, np.empty_like(flat), op=MPI.SUM)),
        ("raw Allreduce in place, torch memory",
         lambda: comm.Allreduce(MPI.IN_PLACE, flat_torch, op=MPI.SUM)),
        ("hvd.grouped_allreduce Sum",
         lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum, name="group")),
        (f"{n} allreduce_async + synchronize", async_many),
        (f"{n} allreduce_async_ + synchronize", async_many_),
    ]
    times = _interleaved(variants, max(3, (64 << 20) // (n * each * 4)), args.repeats, comm)
    title = f"{n} x {_human(each * 4)} against one raw call of {_human(n * each * 4)}"
    lines += _table(title, [v[0] for v in variants], times, raw=3)
    lines.append(_load())
    if rank == 0:
        print("\n".join(lines), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
