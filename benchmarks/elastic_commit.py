"""What ``state.commit()`` costs a training step under ``baguahvdrun --elastic``.

One job, two ranks, a 25.2M-parameter MLP (100 MB of float32 weights, plain SGD so the
optimizer adds no state), one commit after every step. Two kinds of step: ``compute``
trains the model on the CPU (one thread a rank), and ``idle`` sleeps for ``--idle-ms``
instead, standing for a step whose work runs on a GPU while the CPU waits (the commits
still copy and write the 100 MB). For each kind the job runs these phases in turn, each
for ``--steps`` steps, ``--rounds`` times, and rank 0 times every step (the wait for a
phase's last write counts in its last step, so a phase pays for all its writes):

* ``none``: no commit;
* ``memory``: ``commit()`` of a state built without an elastic folder: the in-memory copy
  and the host-change check, which is all that Horovod's ``commit()`` does;
* ``two-half``: ``commit()`` with the folder: the in-memory copy, then the write (the commit
  container hashed with SHA-256 as it is written, fsync, the manifest renamed) on a background
  thread; a commit made during a write waits in memory, superseded by a newer one (rank 0
  also records, after each commit, how many commits the newest durable one is behind);
* ``every-4th``: the same with ``BAGUAHVD_ELASTIC_PERSIST_EVERY=4`` (a state of its own,
  writing to a folder of its own): three commits in four stay in memory;
* ``synchronous``: ``commit()`` then ``state.wait_for_commit()``: every step waits for
  its write, as every commit did before writes moved to the background.

The ``memory`` phase is what Horovod's ``commit()`` does; ``elastic_commit_horovod.py`` runs
Horovod's own commit beside these phases in one job. Run it from the repository root::

    python benchmarks/elastic_commit.py [--steps 8] [--rounds 1] [--idle-ms 600]
        [--results DIR]

The job is started by ``tests/support/jobs.py``, the module the end-to-end tests launch
their jobs with; ``--results`` writes the raw step times there (``raw.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import textwrap
import time

# Run as a script, this file has benchmarks/ on sys.path; the job launcher is imported from
# the repository root (see tests/support/jobs.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.support import jobs  # noqa: E402

TIMEOUT_S = 600
"""Bound on the whole job."""

PHASES = ("none", "memory", "two-half", "every-4th", "synchronous")
KINDS = ("compute", "idle")

_TRAIN = """
import dataclasses
import json
import os
import time

import torch

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime

STEPS, ROUNDS = int(os.environ["STEPS"]), int(os.environ["ROUNDS"])
IDLE_S = float(os.environ["IDLE_MS"]) / 1000
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1024))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
# The same model and optimizer in a state without an elastic folder (in-memory commits),
# and in one that persists every fourth commit to a folder of its own.
with_folder = runtime.config
runtime.config = dataclasses.replace(with_folder, elastic_dir=None)
memory_state = hvd.elastic.TorchState(model, optimizer, step=0)
runtime.config = dataclasses.replace(
    with_folder, elastic_dir=with_folder.elastic_dir + "-every-4", elastic_persist_every=4
)
every_4th_state = hvd.elastic.TorchState(model, optimizer, step=0)
runtime.config = with_folder
committing = {"memory": memory_state, "two-half": state, "every-4th": every_4th_state,
              "synchronous": state}
data = torch.randn(32, 1024)


def compute():
    optimizer.zero_grad()
    model(data).pow(2).mean().backward()
    optimizer.step()


def idle():
    time.sleep(IDLE_S)
    hvd.allreduce(torch.zeros(1), name="idle")


@hvd.elastic.run
def train(state):
    times = {}
    lags = {}
    for _ in range(2):
        compute()
    for kind, step in (("compute", compute), ("idle", idle)):
        for _ in range(ROUNDS):
            for phase in ("none", *committing):
                hvd.barrier()
                phase_times = times.setdefault(f"{kind}/{phase}", [])
                for _ in range(STEPS):
                    start = time.perf_counter()
                    step()
                    state.step += 1
                    if phase != "none":
                        committing[phase].commit()
                    if phase == "synchronous":
                        state.wait_for_commit()
                    phase_times.append(time.perf_counter() - start)
                    if phase == "two-half" and state._writer is not None:
                        lags.setdefault(kind, []).append(
                            state._commits - state._writer.durable)
                # The phase pays for its last write too: the wait counts in its last step.
                start = time.perf_counter()
                state.wait_for_commit()
                every_4th_state.wait_for_commit()
                phase_times[-1] += time.perf_counter() - start
    return times, lags


times, lags = train(state)
payload = sum(t.numel() * t.element_size() for t in model.state_dict().values())
if hvd.rank() == 0:
    with open(os.environ["RESULTS"], "w") as out:
        json.dump({"step_s": times, "lag_commits": lags, "payload_bytes": payload,
                   "parameters": sum(p.numel() for p in model.parameters())}, out)
"""


def measure(work: pathlib.Path, steps: int, rounds: int, idle_ms: float) -> dict:
    script = work / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    results = work / "results.json"
    args = ["--elastic", "-np", "2", "--checkpoint-dir", str(work / "elastic"),
            sys.executable, str(script)]
    env = {"STEPS": str(steps), "ROUNDS": str(rounds), "IDLE_MS": str(idle_ms),
           "RESULTS": str(results)}
    started = time.monotonic()
    job = jobs.run_launcher(args, work, TIMEOUT_S, env)
    if job.returncode != 0:
        raise RuntimeError(f"the job failed ({job.returncode}):\n{job.stdout}\n{job.stderr}")
    measured = json.loads(results.read_text())
    measured["job_s"] = time.monotonic() - started
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per phase and round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--idle-ms", type=float, default=600.0, help="length of an idle step")
    parser.add_argument("--results", type=pathlib.Path, help="folder for raw.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="elastic-commit-") as work:
        measured = measure(pathlib.Path(work), args.steps, args.rounds, args.idle_ms)
    step_s = measured["step_s"]
    mean_ms = {key: 1000 * statistics.fmean(value) for key, value in step_s.items()}
    median_ms = {key: 1000 * statistics.median(value) for key, value in step_s.items()}
    print(
        f"{measured['parameters'] / 1e6:.1f}M parameters, {measured['payload_bytes'] / 1e6:.0f} "
        f"MB committed, 2 ranks on one host, {args.steps} steps x {args.rounds} rounds a phase"
    )
    print(f"load average {load_before} -> {os.getloadavg()}")
    for kind in KINDS:
        print(f"\n{kind} steps{'' if kind == 'compute' else f' ({args.idle_ms:g} ms sleep)'}")
        print(f"{'phase':<12} {'mean ms':>8} {'median ms':>10} {'x no commit':>12}")
        for phase in PHASES:
            key = f"{kind}/{phase}"
            ratio = mean_ms[key] / mean_ms[f"{kind}/none"]
            print(f"{phase:<12} {mean_ms[key]:>8.0f} {median_ms[key]:>10.0f} {ratio:>12.2f}")
        gain = mean_ms[f"{kind}/synchronous"] / mean_ms[f"{kind}/two-half"]
        print(f"synchronous / two-half: {gain:.2f}x")
        lags = measured["lag_commits"].get(kind, [])
        if lags:
            print(f"two-half: the newest durable commit was {min(lags)}-{max(lags)} commits "
                  f"behind the newest (median {statistics.median(lags):g})")
    print("\n'memory' is what Horovod's commit does (elastic_commit_horovod.py runs it)")
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        record = {
            **measured,
            "mean_ms": mean_ms,
            "median_ms": median_ms,
            "steps": args.steps,
            "rounds": args.rounds,
            "idle_ms": args.idle_ms,
            "host": platform.node(),
            "cpus": _cpus(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (args.results / "raw.json").write_text(json.dumps(record, indent=1) + "\n")


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
