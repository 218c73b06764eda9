"""A burst of in-place async allreduces: ``--count`` ``allreduce_async_`` calls, then
``synchronize`` on every handle, baguahvd against Horovod in one run.

    mpirun -np 2 python benchmarks/submission_burst.py                  # 300 x 4 KB
    mpirun -np 2 python benchmarks/submission_burst.py --count 300 --bytes 4096 \\
        --runs 5 --bursts 20 --json burst.json

Each burst submits ``--count`` named in-place ``allreduce_async_`` (``Sum``, float32,
``--bytes`` bytes each, one tensor per name; ``--unnamed``: without names, paired by their
order) as fast as the caller can, then waits for every handle in submission order, as a
hand-written gradient loop would. Two figures per burst,
each the slowest rank's (every burst starts after a barrier):

- submission: the seconds from the first call to the return of the last, per call (what the
  caller pays to hand a tensor over, before any waiting); also the fastest burst's, which
  moves least with the load of the machine;
- completion: the seconds from the first call until the last ``synchronize`` returns.

Systems (``--systems``): ``baguahvd`` (``baguahvd.torch``), and ``horovod`` (``horovod.torch``)
when it imports. Only one runs at a time: each run starts a system with ``init()``, times
``--bursts`` bursts after ``--warmup``, and shuts it down before the next system starts;
the order of the systems alternates from run to run. Two raw mpi4py baselines run in every
run, with no engine started: one ``Allreduce(IN_PLACE)`` of all the burst's bytes at once,
and ``--count`` in-place ``Allreduce`` of ``--bytes`` one after the other.

Rank 0 prints, per system, the median over runs of each run's median burst, its own garbage
collections per timed burst by generation (young, middle, full: how many and their ms; a
full collection of a process that imported torch takes tens of ms), and the load average
before and after; with both systems, baguahvd's completion over Horovod's, of the
medians and run by run (a run's two systems ran back to back, under the same load, so the
median of those paired ratios is the steadier figure on a noisy machine); ``--json`` also
keeps every burst's figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import baguahvd.torch as hvd

try:  # optional reference: Horovod itself, when installed
    import horovod.torch as horovod  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure means "not available"
    horovod = None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _api(system: str) -> Any:
    return hvd if system == "baguahvd" else horovod


def _burst_fn(
    api: Any, count: int, each: int, unnamed: bool = False
) -> Callable[[MPI.Comm], tuple[float, float]]:
    """One burst of ``count`` in-place async allreduces with ``api`` (``unnamed``: without
    names, paired by their order); returns the slowest rank's (submission seconds per call,
    completion seconds)."""
    tensors = [torch.zeros(each) for _ in range(count)]
    names: list[str | None] = [None if unnamed else f"burst.{i}" for i in range(count)]
    size = api.size()
    # One checked burst: every tensor holds rank + 1, the sum is known.
    for tensor in tensors:
        tensor.fill_(float(api.rank() + 1))
    handles = [api.allreduce_async_(t, op=api.Sum, name=n) for t, n in zip(tensors, names)]
    for handle in handles:
        api.synchronize(handle)
    expected = size * (size + 1) / 2
    for tensor in tensors:
        if not torch.all(tensor == expected):
            raise AssertionError(f"got {tensor[:4].tolist()}, expected {expected}")
        tensor.zero_()

    def burst(comm: MPI.Comm) -> tuple[float, float]:
        comm.Barrier()
        start = time.perf_counter()
        handles = [api.allreduce_async_(t, op=api.Sum, name=n) for t, n in zip(tensors, names)]
        submitted = time.perf_counter()
        for handle in handles:
            api.synchronize(handle)
        done = time.perf_counter()
        mine = ((submitted - start) / count, done - start)
        return comm.allreduce(mine[0], op=MPI.MAX), comm.allreduce(mine[1], op=MPI.MAX)

    return burst


def _raw(comm: MPI.Comm, count: int, each: int, bursts: int) -> dict[str, list[float]]:
    """The raw baselines' seconds, ``bursts`` samples each (slowest rank's)."""
    whole = np.zeros(count * each, dtype=np.float32)
    pieces = [np.zeros(each, dtype=np.float32) for _ in range(count)]
    samples: dict[str, list[float]] = {"one_call_s": [], "calls_in_a_row_s": []}
    for index in range(bursts + 2):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, whole, op=MPI.SUM)
        one = time.perf_counter() - start
        comm.Barrier()
        start = time.perf_counter()
        for piece in pieces:
            comm.Allreduce(MPI.IN_PLACE, piece, op=MPI.SUM)
        row = time.perf_counter() - start
        if index >= 2:  # the first two warm the buffers up
            samples["one_call_s"].append(comm.allreduce(one, op=MPI.MAX))
            samples["calls_in_a_row_s"].append(comm.allreduce(row, op=MPI.MAX))
    return samples


class _Collections:
    """This process's garbage collections while it is installed: per generation, how many
    and their seconds (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.count = [0.0, 0.0, 0.0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def _run(system: str, args: argparse.Namespace, comm: MPI.Comm) -> dict[str, list[float]]:
    """One run of ``system``: start it, time its bursts, shut it down."""
    api = _api(system)
    api.init()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    collections = _Collections()
    try:
        burst = _burst_fn(api, args.count, args.bytes // 4, args.unnamed)
        for _ in range(args.warmup):
            burst(comm)
        gc.callbacks.append(collections)
        try:
            figures = [burst(comm) for _ in range(args.bursts)]
        finally:
            gc.callbacks.remove(collections)
    finally:
        api.shutdown()
        gc.unfreeze()
        gc.collect()
    return {"submit_s_per_call": [f[0] for f in figures],
            "complete_s": [f[1] for f in figures],
            "gc_collections": collections.count, "gc_s": collections.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="allreduces per burst")
    parser.add_argument("--bytes", type=int, default=4096, help="float32 bytes per tensor")
    parser.add_argument("--systems", nargs="+", default=["baguahvd", "horovod"],
                        help="baguahvd and/or horovod (left out when it does not import)")
    parser.add_argument("--runs", type=int, default=5, help="runs per system, alternated")
    parser.add_argument("--bursts", type=int, default=20, help="timed bursts per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed bursts per run")
    parser.add_argument("--json", help="write every burst's figures here (rank 0)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once each system has started (what a script "
                        "may do once its model is built)")
    parser.add_argument("--unnamed", action="store_true",
                        help="submit without names (paired by their order)")
    args = parser.parse_args()
    systems = [s for s in args.systems if s != "horovod" or horovod is not None]
    unknown = set(systems) - {"baguahvd", "horovod"}
    if unknown:
        parser.error(f"unknown systems: {sorted(unknown)}")
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    load_before = _load()
    runs: dict[str, list[dict[str, list[float]]]] = {s: [] for s in systems}
    raw: list[dict[str, list[float]]] = []
    for index in range(args.runs):
        for system in systems if index % 2 == 0 else systems[::-1]:
            runs[system].append(_run(system, args, comm))
        raw.append(_raw(comm, args.count, args.bytes // 4, args.bursts))
    load_after = _load()
    if rank != 0:
        return

    def per_run(samples: list[dict[str, list[float]]], key: str) -> list[float]:
        return [statistics.median(run[key]) for run in samples]

    summary: dict[str, Any] = {}
    bursts = args.runs * args.bursts
    for system, samples in runs.items():
        submit = per_run(samples, "submit_s_per_call")
        complete = per_run(samples, "complete_s")
        summary[system] = {
            "submit_us_per_call": 1e6 * statistics.median(submit),
            "complete_ms": 1e3 * statistics.median(complete),
            "complete_ms_per_run": [1e3 * c for c in complete],
            "submit_us_per_call_per_run": [1e6 * s for s in submit],
            "submit_us_per_call_fastest": 1e6 * min(
                min(run["submit_s_per_call"]) for run in samples
            ),
            # Rank 0's collections per timed burst, by generation, and their ms per burst.
            "gc_per_burst": [sum(run["gc_collections"][g] for run in samples) / bursts
                             for g in range(3)],
            "gc_ms_per_burst": [1e3 * sum(run["gc_s"][g] for run in samples) / bursts
                                for g in range(3)],
        }
    raw_one = 1e3 * statistics.median(per_run(raw, "one_call_s"))
    raw_row = 1e3 * statistics.median(per_run(raw, "calls_in_a_row_s"))
    total = args.count * args.bytes
    lines = [
        f"{args.count} x {args.bytes} B in-place allreduce_async_ + synchronize, "
        f"{comm.Get_size()} ranks, {args.runs} runs x {args.bursts} bursts; "
        f"load average {load_before} -> {load_after}",
        f"  raw Allreduce in place, one call of {total} B: {raw_one:8.3f} ms",
        f"  raw Allreduce in place, {args.count} calls in a row: {raw_row:8.3f} ms",
    ]
    for system, figures in summary.items():
        per = " ".join(f"{c:.2f}" for c in figures["complete_ms_per_run"])
        lines.append(
            f"  {system:<9} submission {figures['submit_us_per_call']:7.1f} us/call "
            f"(fastest burst {figures['submit_us_per_call_fastest']:.2f})   "
            f"completion {figures['complete_ms']:8.3f} ms "
            f"({figures['complete_ms'] / raw_one:5.2f}x one raw call)   runs: {per}"
        )
        collected = ", ".join(
            f"{label} {count:.2f} ({ms:.3f} ms)" for label, count, ms in zip(
                ("young", "middle", "full"), figures["gc_per_burst"],
                figures["gc_ms_per_burst"],
            )
        )
        lines.append(f"  {system:<9} garbage collections per burst (rank 0): {collected}")
    if "baguahvd" in summary and "horovod" in summary:
        ratio = summary["baguahvd"]["complete_ms"] / summary["horovod"]["complete_ms"]
        # Each run's two systems ran one after the other: their ratio sees the same load.
        paired = [
            ours / theirs for ours, theirs in zip(
                summary["baguahvd"]["complete_ms_per_run"],
                summary["horovod"]["complete_ms_per_run"],
            )
        ]
        lines.append(
            f"  baguahvd / Horovod completion: {ratio:.2f}x; per run "
            f"{' '.join(f'{r:.2f}' for r in paired)}, median {statistics.median(paired):.2f}x"
        )
    print("\n".join(lines), flush=True)
    if args.json:
        record = {
            "ranks": comm.Get_size(), "count": args.count, "bytes": args.bytes,
            "runs": args.runs, "bursts": args.bursts, "warmup": args.warmup,
            "load_before": load_before, "load_after": load_after,
            "raw_one_call_ms": raw_one, "raw_calls_in_a_row_ms": raw_row,
            "summary": summary, "samples": runs, "raw_samples": raw,
        }
        if horovod is not None:
            from importlib.metadata import version

            record["horovod_version"] = version("horovod")
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)


if __name__ == "__main__":
    main()
