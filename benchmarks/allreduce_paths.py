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

With Horovod importable (and no ``--no-horovod``), the same rows run again through
``horovod.torch`` once baguahvd has shut down (one engine thread at a time), each table with
raw baselines of its own, and a last line per row gives Horovod's time / baguahvd's time.

Every repetition runs every variant once, in the same order, each after a barrier; a
variant's time is the slowest rank's seconds per call, and the table shows the median over
repetitions. Ratios are raw time / baguahvd time: 1.0 is as fast as raw MPI, above 1 faster.
Each ratio is the median over repetitions of the ratio within one repetition, the raw call
and the row timed a fraction of a second apart: on a shared virtual machine raw MPI itself
can run at two speeds for seconds at a time (a 4 MB allreduce between two ranks at
0.3--0.5 ms, or at 1.8--2.2 ms, with no other work in the processes), and a ratio of two
medians would mix the two. The raw rows show their spread over repetitions (min--max).
The load average is printed before and after: other processes on the machine distort the
figures, the ratios less than the times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import baguahvd.torch as hvd

try:  # optional reference: Horovod itself, when installed
    import horovod.torch as horovod  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    horovod = None

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


def _interleaved(
    variants: list[Variant], iters: int, repeats: int, comm: MPI.Comm
) -> list[list[float]]:
    """Per variant, the slowest rank's seconds per call in each of ``repeats``."""
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
    return samples


def _iterations(nbytes: int) -> int:
    return max(3, min(200, (32 << 20) // nbytes))


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _table(title: str, names: list[str], samples: list[list[float]], raw: int) -> list[str]:
    """The rows of one table: the first ``raw`` rows are the raw baselines."""
    lines = [title]
    for index, (name, times) in enumerate(zip(names, samples)):
        line = f"  {name:<44} {statistics.median(times) * 1e3:9.3f} ms"
        if index < raw:
            line += f"   ({min(times) * 1e3:.3f}-{max(times) * 1e3:.3f})"
        else:
            for label, base in zip(("in-place", "fresh", "torch in-place"), samples[:raw]):
                line += f"   vs {label} {_paired(base, times):5.2f}"
        lines.append(line)
    return lines


def _paired(base: list[float], times: list[float]) -> float:
    """The median over repetitions of ``base``'s time / the row's time in each."""
    return statistics.median(b / t for b, t in zip(base, times))


def _check(tensor: torch.Tensor, expected: float, what: str) -> None:
    if not torch.all(tensor == expected):
        raise AssertionError(f"{what}: got {tensor.flatten()[:4].tolist()}, expected {expected}")


def _sized_variants(api: Any, label: str, nbytes: int, rank: int, size: int) -> list[Variant]:
    """``api``'s single-tensor rows at ``nbytes`` (``api`` is baguahvd.torch or
    horovod.torch: the same calls)."""
    count = nbytes // 4
    send = torch.full((count,), float(rank + 1))
    inplace = torch.zeros(count)
    total = size * (size + 1) / 2
    _check(api.allreduce(send, op=api.Sum, name="check.sum"), total, f"{label} Sum")
    _check(api.allreduce(send, op=api.Average, name="check.avg"), total / size,
           f"{label} Average")
    _check(send, float(rank + 1), f"{label} input after allreduce")
    return [
        (f"{label}.allreduce Sum", lambda: api.allreduce(send, op=api.Sum, name="sum")),
        (f"{label}.allreduce Sum, unnamed", lambda: api.allreduce(send, op=api.Sum)),
        (f"{label}.allreduce Average", lambda: api.allreduce(send, name="avg")),
        (f"{label}.allreduce_ Sum (in place)",
         lambda: api.allreduce_(inplace, op=api.Sum, name="inplace")),
    ]


def _grouped_variants(
    api: Any, label: str, n: int, each: int, rank: int, size: int
) -> list[Variant]:
    """``api``'s rows for ``n`` tensors of ``each`` float32 elements."""
    tensors = [torch.full((each,), float(rank + i)) for i in range(n)]
    zeros = [torch.zeros(each) for _ in range(n)]
    names = [f"fused.{i}" for i in range(n)]
    names_ = [f"fused_.{i}" for i in range(n)]
    total = size * (size + 1) / 2
    for i, result in enumerate(api.grouped_allreduce(tensors, op=api.Sum, name="check.group")):
        _check(result, float(size * i + total - size), f"{label} grouped tensor {i}")

    def async_many() -> None:
        handles = [api.allreduce_async(t, op=api.Sum, name=m) for t, m in zip(tensors, names)]
        for handle in handles:
            api.synchronize(handle)

    def async_many_() -> None:
        handles = [api.allreduce_async_(t, op=api.Sum, name=m) for t, m in zip(zeros, names_)]
        for handle in handles:
            api.synchronize(handle)

    return [
        (f"{label}.grouped_allreduce Sum",
         lambda: api.grouped_allreduce(tensors, op=api.Sum, name="group")),
        (f"{label}: {n} allreduce_async + synchronize", async_many),
        (f"{label}: {n} allreduce_async_ + synchronize", async_many_),
    ]


def _raw_variants(count: int, rank: int, comm: MPI.Comm) -> list[Variant]:
    """The three raw baselines for ``count`` float32 elements (see module docstring)."""
    send = torch.full((count,), float(rank + 1)).numpy()
    inplace = np.zeros(count, dtype=np.float32)
    torch_inplace = torch.zeros(count).numpy()

    def raw_fresh() -> None:
        comm.Allreduce(send, np.empty(count, dtype=np.float32), op=MPI.SUM)

    return [
        ("raw Allreduce in place", lambda: comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.SUM)),
        ("raw Allreduce into a fresh array", raw_fresh),
        ("raw Allreduce in place, torch memory",
         lambda: comm.Allreduce(MPI.IN_PLACE, torch_inplace, op=MPI.SUM)),
    ]


def _measure(
    api: Any, label: str, args: argparse.Namespace, comm: MPI.Comm
) -> list[tuple[str, list[str], list[list[float]]]]:
    """Every table's (title, row names, times per repetition) for ``api``, its raw
    baselines included."""
    rank, size = comm.Get_rank(), comm.Get_size()
    tables = []
    for nbytes in map(_size, args.sizes):
        variants = _raw_variants(nbytes // 4, rank, comm)
        variants += _sized_variants(api, label, nbytes, rank, size)
        times = _interleaved(variants, _iterations(nbytes), args.repeats, comm)
        tables.append((_human(nbytes), [n for n, _ in variants], times))
    n, each = args.count, _size(args.each) // 4
    variants = _raw_variants(n * each, rank, comm) + _grouped_variants(
        api, label, n, each, rank, size
    )
    times = _interleaved(variants, max(3, (64 << 20) // (n * each * 4)), args.repeats, comm)
    title = f"{n} x {_human(each * 4)} against one raw call of {_human(n * each * 4)}"
    tables.append((title, [v[0] for v in variants], times))
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["16K", "1M", "16M", "64M"],
                        help="message sizes in bytes (suffix K, M or G)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--count", type=int, default=256, help="tensors in the grouped rows")
    parser.add_argument("--each", default="16K", help="bytes per tensor in the grouped rows")
    parser.add_argument("--no-horovod", dest="horovod", action="store_false",
                        help="leave out Horovod even when it is importable")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    lines = [f"float32 allreduce on {comm.Get_size()} ranks; {_load()}"]
    hvd.init()
    ours = _measure(hvd, "hvd", args, comm)
    hvd.shutdown()
    theirs = None
    if args.horovod and horovod is not None:
        # Horovod runs after baguahvd has stopped: one engine thread at a time.
        horovod.init()
        theirs = _measure(horovod, "horovod", args, comm)
        horovod.shutdown()
    for index, (title, names, times) in enumerate(ours):
        lines += _table(title, names, times, raw=3)
        if theirs is None:
            continue
        _, their_names, their_times = theirs[index]
        lines += _table(f"  Horovod {version('horovod')}, with raw baselines of its own run",
                        their_names, their_times, raw=3)
        for name, mine, other in zip(names[3:], times[3:], their_times[3:]):
            speed = statistics.median(other) / statistics.median(mine)
            lines.append(f"  {name:<44} {speed:5.2f}x Horovod's speed")
    lines.append(_load())
    if comm.Get_rank() == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
