"""What negotiation costs a rank as the job grows: the in-process world at 2 to 256 ranks.

Every rank is a thread driving a real :class:`~baguahvd.engine.engine.Engine` over the
in-process world of ``tests/fakes/world.py``, with two changes: the control plane costs what
mpi4py's does (the payloads of ``gather``, ``broadcast`` and ``send`` are pickled by the sender and
unpickled by the receivers, on the engine thread, as mpi4py does for Python objects), and
a meeting wakes its members once, when the last arrives (the test world's members poll).
Each step every rank submits ``--requests`` named allreduces of one float and waits for
them. Two cases:

- **hits**: the response cache on (Horovod's default); after the first step each cycle is
  one bitwise AND over the ranks;
- **misses**: ``HOROVOD_CACHE_CAPACITY=0``; every request goes to rank 0 in every step,
  which matches it across the ranks and broadcasts the decision. The reports reach rank 0
  up the tree of :mod:`baguahvd.engine.negotiation.tree` from ``--tree-from`` ranks on (the
  engine's default: ``TREE_FROM_RANKS``), gathered below that.

Measured per step, on rank 0 (the coordinator) and on the median of the other ranks (the
workers): the CPU time of the engine thread, less the time it spent inside the in-memory
world's meetings (the fake transport: an MPI job spends that time in MPI instead). What is
left is the engine's own work: building and reading announcements, pickling, matching,
fusion planning, dispatch. Thread CPU time is unaffected by the threads sharing two cores,
although the run's wall time is not.

Without the threads (``--alone``), each rank's work on one cycle of misses, from 2 to 4,096
ranks: with the gather, rank 0 unpickling every report, merging, matching and pickling the
decision; up the tree, rank 0's work, the busiest other rank's, a leaf's, and the chain of
work that ends rank 0's (each rank merging a child's tally once that child is done; no time
on the wire).

The prediction for 1,024 and 4,096 ranks fits ``a + b * ranks`` to each series, and adds a
network model of the messages: hits cost one allreduce of the announcement's words
(``2 * log2(ranks)`` latencies in a tree or recursive doubling, as MPI does for small
messages), misses a gather of every report to rank 0 (``ranks - 1`` messages arriving at
one rank) or the tree (``log2(ranks)`` latencies) and a broadcast of the decision
(``log2(ranks)`` latencies). Horovod's design is
the same: a bit-vector allreduce for cache hits, a gather to its coordinator on misses.

    python benchmarks/negotiation_scale.py --ranks 2 4 8 16 32 64 128 256
    python benchmarks/negotiation_scale.py --cases --alone 2 8 64 1024 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from negotiation_alone import gather_alone, gather_pickling_s, tree_alone  # noqa: E402

from baguahvd.backends.base import Pending  # noqa: E402
from baguahvd.engine.messages import OpType  # noqa: E402
from baguahvd.engine.negotiation import tree  # noqa: E402
from tests.fakes import world as world_module  # noqa: E402

FIT_FROM = 8
"""The prediction fits the rows from this many ranks on (smaller jobs add fixed costs)."""

CYCLE_TIME_MS = 1000.0
"""Long, so that a cycle starts when a rank's thread waits for its step's handles (after
submitting all of them), not while 256 threads on two cores are still submitting: the
cycles per step are then what a job whose ranks have cores of their own would run."""

LATENCY_S = 5e-6
"""One small message between two nodes, for the network model (InfiniBand-class)."""


def _thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


class _Accounting:
    """Per rank: the engine thread's id and the CPU time it spent in world meetings."""

    def __init__(self, size: int) -> None:
        self.thread = [0] * size
        self.transport = [0.0] * size
        self.bytes_to_root = [0] * size
        self.decision_bytes = [0] * size


def _timed_meet(accounting: _Accounting, rank: int, call: Callable[[], Any]) -> Any:
    start = time.thread_time()
    try:
        return call()
    finally:
        accounting.transport[rank] += time.thread_time() - start


class _QuietWorld(world_module.World):
    """The in-process world with meetings that wake their members once, when the last
    one arrives, instead of every few milliseconds: 256 waiting threads polling would
    keep two cores busy on their own. It drops what a benchmark without failures does
    not need: the parking of a closed world."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._arrived: dict[tuple[object, ...], threading.Event] = {}

    def meet(self, key: tuple[object, ...], rank: int, members: int, value: Any,
             timeout_s: float | None = None) -> dict[int, Any] | None:
        with self._cond:
            meeting = self._meetings.setdefault(key, {})
            meeting[rank] = value
            everyone = self._arrived.setdefault(key, threading.Event())
            if len(meeting) == members:
                everyone.set()
        if not everyone.wait(timeout_s):
            return None
        with self._cond:
            values = dict(meeting)
            left = self._left.get(key, 0) + 1
            if left == members:
                del self._meetings[key]
                del self._arrived[key]
                self._left.pop(key, None)
            else:
                self._left[key] = left
        return values


    def receive(self, key: tuple[object, ...]) -> Any:
        with self._cond:
            meeting = self._meetings.setdefault(key, {})
            arrived = self._arrived.setdefault(key, threading.Event())
            if meeting:
                arrived.set()
        arrived.wait()
        with self._cond:
            (value,) = self._meetings.pop(key).values()
            del self._arrived[key]
        return value

    def arrive(self, key: tuple[object, ...], rank: int, value: Any) -> None:
        super().arrive(key, rank, value)
        if key[0] == "message":
            with self._cond:
                self._arrived.setdefault(key, threading.Event()).set()


class _TimedPending(Pending):
    """A started bitwise AND whose tests and waits count as the rank's transport time."""

    def __init__(self, inner: Pending, accounting: _Accounting, rank: int) -> None:
        self._inner, self._accounting, self._rank = inner, accounting, rank

    def test(self) -> bool:
        return bool(_timed_meet(self._accounting, self._rank, self._inner.test))

    def wait(self, timeout_s: float) -> None:
        _timed_meet(self._accounting, self._rank, lambda: self._inner.wait(timeout_s))

    def result(self) -> np.ndarray:
        return self._inner.result()


class _PicklingControlPlane(world_module.MemoryControlPlane):
    """The in-memory control plane, with mpi4py's pickling of object payloads."""

    accounting: _Accounting

    def start_bitwise_and(self, words: np.ndarray) -> Pending:
        self.accounting.thread[self.rank] = threading.get_ident()
        return _TimedPending(super().start_bitwise_and(words), self.accounting, self.rank)

    def gather(self, payload: Any) -> list[Any] | None:
        data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
        self.accounting.bytes_to_root[self.rank] += len(data)
        parent = super().gather
        gathered = _timed_meet(self.accounting, self.rank, lambda: parent(data))
        return None if gathered is None else [pickle.loads(item) for item in gathered]

    def send(self, payload: Any, peer: int) -> None:
        data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
        self.accounting.bytes_to_root[self.rank] += len(data)
        parent = super().send
        _timed_meet(self.accounting, self.rank, lambda: parent(data, peer))

    def recv(self, peer: int) -> Any:
        parent = super().recv
        return pickle.loads(_timed_meet(self.accounting, self.rank, lambda: parent(peer)))

    def broadcast(self, payload: Any) -> Any:
        data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL) if self.rank == 0 else None
        parent = super().broadcast
        received = _timed_meet(self.accounting, self.rank, lambda: parent(data))
        self.accounting.decision_bytes[self.rank] += len(received)
        return pickle.loads(received)


class _TimedCommunicator(world_module.MemoryCommunicator):
    accounting: _Accounting

    def _all(self, value: Any) -> list[Any]:
        parent = super()._all
        return _timed_meet(self.accounting, self.rank, lambda: parent(value))  # type: ignore[no-any-return]


def measure(size: int, requests: int, steps: int, cached: bool) -> dict[str, Any]:
    accounting = _Accounting(size)
    _PicklingControlPlane.accounting = accounting
    _TimedCommunicator.accounting = accounting
    original = (world_module.World, world_module.MemoryControlPlane,
                world_module.MemoryCommunicator)
    world_module.World = _QuietWorld  # type: ignore[misc]
    world_module.MemoryControlPlane = _PicklingControlPlane  # type: ignore[misc]
    world_module.MemoryCommunicator = _TimedCommunicator  # type: ignore[misc]
    try:
        job = world_module.start_job(
            size, cache_capacity=1024 if cached else 0, cycle_time_ms=CYCLE_TIME_MS
        )
    finally:
        world_module.World = original[0]  # type: ignore[misc]
        world_module.MemoryControlPlane = original[1]  # type: ignore[misc]
        world_module.MemoryCommunicator = original[2]  # type: ignore[misc]
    tensors = [[torch.ones(1) for _ in range(requests)] for _ in range(size)]

    def step(rank: int, engine: Any) -> None:
        handles = [
            engine.submit(OpType.ALLREDUCE, "allreduce", 0, [t], [t], name=f"grad.{i}")
            for i, t in enumerate(tensors[rank])
        ]
        for handle in handles:
            handle.wait()

    timeout = 60.0 + size
    try:
        job.run(step, timeout)  # the first step fills the cache
        cpu0 = [_thread_cpu(ident) for ident in accounting.thread]
        transport0 = list(accounting.transport)
        cycles0 = [engine.cycles for engine in job.engines]
        bytes0 = list(accounting.bytes_to_root)
        decisions0 = list(accounting.decision_bytes)
        wall0 = time.perf_counter()
        for _ in range(steps):
            job.run(step, timeout)
        wall = time.perf_counter() - wall0
        own = [
            (_thread_cpu(ident) - c0) - (t1 - t0)
            for ident, c0, t0, t1 in zip(accounting.thread, cpu0, transport0,
                                         accounting.transport)
        ]
        cycles = [engine.cycles - c0 for engine, c0 in zip(job.engines, cycles0)]
    finally:
        job.close()
    return {
        "ranks": size,
        "cached": cached,
        "coordinator_s": own[0] / steps,
        "worker_s": statistics.median(own[1:]) / steps,
        "cycles_per_step": statistics.median(cycles) / steps,
        "report_bytes": statistics.median(
            b1 - b0 for b0, b1 in zip(bytes0, accounting.bytes_to_root)) / steps,
        "decision_bytes": statistics.median(
            d1 - d0 for d0, d1 in zip(decisions0, accounting.decision_bytes)) / steps,
        "wall_s_per_step": wall / steps,
    }


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``a + b * ranks``."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


def network_s(ranks: int, cached: bool, up_the_tree: bool) -> float:
    """Latency of the cycle's messages (see module docstring)."""
    depth = math.ceil(math.log2(max(ranks, 2)))
    if cached:
        return 2 * depth * LATENCY_S
    if up_the_tree:  # a tree to rank 0, a tree back
        return 2 * depth * LATENCY_S
    return (ranks - 1) * LATENCY_S / 4 + depth * LATENCY_S  # gather: 4 messages/latency in


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--requests", type=int, default=64, help="allreduces per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=["hits", "misses"],
                        choices=["hits", "misses"], help="the threaded runs (none: skip)")
    parser.add_argument("--tree-from", type=int, default=tree.TREE_FROM_RANKS,
                        help="threaded runs: jobs of this many ranks or more use the tree")
    parser.add_argument("--alone", type=int, nargs="*",
                        default=[2, 4, 8, 16, 32, 64, 256, 1024, 4096],
                        help="ranks of the runs without threads")
    parser.add_argument("--predict", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tree.TREE_FROM_RANKS = args.tree_from
    rows = []
    if args.cases:  # warms the process up (imports, first allocations); not reported
        measure(2, args.requests, 1, args.cases[0] == "hits")
    for case in args.cases:
        for size in args.ranks:
            row = measure(size, args.requests, args.steps, case == "hits")
            row["tree"] = size >= args.tree_from
            rows.append(row)
            print(f"{case:6} {size:4d} ranks ({'tree' if row['tree'] else 'gather'}): "
                  f"coordinator {1e3 * row['coordinator_s']:8.3f} ms/step, worker "
                  f"{1e3 * row['worker_s']:7.3f} ms/step, {row['cycles_per_step']:.1f} "
                  f"cycles/step, sent {row['report_bytes']:.0f} B/step, decisions "
                  f"{row['decision_bytes']:.0f} B/step, wall {row['wall_s_per_step']:.2f} s/step",
                  flush=True)
    alone = []
    for size in args.alone:
        root = gather_alone(size, args.requests)
        gathered = gather_pickling_s(size, args.requests) + root
        row = {"ranks": size, "gather_path_s": gathered, "gather_root_s": root,
               **{f"tree_{k}": v for k, v in tree_alone(size, args.requests).items()}}
        alone.append(row)
        print(f"alone, misses, {size:5d} ranks: gather: rank 0 {1e3 * row['gather_root_s']:8.3f} "
              f"ms, chain {1e3 * gathered:8.3f} ms; tree: rank 0 {1e3 * row['tree_root_s']:6.3f} "
              f"ms, busiest other {1e3 * row['tree_interior_s']:6.3f} ms, leaf "
              f"{1e3 * row['tree_leaf_s']:6.3f} ms, chain {1e3 * row['tree_path_s']:7.3f} ms, "
              f"largest message {row['tree_message_bytes']} B", flush=True)
    predictions = []
    for cached in (True, False):
        series = [r for r in rows if r["cached"] == cached and r["ranks"] >= FIT_FROM]
        if len(series) < 2:
            continue
        for role in ("coordinator_s", "worker_s"):
            a, b = _fit([(r["ranks"], r[role]) for r in series])
            for size in args.predict:
                predictions.append({
                    "cached": cached, "role": role.removesuffix("_s"), "ranks": size,
                    "engine_s": a + b * size,
                    "network_s": network_s(size, cached, size >= args.tree_from),
                    "fit": {"a": a, "b": b},
                })
    for p in predictions:
        print(f"predicted {'hits' if p['cached'] else 'misses':6} {p['role']:11} at "
              f"{p['ranks']:5d} ranks: engine {1e3 * p['engine_s']:8.3f} ms/step, "
              f"messages {1e3 * p['network_s']:7.3f} ms/cycle", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"requests": args.requests, "steps": args.steps,
                       "tree_from": args.tree_from, "rows": rows, "alone": alone,
                       "predictions": predictions, "latency_s": LATENCY_S}, out, indent=1)


if __name__ == "__main__":
    main()
