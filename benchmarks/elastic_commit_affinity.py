"""Whether the cores the commit writer may run on change what a commit costs a CPU-bound
step, in one plain mpirun job of two ranks.

    mpirun -np 2 [--bind-to none] python benchmarks/elastic_commit_affinity.py \\
        [--steps 8] [--rounds 3] [--json out.json]

Model and steps: the 25.2M-parameter MLP of ``benchmarks/elastic_commit.py`` trained on
the CPU (one thread a rank), a commit to an elastic folder after every step (the two-half
commit: in-memory copy, background write). Phases, each ``--steps`` steps, their order
reversed every other round:

* ``none``: no commit;
* ``inherit``: the writer runs where the rank may (rank 0's core under mpirun's default
  binding, any core under ``--bind-to none``), as the library leaves it;
* ``core0`` / ``core1``: the writer pinned to core 0 (under the default binding, rank 0's)
  or core 1 (rank 1's), set on the write thread right after each commit starts it;
* ``all``: the writer allowed on every core.

Rank 0 times every step (the wait for a phase's last write counts in its last step).
Both ranks record their training thread's CPU time per step and the core it was on at
the end of the step, so that a slow step shows whether the rank lacked CPU or waited for
the other rank, and whether the two training threads shared a core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time

from elastic_phases import mlp_training

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime

WRITER_THREAD = "baguahvd-commit-writer"
PHASES = ("none", "inherit", "core0", "core1", "all")


def _current_core() -> int:
    """The core the calling thread last ran on (Linux), -1 where unknown."""
    try:
        with open("/proc/thread-self/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def _pin_writer(cores: set[int] | None) -> None:
    if cores is None:
        return
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD and thread.native_id is not None:
            try:
                os.sched_setaffinity(thread.native_id, cores)
            except OSError:
                pass  # the write ended meanwhile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    training = mlp_training("commit-affinity-")
    comm, step = training.comm, training.step
    assert runtime.config is not None
    runtime.config = dataclasses.replace(runtime.config, elastic_dir=training.folder)
    state = hvd.elastic.TorchState(training.model, training.optimizer, step=0)
    every = set(range(os.cpu_count() or 1))
    pins: dict[str, set[int] | None] = {
        "none": None, "inherit": None, "core0": {0}, "core1": {1 % len(every)}, "all": every,
    }
    rank_affinity = sorted(os.sched_getaffinity(0))

    for _ in range(2):  # warm-up, the first commits' allocations and files included
        step()
        state.commit()
    state.wait_for_commit()
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    cores: dict[str, list[int]] = {}
    loads: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for phase in PHASES if round_ % 2 == 0 else PHASES[::-1]:
            comm.Barrier()
            loads.setdefault(phase, []).append(os.getloadavg()[0])
            for index in range(args.steps):
                start, start_cpu = time.perf_counter(), time.thread_time()
                step()
                if phase != "none":
                    state.commit()
                    _pin_writer(pins[phase])
                if index == args.steps - 1:
                    state.wait_for_commit()
                wall.setdefault(phase, []).append(time.perf_counter() - start)
                cpu.setdefault(phase, []).append(time.thread_time() - start_cpu)
                cores.setdefault(phase, []).append(_current_core())
    gathered = comm.gather({"cpu": cpu, "cores": cores, "affinity": rank_affinity}, root=0)
    load_after = os.getloadavg()
    hvd.shutdown()
    if comm.Get_rank() != 0:
        return
    assert gathered is not None
    print(f"load average {load_before} -> {load_after}; {args.rounds} rounds x {args.steps} "
          f"steps a phase; rank cores: {[g['affinity'] for g in gathered]}")
    print(f"{'writer':<9}{'median ms':>10}{'mean ms':>9}{'added':>7}"
          f"{'rank0 cpu':>10}{'rank1 cpu':>10}{'same core':>10}{'load':>12}")
    base = statistics.median(wall["none"]) * 1e3
    for phase in PHASES:
        median = statistics.median(wall[phase]) * 1e3
        same = sum(a == b for a, b in zip(gathered[0]["cores"][phase], gathered[1]["cores"][phase]))
        print(
            f"{phase:<9}{median:>10.0f}{statistics.fmean(wall[phase]) * 1e3:>9.0f}"
            f"{median - base:>7.0f}"
            f"{statistics.median(gathered[0]['cpu'][phase]) * 1e3:>10.0f}"
            f"{statistics.median(gathered[1]['cpu'][phase]) * 1e3:>10.0f}"
            f"{same:>6}/{len(wall[phase]):<3}"
            f"{min(loads[phase]):>6.1f}-{max(loads[phase]):.1f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"load_before": load_before, "load_after": load_after,
                       "wall_s": wall, "loads": loads, "ranks": gathered}, out, indent=1)


if __name__ == "__main__":
    main()
