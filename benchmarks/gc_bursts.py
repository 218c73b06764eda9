"""Python's garbage collections during bursts of async allreduces, as a hand-written loop
makes them: ``--count`` named in-place ``allreduce_async_`` of 4 KB, ``synchronize`` on each,
and one small blocking allreduce between bursts (a loop's loss, say).

    mpirun -np 2 python benchmarks/gc_bursts.py                     # baguahvd
    mpirun -np 2 python benchmarks/gc_bursts.py --freeze            # gc.freeze() first
    mpirun -np 2 python benchmarks/gc_bursts.py --system horovod    # when it imports

Rank 0 counts, through ``gc.callbacks``, the collections of each generation (young, middle,
full) during ``--bursts`` timed bursts and their time, and prints them per burst with the
median and mean burst. A full collection walks every tracked object of the process (about
175,000 once torch is imported): the mean shows it where the median does not.
``--freeze`` calls ``gc.freeze()`` after ``init()`` (what a script can do once its model is
built): the objects made before it are left out of every later collection.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", default="baguahvd", choices=["baguahvd", "horovod"])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--bursts", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--freeze", action="store_true")
    args = parser.parse_args()
    hvd = importlib.import_module(f"{args.system}.torch")
    hvd.init()
    if args.freeze:
        gc.collect()
        gc.freeze()
    counts: collections.Counter[int] = collections.Counter()
    seconds: dict[int, float] = collections.defaultdict(float)
    started = [0.0]

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - started[0]

    tensors = [torch.ones(1024) for _ in range(args.count)]
    names = [f"burst.{i}" for i in range(args.count)]
    bursts: list[float] = []
    for index in range(args.warmup + args.bursts):
        hvd.allreduce(torch.zeros(1), name="between")
        if index == args.warmup:
            gc.callbacks.append(collected)
        start = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=n) for t, n in zip(tensors, names)]
        for handle in handles:
            hvd.synchronize(handle)
        if index >= args.warmup:
            bursts.append(time.perf_counter() - start)
    gc.callbacks.remove(collected)
    if hvd.rank() == 0:
        per = ", ".join(
            f"{label} {counts[g] / args.bursts:.2f} ({1e3 * seconds[g] / args.bursts:.3f} ms)"
            for g, label in enumerate(("young", "middle", "full"))
        )
        longest = 1e3 * seconds[2] / counts[2] if counts[2] else 0.0
        print(f"{args.system}{' (gc.freeze)' if args.freeze else ''}: "
              f"{args.bursts} bursts of {args.count}, median {1e3 * statistics.median(bursts):.3f}"
              f" ms, mean {1e3 * statistics.mean(bursts):.3f} ms; collections per burst: {per}; "
              f"a full collection {longest:.1f} ms; {len(gc.get_objects())} tracked objects",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
