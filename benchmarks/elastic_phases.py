"""What the two-rank commit benchmarks share (``elastic_commit_format.py``,
``elastic_commit_lag.py``, ``elastic_commit_affinity.py``): the 25.2M-parameter MLP of
``benchmarks/elastic_commit.py`` trained on the CPU (one thread a rank) under one plain
mpirun job, and phases of steps with a two-half commit after each, timed together with the
durable lag.

In :func:`run_phases`, the phases of a round run in turn, their order reversed every other
round. After every commit rank 0 records the durable lag: how long ago the newest durable
commit of that phase's state was made (since the phase's first commit, before one is).
The wait for a phase's last write counts in its last step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from mpi4py import MPI

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime


@dataclasses.dataclass
class Training:
    """The model, its optimizer, one training step, and a folder every rank shares."""

    comm: Any
    folder: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]


def mlp_training(prefix: str) -> Training:
    """Initializes baguahvd and builds the MLP, its DistributedOptimizer (SGD) and a step
    on a fixed batch; rank 0 makes a temporary folder (``prefix``) for every rank."""
    comm = MPI.COMM_WORLD
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    folder = comm.bcast(tempfile.mkdtemp(prefix=prefix) if hvd.rank() == 0 else None, root=0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                         named_parameters=model.named_parameters())
    data = torch.randn(32, 1024)

    def step() -> None:
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()

    return Training(comm, folder, model, optimizer, step)


def states(training: Training, settings: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One elastic state of the model and optimizer per phase, each with a folder of its own
    and the configuration fields ``settings[phase]`` gives; each makes a first commit (the
    allocations of later ones warmed up) and waits for its write."""
    base = runtime.config
    assert base is not None
    made = {}
    for phase, fields in settings.items():
        runtime.config = dataclasses.replace(
            base, elastic_dir=os.path.join(training.folder, phase), **fields
        )
        made[phase] = hvd.elastic.TorchState(training.model, training.optimizer)
    runtime.config = base
    for state in made.values():
        training.step()
        state.commit()
        state.wait_for_commit()
    return made


@dataclasses.dataclass
class Phases:
    """Per phase: every step's seconds, every durable lag rank 0 saw, the load at its
    starts, and how many commits waited under the lag bound."""

    wall: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    lag: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    loads: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    waits: dict[str, int] = dataclasses.field(default_factory=dict)


def run_phases(
    training: Training, phases: Sequence[str], committing: Mapping[str, Any], rounds: int,
    steps: int, before: Callable[[str], None] | None = None,
) -> Phases:
    """Runs ``rounds`` rounds of every phase (see module docstring); a phase without a
    state in ``committing`` does not commit; ``before(phase)`` runs before each."""
    times = Phases()
    made: dict[str, dict[int, float]] = {}
    for round_ in range(rounds):
        for phase in phases if round_ % 2 == 0 else phases[::-1]:
            training.comm.Barrier()
            times.loads.setdefault(phase, []).append(os.getloadavg()[0])
            if before is not None:
                before(phase)
            state = committing.get(phase)
            made[phase] = {}  # the commits of earlier phases were durable by their ends
            for index in range(steps):
                start = time.perf_counter()
                training.step()
                committed = time.perf_counter()
                if state is not None:
                    state.commit()
                    if index == steps - 1:
                        state.wait_for_commit()
                now = time.perf_counter()
                times.wall.setdefault(phase, []).append(now - start)
                writer = state._writer if state is not None else None
                if writer is not None and hvd.local_rank() == 0:
                    made[phase][state._commits] = committed
                    durable = made[phase].get(writer.durable, min(made[phase].values()))
                    times.lag.setdefault(phase, []).append(now - durable)
    times.waits = {phase: s._writer.lag_waits if s._writer else 0
                   for phase, s in committing.items()}
    return times


def report(
    times: Phases, phases: Sequence[str], header: str, path: str | None,
    **recorded: Any,
) -> None:
    """Prints a table of the phases (rank 0) after ``header``, and writes every figure to
    ``path`` as JSON with ``recorded`` beside them."""
    print(header)
    print(f"{'phase':<10}{'median ms':>10}{'mean ms':>9}{'lag s: median':>15}{'max':>6}"
          f"{'waits':>7}{'load':>12}")
    for phase in phases:
        lags = times.lag.get(phase, [0.0])
        loads = times.loads[phase]
        print(
            f"{phase:<10}{statistics.median(times.wall[phase]) * 1e3:>10.0f}"
            f"{statistics.fmean(times.wall[phase]) * 1e3:>9.0f}"
            f"{statistics.median(lags):>15.2f}{max(lags):>6.2f}"
            f"{times.waits.get(phase, 0):>7}{min(loads):>6.1f}-{max(loads):.1f}"
        )
    if path:
        with open(path, "w") as out:
            json.dump({**recorded, "wall_s": times.wall, "lag_s": times.lag,
                       "lag_waits": times.waits, "loads": times.loads}, out, indent=1)
