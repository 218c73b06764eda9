"""What ``state.commit()`` costs a training step under ``baguahvdrun --elastic``.

One job, two ranks, a 25.2M-parameter MLP (100 MB of float32 weights, plain SGD so the
optimizer adds no state), one commit after every step. The job runs these phases in turn,
each for ``--steps`` steps, ``--rounds`` times, and rank 0 times every step:

* ``none``: no commit;
* ``memory``: ``commit()`` of a state built without an elastic folder: the in-memory copy
  and the host-change check, which is all that Horovod's ``commit()`` does;
* ``two-half``: ``commit()`` with the folder: the in-memory copy, then the write (torch.save,
  SHA-256, fsync, read back and checked) on a background thread;
* ``synchronous``: ``commit()`` then ``state.wait_for_commit()``: every step waits for
  its write, as every commit did before writes moved to the background.

Horovod itself is not measured: it does not install with this torch (2.13); the ``memory``
phase stands for its commit. Run it from the repository root::

    python benchmarks/elastic_commit.py [--steps 6] [--rounds 2] [--results DIR]

The job is started by ``tests/support/jobs.py``, the module the end-to-end tests launch
their jobs with; ``--results`` writes the raw step times there (``raw.json``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
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

PHASES = ("none", "memory", "two-half", "synchronous")

_TRAIN = """
import dataclasses
import json
import os
import time

import torch

import baguahvd.torch as hvd
from baguahvd.runtime.state import runtime

STEPS, ROUNDS = int(os.environ["STEPS"]), int(os.environ["ROUNDS"])
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1024))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
# The same model and optimizer in a state without an elastic folder: in-memory commits.
with_folder = runtime.config
runtime.config = dataclasses.replace(with_folder, elastic_dir=None)
memory_state = hvd.elastic.TorchState(model, optimizer, step=0)
runtime.config = with_folder
data = torch.randn(32, 1024)


def step():
    optimizer.zero_grad()
    model(data).pow(2).mean().backward()
    optimizer.step()


@hvd.elastic.run
def train(state):
    times = {"none": [], "memory": [], "two-half": [], "synchronous": []}
    for _ in range(2):
        step()
    for _ in range(ROUNDS):
        for phase, times_of_phase in times.items():
            state.wait_for_commit()
            hvd.barrier()
            for _ in range(STEPS):
                start = time.perf_counter()
                step()
                state.step += 1
                if phase == "memory":
                    memory_state.commit()
                elif phase != "none":
                    state.commit()
                    if phase == "synchronous":
                        state.wait_for_commit()
                times_of_phase.append(time.perf_counter() - start)
    return times


times = train(state)
payload = sum(t.numel() * t.element_size() for t in model.state_dict().values())
if hvd.rank() == 0:
    with open(os.environ["RESULTS"], "w") as out:
        json.dump({"step_s": times, "payload_bytes": payload,
                   "parameters": sum(p.numel() for p in model.parameters())}, out)
"""


def measure(work: pathlib.Path, steps: int, rounds: int) -> dict:
    script = work / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    results = work / "results.json"
    args = ["--elastic", "-np", "2", "--checkpoint-dir", str(work / "elastic"),
            sys.executable, str(script)]
    env = {"STEPS": str(steps), "ROUNDS": str(rounds), "RESULTS": str(results)}
    started = time.monotonic()
    job = jobs.run_launcher(args, work, TIMEOUT_S, env)
    if job.returncode != 0:
        raise RuntimeError(f"the job failed ({job.returncode}):\n{job.stdout}\n{job.stderr}")
    measured = json.loads(results.read_text())
    measured["job_s"] = time.monotonic() - started
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per phase and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=pathlib.Path, help="folder for raw.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elastic-commit-") as work:
        measured = measure(pathlib.Path(work), args.steps, args.rounds)
    step_s = measured["step_s"]
    mean_ms = {phase: 1000 * statistics.fmean(step_s[phase]) for phase in PHASES}
    median_ms = {phase: 1000 * statistics.median(step_s[phase]) for phase in PHASES}
    print(
        f"{measured['parameters'] / 1e6:.1f}M parameters, {measured['payload_bytes'] / 1e6:.0f} "
        f"MB committed, 2 ranks on one host, {args.steps} steps x {args.rounds} rounds a phase"
    )
    print(f"{'phase':<12} {'mean ms':>8} {'median ms':>10} {'x no commit':>12}")
    for phase in PHASES:
        ratio = mean_ms[phase] / mean_ms["none"]
        print(f"{phase:<12} {mean_ms[phase]:>8.0f} {median_ms[phase]:>10.0f} {ratio:>12.2f}")
    print(
        f"synchronous / two-half: {mean_ms['synchronous'] / mean_ms['two-half']:.2f}x; "
        "Horovod: not measured (it does not install with torch "
        f"{_torch_version()}); 'memory' is what its commit does"
    )
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        record = {
            **measured,
            "mean_ms": mean_ms,
            "median_ms": median_ms,
            "steps": args.steps,
            "rounds": args.rounds,
            "host": platform.node(),
            "cpus": _cpus(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (args.results / "raw.json").write_text(json.dumps(record, indent=1) + "\n")


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
