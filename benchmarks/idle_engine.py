"""What baguahvd's engine costs the training threads while it has nothing to do.

Run under MPI, one rank per core (or in the emulated cluster, ``emulated_cluster.sh``)::

    mpirun -np 2 python benchmarks/idle_engine.py

The engine thread negotiates in cycles, and a cycle is a round trip between all ranks even
when nobody submitted anything. Three measurements, one torch thread per rank:

1. The engine thread's share of a core and its cycles per second while the job does
   nothing for ``--idle-seconds`` (per-thread CPU time from ``/proc``).
2. A compute-only step of the algorithm benchmark's MLP (forward, backward, SGD, no
   collective) with baguahvd initialized and idle, against baguahvd shut down: rounds of
   ``--steps`` steps alternate in one run, and the table gives the median of each phase.
3. A 16 KB ``hvd.allreduce`` issued after 50 ms in which the job did nothing, against the
   same call right after it: what the first collective after a quiet spell pays.

The load average is printed before and after: other processes distort the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from algorithms import MODEL_DIMS, build_model  # noqa: E402

import baguahvd.torch as hvd  # noqa: E402
from baguahvd.runtime.runtime import runtime  # noqa: E402


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each Python thread of this process, by name."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[thread.name] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def idle_share(seconds: float) -> tuple[float, float]:
    """(engine thread's share of a core, cycles per second) over ``seconds`` of nothing."""
    engine = runtime.require_engine()
    MPI.COMM_WORLD.Barrier()
    cpu0, cycles0, start = thread_cpu_s(), engine.cycles, time.perf_counter()
    time.sleep(seconds)
    cpu1, cycles1 = thread_cpu_s(), engine.cycles
    elapsed = time.perf_counter() - start
    name = "baguahvd-engine"
    return (cpu1[name] - cpu0.get(name, 0.0)) / elapsed, (cycles1 - cycles0) / elapsed


def compute_phases(steps: int, rounds: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per state ("idle engine", "no engine"), (forward, backward, optimizer) seconds of
    every timed step; baguahvd is initialized for the first state of each round."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    data = torch.randn(64, MODEL_DIMS[0])
    target = torch.randint(0, MODEL_DIMS[-1], (64,))
    loss_fn = torch.nn.CrossEntropyLoss()
    phases: dict[str, list[tuple[float, float, float]]] = {"idle engine": [], "no engine": []}
    for _ in range(rounds):
        for state in phases:
            if state == "idle engine":
                hvd.init()
            MPI.COMM_WORLD.Barrier()
            for step in range(steps + 2):
                start = time.perf_counter()
                optimizer.zero_grad()
                loss = loss_fn(model(data), target)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                optimizer.step()
                end = time.perf_counter()
                if step >= 2:  # the first steps after a state change settle caches
                    phases[state].append((forward - start, backward - forward, end - backward))
            if state == "idle engine":
                hvd.shutdown()
    return phases


def after_quiet(calls: int) -> tuple[list[float], list[float]]:
    """Seconds of a 16 KB allreduce after 50 ms of nothing, and of the one right after."""
    tensor = torch.ones(4096)
    first, next_ = [], []

    def timed(call: Callable[[], object]) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    for _ in range(calls):
        MPI.COMM_WORLD.Barrier()
        time.sleep(0.05)
        first.append(timed(lambda: hvd.allreduce(tensor, name="quiet.first", op=hvd.Sum)))
        next_.append(timed(lambda: hvd.allreduce(tensor, name="quiet.next", op=hvd.Sum)))
    return first, next_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=30, help="allreduces after a quiet spell")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    load = os.getloadavg()[0]

    hvd.init()
    share, cycles = idle_share(args.idle_seconds)
    first, next_ = after_quiet(args.calls)
    hvd.shutdown()
    phases = compute_phases(args.steps, args.rounds)

    shares = comm.gather(share)
    if rank:
        return
    print(f"{comm.Get_size()} ranks; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores")
    print(f"idle engine: {cycles:.0f} cycles/s on rank 0; CPU share of a core per rank: "
          + ", ".join(f"{100 * s:.1f}%" for s in shares))
    print("compute-only MLP step, median ms (forward / backward / optimizer / total):")
    totals = {}
    for state, rows in phases.items():
        forward, backward, opt = (statistics.median(c) * 1e3 for c in zip(*rows))
        totals[state] = statistics.median(sum(row) for row in rows) * 1e3
        print(f"  {state:12s} {forward:6.1f} / {backward:6.1f} / {opt:6.1f} / "
              f"{totals[state]:6.1f}")
    print(f"  idle engine / no engine: {totals['idle engine'] / totals['no engine']:.3f}")
    print(f"16 KB allreduce after 50 ms of nothing: median {statistics.median(first) * 1e3:.3f} "
          f"ms; right after it: {statistics.median(next_) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
