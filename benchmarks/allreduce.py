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
figures join too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stop at 16 MB")
    parser.add_argument("--fused-count", type=int, default=256)
    parser.add_argument("--no-gloo", dest="gloo", action="store_false",
                        help="leave out torch.distributed's gloo allreduce")
    args = parser.parse_args()

    hvd.init()
    comm = MPI.COMM_WORLD
    rank = hvd.rank()
    largest = 16 * 2**20 if args.quick else 256 * 2**20
    sizes = []
    nbytes = 4 * 1024
    while nbytes <= largest:
        sizes.append(nbytes)
        nbytes *= 4

    if args.gloo:
        from gloo import start_gloo

        start_gloo(comm)
    header = f"{'size':>8} | {'raw MPI':>10} | {'baguahvd':>10} | {'ratio':>6}"
    if args.gloo:
        header += f" | {'gloo':>10} | {'ratio':>6}"
    if horovod is not None:
        header += f" | {'horovod':>10} | {'ratio':>6}"
    lines = [f"allreduce (float32, Sum) on {hvd.size()} ranks; time per call", header]

    for nbytes in sizes:
        count = nbytes // 4
        send = torch.full((count,), float(rank + 1))
        recv = torch.empty_like(send)
        send_np, recv_np = send.numpy(), recv.numpy()
        iters = _iterations(nbytes)

        def raw() -> None:
            comm.Allreduce(send_np, recv_np, op=MPI.SUM)

        def ours() -> None:
            hvd.allreduce(send, op=hvd.Sum, name="bench")

        ours()
        raw()
        t_raw = _timed(raw, iters, comm)
        t_ours = _timed(ours, iters, comm)
        line = f"{_human(nbytes):>8} | {t_raw * 1e6:8.0f}us | {t_ours * 1e6:8.0f}us | " \
               f"{t_raw / t_ours:6.2f}"
        if args.gloo:
            t_gloo = _timed(lambda: dist.all_reduce(send), iters, comm)
            line += f" | {t_gloo * 1e6:8.0f}us | {t_raw / t_gloo:6.2f}"
        if horovod is not None:
            t_hvd = _timed(lambda: horovod.allreduce(send, op=horovod.Sum, name="b"), iters, comm)
            line += f" | {t_hvd * 1e6:8.0f}us | {t_raw / t_hvd:6.2f}"
        lines.append(line)

    n = args.fused_count
    lines.append("")
    lines.append(f"{n} named allreduce_async + synchronize vs one raw Allreduce of the same bytes")
    lines.append(header)
    for per_tensor in (1024, 16 * 1024, 64 * 1024):
        tensors = [torch.full((per_tensor // 4,), float(rank + i)) for i in range(n)]
        flat = torch.cat(tensors)
        out = torch.empty_like(flat)
        flat_np, out_np = flat.numpy(), out.numpy()
        names = [f"fused.{i}" for i in range(n)]

        def raw_one() -> None:
            comm.Allreduce(flat_np, out_np, op=MPI.SUM)

        def ours_many() -> None:
            handles = [
                hvd.allreduce_async(t, op=hvd.Sum, name=name) for t, name in zip(tensors, names)
            ]
            for handle in handles:
                hvd.synchronize(handle)

        ours_many()
        iters = max(3, min(50, int(16 * 2**20 / flat.numel() / 4)))
        t_raw = _timed(raw_one, iters, comm)
        t_ours = _timed(ours_many, iters, comm)
        label = f"{n}x{_human(per_tensor)}"
        line = f"{label:>8} | {t_raw * 1e6:8.0f}us | {t_ours * 1e6:8.0f}us | {t_raw / t_ours:6.2f}"
        if args.gloo:

            def gloo_many() -> None:
                works = [dist.all_reduce(t, async_op=True) for t in tensors]
                for work in works:
                    work.wait()

            gloo_many()
            t_gloo = _timed(gloo_many, iters, comm)
            line += f" | {t_gloo * 1e6:8.0f}us | {t_raw / t_gloo:6.2f}"
        lines.append(line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
