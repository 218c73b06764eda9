"""How far the newest durable commit falls behind on CPU-bound steps, with and without a
tight ``BAGUAHVD_ELASTIC_MAX_LAG_SECONDS``, and what the bound costs a step; one plain
mpirun job of two ranks.

    mpirun -np 2 python benchmarks/elastic_commit_lag.py [--steps 12] [--rounds 3]
        [--bound-s 1] [--json out.json]

Model and steps: the 25.2M-parameter MLP of ``benchmarks/elastic_commit.py`` trained on
the CPU (one thread a rank), a two-half commit after every step. Two states of the same
model and optimizer, each with a folder of its own: one whose bound is an hour (never
reached here: as without a bound) and one with ``--bound-s``. Phases of ``--steps``
steps, their order reversed every other round: ``none`` (no commit), ``unbounded``,
``bounded``. After every commit rank 0 records the durable lag: how long ago the newest
durable commit of that state was made (since the phase's first commit, before one is).
The wait for a phase's last write counts in its last step.
"""

from __future__ import annotations

import argparse
import os

from elastic_phases import mlp_training, report, run_phases, states

import baguahvd.torch as hvd

PHASES = ("none", "unbounded", "bounded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bound-s", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    training = mlp_training("commit-lag-")
    committing = states(training, {
        "unbounded": {"elastic_max_lag_s": 3600.0},
        "bounded": {"elastic_max_lag_s": args.bound_s},
    })
    times = run_phases(training, PHASES, committing, args.rounds, args.steps)
    load_after = os.getloadavg()
    hvd.shutdown()
    if training.comm.Get_rank() == 0:
        report(times, PHASES,
               f"load average {load_before} -> {load_after}; {args.rounds} rounds x "
               f"{args.steps} steps a phase; bound {args.bound_s:g} s",
               args.json, load_before=load_before, load_after=load_after,
               bound_s=args.bound_s)


if __name__ == "__main__":
    main()
