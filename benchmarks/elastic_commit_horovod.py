"""Per-step cost of state.commit(): baguahvd vs Horovod 0.28.1, one plain mpirun job.

    mpirun -np 2 python benchmarks/elastic_commit_horovod.py [--steps 8] [--rounds 3]
        [--idle-ms 600] [--kinds compute idle] [--json out.json]

Model: the 25.2M-parameter MLP of benchmarks/elastic_commit.py (100 MB float32, SGD), one
thread a rank. Systems run one at a time (init, phases, shutdown), order alternated per
round. Phases per system, each --steps steps, rank 0 times every step:

  baguahvd: none | memory (TorchState without elastic folder) | two-half (with a folder:
            in-memory copy + background write; after each commit, how many commits the
            newest durable one is behind) | synchronous (commit + wait_for_commit)
  horovod:  none | memory (hvd.elastic.TorchState.commit(): deepcopy of state_dicts +
            check_host_updates broadcast; no elastic driver needed outside hvd.elastic.run)

Steps: 'compute' (forward/backward/step through the system's DistributedOptimizer) and
'idle' (sleep --idle-ms, then a 1-float allreduce).

Without Horovod installed (it does not build against every torch), only baguahvd runs and
the ratios use baguahvd's 'memory' phase as the stand-in for Horovod's commit: a state
without an elastic folder, whose commit does what Horovod's does.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time

import torch
from mpi4py import MPI

import baguahvd.torch as bhvd
from baguahvd.runtime.runtime import runtime

try:
    import horovod.torch as rhvd
except ImportError:
    rhvd = None

KINDS = ("compute", "idle")


def build(api):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024))
    optimizer = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                         named_parameters=model.named_parameters())
    return model, optimizer


def run_system(system, args, folder):
    api = bhvd if system == "baguahvd" else rhvd
    api.init()
    model, optimizer = build(api)
    data = torch.randn(32, 1024)
    states = {}
    if system == "baguahvd":
        base = runtime.config
        runtime.config = dataclasses.replace(base, elastic_dir=None)
        states["memory"] = bhvd.elastic.TorchState(model, optimizer, step=0)
        runtime.config = dataclasses.replace(base, elastic_dir=folder)
        persisting = bhvd.elastic.TorchState(model, optimizer, step=0)
        runtime.config = base
        states["two-half"] = persisting
        states["synchronous"] = persisting
    else:
        persisting = None
        states["memory"] = rhvd.elastic.TorchState(model, optimizer, step=0)

    def compute():
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()

    def idle():
        time.sleep(args.idle_ms / 1000)
        api.allreduce(torch.zeros(1), name="idle")

    for _ in range(2):
        compute()
    times = {}
    lags = {}
    for kind, step in (("compute", compute), ("idle", idle)):
        if kind not in args.kinds:
            continue
        for phase in ("none", *states):
            MPI.COMM_WORLD.Barrier()
            out = times.setdefault(f"{kind}/{phase}", [])
            lag = lags.setdefault(kind, []) if phase == "two-half" else None
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                if phase != "none":
                    states[phase].commit()
                if phase == "synchronous":
                    states[phase].wait_for_commit()
                out.append(time.perf_counter() - start)
                if lag is not None and persisting._writer is not None:
                    # How many commits the newest durable one is behind the newest made.
                    lag.append(persisting._commits - persisting._writer.durable)
            if persisting is not None:
                start = time.perf_counter()
                persisting.wait_for_commit()
                out[-1] += time.perf_counter() - start
    # The in-memory commit's two parts, timed apart (outside any step): the copy, and the
    # host-update check (a broadcast_object).
    memory = states["memory"]
    for part, call in (("save", memory.save), ("check", memory.check_host_updates)):
        out = times.setdefault(f"split/{part}", [])
        for _ in range(args.steps):
            MPI.COMM_WORLD.Barrier()
            start = time.perf_counter()
            call()
            out.append(time.perf_counter() - start)
    del states, persisting, memory
    api.shutdown()
    gc.collect()
    return times, lags


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-ms", type=float, default=600.0)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="the kinds of step to run")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    folder = tempfile.mkdtemp(prefix="commit-cmp-") if comm.Get_rank() == 0 else None
    folder = comm.bcast(folder, root=0)
    systems = ["baguahvd", "horovod"] if rhvd is not None else ["baguahvd"]
    merged = {}
    lags = {}
    per_round = []
    for index in range(args.rounds):
        for system in systems if index % 2 == 0 else systems[::-1]:
            times, system_lags = run_system(system, args, folder)
            per_round.append({"round": index, "system": system, "times": times,
                              "lags": system_lags})
            for key, values in times.items():
                merged.setdefault(f"{system}:{key}", []).extend(values)
            for kind, values in system_lags.items():
                lags.setdefault(kind, []).extend(values)
    load_after = os.getloadavg()
    if comm.Get_rank() != 0:
        return
    if rhvd is None:
        print("Horovod is not installed: only baguahvd ran; its 'memory' phase stands in "
              "for Horovod's commit")
    med = {k: 1e3 * statistics.median(v) for k, v in merged.items()}
    mean = {k: 1e3 * statistics.fmean(v) for k, v in merged.items()}
    print(f"load average {load_before} -> {load_after}; {args.rounds} rounds x "
          f"{args.steps} steps a phase, 2 ranks")
    for kind in args.kinds:
        print(f"\n{kind} steps")
        print(f"{'system:phase':<26}{'median ms':>10}{'mean ms':>10}"
              f"{'added (median)':>16}{'added (mean)':>14}")
        for system, phases in (("baguahvd", ("none", "memory", "two-half", "synchronous")),
                               ("horovod", ("none", "memory"))):
            if system not in systems:
                continue
            base_med = med[f"{system}:{kind}/none"]
            base_mean = mean[f"{system}:{kind}/none"]
            for phase in phases:
                key = f"{system}:{kind}/{phase}"
                print(f"{system + ':' + phase:<26}{med[key]:>10.1f}{mean[key]:>10.1f}"
                      f"{med[key] - base_med:>16.1f}{mean[key] - base_mean:>14.1f}")
        # Without Horovod, baguahvd's in-memory commit stands in for Horovod's.
        reference = systems[-1]
        h_med = med[f"{reference}:{kind}/memory"] - med[f"{reference}:{kind}/none"]
        h_mean = mean[f"{reference}:{kind}/memory"] - mean[f"{reference}:{kind}/none"]
        if lags.get(kind):
            print(f"baguahvd two-half: the newest durable commit was {min(lags[kind])}-"
                  f"{max(lags[kind])} commits behind the newest (median "
                  f"{statistics.median(lags[kind]):g}), measured after each commit")
        for phase in ("memory", "two-half"):
            b_med = med[f"baguahvd:{kind}/{phase}"] - med[f"baguahvd:{kind}/none"]
            b_mean = mean[f"baguahvd:{kind}/{phase}"] - mean[f"baguahvd:{kind}/none"]
            print(f"baguahvd {phase} added / {reference} memory added: "
                  f"median {b_med / h_med:.2f}x, mean {b_mean / h_mean:.2f}x")
    for system in systems:
        print(f"{system}: in-memory commit parts, median ms: save "
              f"{med[system + ':split/save']:.1f}, check_host_updates "
              f"{med[system + ':split/check']:.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"load_before": load_before, "load_after": load_after,
                       "steps": args.steps, "rounds": args.rounds, "idle_ms": args.idle_ms,
                       "median_ms": med, "mean_ms": mean, "lag_commits": lags,
                       "per_round": per_round}, out,
                      indent=1)


if __name__ == "__main__":
    main()
