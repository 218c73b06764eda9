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
import os
from typing import Any

from elastic_phases import mlp_training, report, run_phases, states

import baguahvd.torch as hvd
from baguahvd.torch.elastic import store as store_module
from baguahvd.torch.elastic.files import Packed

PHASES = ("none", "torch.save", "container")
_PACK = store_module.pack


def _no_container(payload: Any) -> Packed | None:
    """What the store wrote before the container: ``torch.save`` for every payload."""
    return None


def _choose_format(phase: str) -> None:
    store_module.pack = _no_container if phase == "torch.save" else _PACK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    training = mlp_training("commit-format-")
    committing = states(training, {phase: {} for phase in PHASES[1:]})
    times = run_phases(training, PHASES, committing, args.rounds, args.steps, _choose_format)
    load_after = os.getloadavg()
    hvd.shutdown()
    if training.comm.Get_rank() == 0:
        report(times, PHASES,
               f"load average {load_before} -> {load_after}; {args.rounds} rounds x "
               f"{args.steps} steps a phase",
               args.json, load_before=load_before, load_after=load_after)


if __name__ == "__main__":
    main()
