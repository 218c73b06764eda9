"""How long an elastic job takes to recover from a rank killed with SIGKILL.

Runs ``baguahvdrun --elastic -np 2`` on a small training loop (a 1.1M-parameter MLP,
commits every 10 steps), kills rank 1 with SIGKILL after the fifth commit, and reports:

* death → launch ended: until ``mpirun`` has ended the failed launch (the launcher's
  "launch 1 failed" line);
* death → training again: until the relaunched job has loaded the last commit, synced it
  and finished its first step;
* the steps redone (those since the last commit) and the commit cost on rank 0.

Run it from the repository root::

    python benchmarks/elastic_recovery.py [--repeats 3]

The job is started, and rank 1 found and killed, by ``tests/support/jobs.py``, the module
the end-to-end tests launch their jobs with.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

# Run as a script, this file has benchmarks/ on sys.path; the job launcher is imported from
# the repository root (see tests/support/jobs.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.support import jobs  # noqa: E402

TIMEOUT_S = 600
"""Bound on the whole job, and on the wait for the commit after which rank 1 is killed."""

_TRAIN = """
import json
import os
import time

import torch

import baguahvd.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
events = os.environ["EVENTS"]
commit_seconds = []


@hvd.elastic.run
def train(state):
    first = True
    while state.step < 400:
        x = torch.randn(64, 512)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        state.step += 1
        if first and hvd.rank() == 0:
            with open(events, "a") as out:
                out.write(json.dumps({"first_step": time.time(), "step": state.step,
                                      "launch": os.environ["BAGUAHVD_ELASTIC_RESTART"]}) + "\\n")
            first = False
        if state.step % 10 == 0:
            start = time.perf_counter()
            state.commit()
            commit_seconds.append(time.perf_counter() - start)
        time.sleep(0.02)


train(state)
if hvd.rank() == 0:
    with open(events, "a") as out:
        out.write(json.dumps({"commit_ms": 1000 * sorted(commit_seconds)[len(commit_seconds) // 2]})
                  + "\\n")
"""


def measure(work: pathlib.Path) -> dict[str, float]:
    script = work / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    events = work / "events.jsonl"
    folder = work / "elastic"
    args = ["--elastic", "-np", "2", "--checkpoint-dir", str(folder), sys.executable, str(script)]
    failed_at: list[float] = []
    with jobs.started_launcher(
        args, work, {"EVENTS": str(events)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as job:

        def watch() -> None:
            assert job.stderr is not None
            for line in job.stderr:
                if "launch 1 failed" in line:
                    failed_at.append(time.time())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        killed_at = jobs.kill_rank_after(job, 1, folder, "commit-5.*.pt", TIMEOUT_S)
        if job.wait(timeout=TIMEOUT_S) != 0:
            raise RuntimeError(f"the elastic job failed with status {job.returncode}")
        watcher.join(timeout=5)
    records = [json.loads(line) for line in events.read_text().splitlines()]
    resumed = next(r for r in records if r.get("launch") == "1")
    commit_ms = next(r["commit_ms"] for r in records if "commit_ms" in r)
    return {
        "death_to_launch_end_s": failed_at[0] - killed_at if failed_at else float("nan"),
        "death_to_training_s": resumed["first_step"] - killed_at,
        "resumed_at_step": resumed["step"] - 1,
        "commit_ms": commit_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="elastic-bench-") as work:
            results.append(measure(pathlib.Path(work)))
        print(
            f"run {repeat + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[-1].items()),
            flush=True,
        )
    for key in results[0]:
        print(f"median {key}: {statistics.median(r[key] for r in results):.2f}")


if __name__ == "__main__":
    main()
