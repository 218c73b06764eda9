"""Allreduce throughput of baguahvd against raw mpi4py, measured in the same run.

Run under MPI with two ranks::

    mpirun -np 2 python benchmarks/allreduce.py            # full table, 4 KB .. 256 MB
    mpirun -np 2 python benchmarks/allreduce.py --quick    # up to 16 MB

For each message size it times ``hvd.allreduce(t, op=hvd.Sum)`` (out of place) and
``MPI.COMM_WORLD.Allreduce(send, recv)`` on the same float32 buffers, alternating the two,
and prints the ratio of raw time to baguahvd time (1.0 = as fast as raw MPI). The "fused"
rows time 256 named ``allreduce_async`` calls followed by ``synchronize`` against one raw
Allreduce of the same total bytes. torch.distributed's gloo ``all_reduce`` (PyTorch's own CPU
collective, what DDP uses) joins the table unless ``--no-gloo``; with Horovod importable, its
figures join too, taken once baguahvd has shut down. Each system is timed beside raw MPI
timed just before it, so each ratio comes from one stretch of the run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import baguahvd.torch as hvd

try:  # optional reference
    import horovod.torch as horovod  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    horovod = None


def _timed(fn: Callable[[], object], iters: int, comm: MPI.Comm) -> float:
    """Seconds per call, the slowest rank's view, median of 3 repetitions."""
    samples = []
    for _ in range(3):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = (time.perf_counter() - start) / iters
        samples.append(comm.allreduce(elapsed, op=MPI.MAX))
    return statistics.median(samples)


def _iterations(nbytes: int) -> int:
    return max(3, min(300, int(64 * 2**20 / max(nbytes, 1))))


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}"
        nbytes //= 1024
    return f"{nbytes} TB"


def _sizes(quick: bool) -> list[int]:
    largest = 16 * 2**20 if quick else 256 * 2**20
    sizes = []
    nbytes = 4 * 1024
    while nbytes <= largest:
        sizes.append(nbytes)
        nbytes *= 4
    return sizes


Column = tuple[str, list[tuple[float, float]], list[tuple[float, float]]]
"""A system's name, its (raw, own) seconds per single-tensor size and per fused row."""


def _single(api: Any, count: int, rank: int) -> Callable[[], object]:
    send = torch.full((count,), float(rank + 1))
    return lambda: api.allreduce(send, op=api.Sum, name="bench")


def _gloo_single(count: int, rank: int) -> Callable[[], object]:
    send = torch.full((count,), float(rank + 1))
    return lambda: dist.all_reduce(send)


def _gloo_fused(tensors: list[torch.Tensor]) -> Callable[[], object]:
    def many() -> None:
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()

    return many


def _fused(api: Any, tensors: list[torch.Tensor]) -> Callable[[], object]:
    names = [f"fused.{i}" for i in range(len(tensors))]

    def many() -> None:
        handles = [api.allreduce_async(t, op=api.Sum, name=name) for t, name in zip(tensors, names)]
        for handle in handles:
            api.synchronize(handle)

    return many


def _against_raw(
    make: Callable[[int], Callable[[], object]],
    counts: list[int],
    iters: list[int],
    comm: MPI.Comm,
) -> list[tuple[float, float]]:
    """(raw seconds, seconds) per element count: ``make(count)``'s call against one raw
    Allreduce of ``count`` float32 elements, timed one after the other."""
    rank = comm.Get_rank()
    times = []
    for count, n in zip(counts, iters):
        send = torch.full((count,), float(rank + 1)).numpy()
        recv = np.empty_like(send)
        fn = make(count)
        fn()
        comm.Allreduce(send, recv, op=MPI.SUM)
        t_raw = _timed(lambda: comm.Allreduce(send, recv, op=MPI.SUM), n, comm)
        times.append((t_raw, _timed(fn, n, comm)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stop at 16 MB")
    parser.add_argument("--fused-count", type=int, default=256)
    parser.add_argument(
        "--no-gloo",
        dest="gloo",
        action="store_false",
        help="leave out torch.distributed's gloo allreduce",
    )
    args = parser.parse_args()

    hvd.init()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sizes = _sizes(args.quick)
    n = args.fused_count
    per_tensor = [1024, 16 * 1024, 64 * 1024]
    fused_counts = [n * each // 4 for each in per_tensor]
    fused_iters = [max(3, min(50, int(16 * 2**20 / (n * each)))) for each in per_tensor]

    def fused_tensors(count: int) -> list[torch.Tensor]:
        return [torch.full((count // n,), float(rank + i)) for i in range(n)]

    single_counts = [s // 4 for s in sizes]
    single_iters = [_iterations(s) for s in sizes]

    def measure(
        name: str,
        single: Callable[[int], Callable[[], object]],
        fused: Callable[[list[torch.Tensor]], Callable[[], object]],
    ) -> Column:
        # Each system's figures come with raw MPI's, taken in the same stretch of the run.
        return (
            name,
            _against_raw(single, single_counts, single_iters, comm),
            _against_raw(lambda c: fused(fused_tensors(c)), fused_counts, fused_iters, comm),
        )

    columns = [measure("baguahvd", lambda c: _single(hvd, c, rank), lambda ts: _fused(hvd, ts))]
    if args.gloo:
        from gloo import start_gloo

        start_gloo(comm)
        columns.append(measure("gloo", lambda c: _gloo_single(c, rank), _gloo_fused))
    hvd.shutdown()
    if horovod is not None:
        # Horovod runs once baguahvd has stopped: one engine thread at a time.
        horovod.init()
        columns.append(
            measure("horovod", lambda c: _single(horovod, c, rank), lambda ts: _fused(horovod, ts))
        )
        horovod.shutdown()

    header = f"{'size':>8}" + "".join(
        f" | {'raw MPI':>10} | {name:>10} | {'ratio':>6}" for name, _, _ in columns
    )
    lines = [
        f"allreduce (float32, Sum) on {comm.Get_size()} ranks; time per call, "
        "each system beside raw MPI timed just before it",
        header,
    ]
    for index, nbytes in enumerate(sizes):
        lines.append(
            f"{_human(nbytes):>8}" + "".join(_cells(single[index]) for _, single, _ in columns)
        )
    lines += [
        "",
        f"{n} named allreduce_async + synchronize vs one raw Allreduce of the same bytes",
        header,
    ]
    for index, each in enumerate(per_tensor):
        label = f"{n}x{_human(each)}"
        lines.append(f"{label:>8}" + "".join(_cells(fused[index]) for _, _, fused in columns))
    if rank == 0:
        print("\n".join(lines), flush=True)


def _cells(times: tuple[float, float]) -> str:
    t_raw, t = times
    return f" | {t_raw * 1e6:8.0f}us | {t * 1e6:8.0f}us | {t_raw / t:6.2f}"


if __name__ == "__main__":
    main()
