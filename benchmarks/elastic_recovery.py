"""How long an elastic job takes to recover from a rank killed with SIGKILL: restarting
every rank against recovering in place.

Runs the same training loop (a 1.1M-parameter MLP, ``--commit-every`` steps between
commits) as ``baguahvdrun --elastic -np 2`` (restart-based: mpirun's job ends and is
launched again, resuming from the last commit in the folder) and as ``baguahvdrun --gloo
--elastic -np 2 --min-np 1`` (in-process: rank 0 keeps running, restores its last in-memory
commit and goes on alone in a round of one rank; the process started in rank 1's place
joins it at the first commit after that process is ready; ``--in-process-min-np 2`` makes
rank 0 wait for it instead). Rank 1 is killed with SIGKILL ``--kill-delay`` seconds after
the fifth commit is on disk; rank 0 logs every completed step. Reported per run:

* kill → next step: from the SIGKILL until rank 0 completes its first step after
  recovering (the relaunched job's rank 0 for the restart-based path);
* kill → two ranks: from the SIGKILL until rank 0 completes its first step with two ranks
  again (the same as the above where recovery waits for the new rank);
* join pause: for a rank that joins at a commit, the time between rank 0's last step
  alone and its first step with the new rank (the cost of the join to the survivor);
* steps redone: the steps rank 0 had completed since the commit it recovered from;
* commit: the median ``state.commit()`` time on rank 0.

Run it from the repository root::

    python benchmarks/elastic_recovery.py [--repeats 3] [--mode both] [--results DIR]

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
commit_every = int(os.environ["COMMIT_EVERY"])
commit_seconds = []


def attempt():
    return (os.environ.get("BAGUAHVD_ELASTIC_RESTART", "0") + "."
            + os.environ.get("BAGUAHVD_ELASTIC_ROUND", "0"))


@hvd.elastic.run
def train(state):
    while state.step < 400:
        x = torch.randn(64, 512)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        state.step += 1
        if hvd.rank() == 0:
            with open(events, "a") as out:
                out.write(json.dumps({"time": time.time(), "step": state.step,
                                      "attempt": attempt(), "size": hvd.size()}) + "\\n")
        if state.step % commit_every == 0:
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

MODES = {
    "restart": (["--elastic"], "OMPI_COMM_WORLD_RANK"),
    "in-process": (["--gloo", "--elastic"], "RANK"),
}
"""The launcher flags of each recovery path, and the variable that names a rank's process."""


def measure(
    work: pathlib.Path, mode: str, commit_every: int, kill_delay: float, min_np: int
) -> dict[str, float]:
    script = work / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    events = work / "events.jsonl"
    folder = work / "elastic"
    flags, rank_variable = MODES[mode]
    if mode == "in-process":
        flags = [*flags, "--min-np", str(min_np)]
    args = [*flags, "-np", "2", "--checkpoint-dir", str(folder), sys.executable, str(script)]
    env = {"EVENTS": str(events), "COMMIT_EVERY": str(commit_every)}
    with jobs.started_launcher(args, work, env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL) as job:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(folder.glob("commit-5.*.pt")) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(kill_delay)  # into the steps after the commit, which are then redone
        killed_at = jobs.kill_rank_after(
            job, 1, folder, "commit-5.*.pt", TIMEOUT_S, rank_variable=rank_variable
        )
        if job.wait(timeout=TIMEOUT_S) != 0:
            raise RuntimeError(f"the elastic job failed with status {job.returncode}")
    records = [json.loads(line) for line in events.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    before = [r for r in steps if r["time"] <= killed_at]
    first_try = before[-1]["attempt"]
    later = [r for r in steps if r["time"] > killed_at and r["attempt"] != first_try]
    after = later[0]
    whole = next(r for r in later if r["size"] == 2)
    previous = steps[steps.index(whole) - 1]
    commit_ms = next(r["commit_ms"] for r in records if "commit_ms" in r)
    return {
        "kill_to_next_step_s": after["time"] - killed_at,
        "kill_to_two_ranks_s": whole["time"] - killed_at,
        "join_pause_s": whole["time"] - previous["time"] if whole is not after else 0.0,
        "steps_redone": before[-1]["step"] - (after["step"] - 1),
        "resumed_at_step": after["step"] - 1,
        "commit_ms": commit_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--kill-delay", type=float, default=0.2,
                        help="seconds from the fifth commit on disk to the kill")
    parser.add_argument("--in-process-min-np", type=int, default=1,
                        help="--min-np of the in-process job: 1 lets rank 0 go on alone "
                        "while the new rank starts, 2 makes it wait")
    parser.add_argument("--results", type=pathlib.Path, default=None,
                        help="folder for raw.json (every run's figures)")
    args = parser.parse_args()
    modes = list(MODES) if args.mode == "both" else [args.mode]
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    # Alternate the paths, so that a change in the machine's load hits both alike.
    for repeat in range(args.repeats):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="elastic-bench-") as work:
                figures = measure(pathlib.Path(work), mode, args.commit_every,
                                  args.kill_delay, args.in_process_min_np)
            results[mode].append(figures)
            print(
                f"{mode} run {repeat + 1}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
                flush=True,
            )
    for mode, runs in results.items():
        for key in runs[0]:
            print(f"{mode} median {key}: {statistics.median(r[key] for r in runs):.2f}")
    if len(modes) == 2:
        ratio = statistics.median(
            r["kill_to_next_step_s"] for r in results["in-process"]
        ) / statistics.median(r["kill_to_next_step_s"] for r in results["restart"])
        print(f"in-process / restart, median kill to next step: {ratio:.2f}")
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "raw.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
