"""What the commit format costs a CPU-bound step: the commit container against
``torch.save`` (as written before), in one plain mpirun job of two ranks.

    mpirun -np 2 python benchmarks/elastic_commit_format.py [--steps 12] [--rounds 4]
        [--json out.json]

Model and steps: the 25.2M-parameter MLP of ``benchmarks/elastic_commit.py`` trained on
the CPU (one thread a rank), a two-half commit after every step. Two states of the same
model and optimizer, each with a folder of its own; the one of the ``torch.save`` phase
writes with ``torch.save`` (the store's container turned off for that phase only, in
this process). Phases of ``--steps`` steps, their order reversed every other round:
``none`` (no commit), ``torch.save``, ``container``. After every commit rank 0 records
the durable lag: how long ago the newest durable commit of that state was made (since
the phase's first commit, before one is). The wait for a phase's last write counts in
its last step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from mpi4py import MPI

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic import store as store_module
from baguahvd.torch.elastic.files import Packed

PHASES = ("none", "torch.save", "container")
_PACK = store_module.pack


def _no_container(payload: Any) -> Packed | None:
    """What the store wrote before the container: ``torch.save`` for every payload."""
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    load_before = os.getloadavg()
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="commit-lag-") if hvd.rank() == 0 else None
    folder = comm.bcast(folder, root=0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                         named_parameters=model.named_parameters())
    base = runtime.config
    assert base is not None and folder is not None
    states = {}
    for phase in PHASES[1:]:
        runtime.config = dataclasses.replace(base, elastic_dir=os.path.join(folder, phase))
        states[phase] = hvd.elastic.TorchState(model, optimizer)
    runtime.config = base
    data = torch.randn(32, 1024)

    def step() -> None:
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()

    for state in states.values():  # warm-up, the first commits' allocations included
        step()
        state.commit()
        state.wait_for_commit()
    wall: dict[str, list[float]] = {}
    lag: dict[str, list[float]] = {}
    made: dict[str, dict[int, float]] = {phase: {} for phase in states}
    loads: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for phase in PHASES if round_ % 2 == 0 else PHASES[::-1]:
            comm.Barrier()
            loads.setdefault(phase, []).append(os.getloadavg()[0])
            committing = states.get(phase)
            store_module.pack = _no_container if phase == "torch.save" else _PACK
            made[phase] = {}  # the commits of earlier phases were durable by their ends
            for index in range(args.steps):
                start = time.perf_counter()
                step()
                committed = time.perf_counter()
                if committing is not None:
                    committing.commit()
                    if index == args.steps - 1:
                        committing.wait_for_commit()
                now = time.perf_counter()
                wall.setdefault(phase, []).append(now - start)
                writer = committing._writer if committing is not None else None
                if committing is not None and writer is not None and hvd.local_rank() == 0:
                    made[phase][committing._commits] = committed
                    durable = made[phase].get(writer.durable, min(made[phase].values()))
                    lag.setdefault(phase, []).append(now - durable)
    waits = {phase: s._writer.lag_waits if s._writer else 0 for phase, s in states.items()}
    load_after = os.getloadavg()
    hvd.shutdown()
    if comm.Get_rank() != 0:
        return
    print(f"load average {load_before} -> {load_after}; {args.rounds} rounds x {args.steps} "
          f"steps a phase")
    print(f"{'phase':<10}{'median ms':>10}{'mean ms':>9}{'lag s: median':>15}{'max':>6}"
          f"{'waits':>7}{'load':>12}")
    for phase in PHASES:
        lags = lag.get(phase, [0.0])
        print(
            f"{phase:<10}{statistics.median(wall[phase]) * 1e3:>10.0f}"
            f"{statistics.fmean(wall[phase]) * 1e3:>9.0f}"
            f"{statistics.median(lags):>15.2f}{max(lags):>6.2f}{waits.get(phase, 0):>7}"
            f"{min(loads[phase]):>6.1f}-{max(loads[phase]):.1f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"load_before": load_before, "load_after": load_after,
                       "wall_s": wall, "lag_s": lag,
                       "lag_waits": waits, "loads": loads}, out, indent=1)


if __name__ == "__main__":
    main()
