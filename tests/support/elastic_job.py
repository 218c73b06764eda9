"""The elastic training script of the end-to-end elastic suites, and how to launch it.

A small deterministic model trained under ``baguahvdrun --elastic`` with commits, that can
kill one of its ranks at a given step (``KILL_RANK``, ``KILL_STEP``), kill the rank that
writes the commits while the write of the commit at a given step runs in the background
(``KILL_IN_WRITE_STEP``; ``BALLAST`` adds an untrained buffer of that many floats to the
model, so that writes take a while), or ask for a bigger job (``GROW_AT_STEP``), and saves
its final weights to ``OUT``. Under ``--gloo`` (in-process recovery) faults are injected
in the first round only, and ``KILL_IN_RESET_RANK`` kills that rank, if it started in the
first round, in its reset callback in round ``KILL_IN_RESET_ROUND`` (1 by default), in the
middle of the in-process reset. ``JOIN_AT_COMMIT=N`` makes a round of
fewer than N ranks wait at its next commit (at most a minute) for the launcher's notice that
a process started for a lost slot is ready, so that it joins there; ``EVERY_RANK=1`` saves
every rank's final weights (``OUT.<rank>``). ``DEVICE=cuda`` trains on the GPUs (one per
rank, by local rank). Used by
``tests/e2e/test_elastic.py`` and ``tests/e2e/test_elastic_faults.py``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import torch

from tests.support import jobs

TIMEOUT_S = 240

# 96 samples, 8 per rank per batch, 2 ranks: 6 steps an epoch. Commits every 4 steps and at
# the end of every epoch. Uses only deterministic operations, so two runs agree bit for bit.
TRAIN = """
import os
import signal
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import baguahvd.torch as hvd

# Ranks sharing one GPU over NCCL: a host id per process, before NCCL loads.
if "NCCL_HOSTID" in os.environ:
    os.environ["NCCL_HOSTID"] += "-" + os.environ.get("BAGUAHVD_ELASTIC_WORKER", "0")

EPOCHS, BATCH, COMMIT_EVERY = 3, 8, 4
KILL_RANK = int(os.environ.get("KILL_RANK", "-1"))
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))
GROW_AT_STEP = int(os.environ.get("GROW_AT_STEP", "-1"))
KILL_IN_WRITE_STEP = int(os.environ.get("KILL_IN_WRITE_STEP", "-1"))
JOIN_AT_COMMIT = int(os.environ.get("JOIN_AT_COMMIT", "0"))
BALLAST = int(os.environ.get("BALLAST", "0"))
OUT = os.environ["OUT"]

hvd.init()
launch = int(os.environ.get("BAGUAHVD_ELASTIC_RESTART", "0"))
if os.environ.get("DEVICE") == "cuda":
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
device = torch.device(os.environ.get("DEVICE", "cpu"))


def first_try():  # the first launch, and there the first round (in-process recovery)
    return launch == 0 and os.environ.get("BAGUAHVD_ELASTIC_ROUND", "0") == "0"


torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
x = torch.randn(96, 8, generator=generator)
y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(96, 1, generator=generator)
dataset = TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
if BALLAST:
    model.register_buffer("ballast", torch.zeros(BALLAST))
model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0, sizes=[])


KILL_IN_RESET_RANK = int(os.environ.get("KILL_IN_RESET_RANK", "-1"))
KILL_IN_RESET_ROUND = os.environ.get("KILL_IN_RESET_ROUND", "1")
STARTED_FIRST = first_try()


def scale_lr():
    if (STARTED_FIRST and hvd.rank() == KILL_IN_RESET_RANK
            and os.environ.get("BAGUAHVD_ELASTIC_ROUND") == KILL_IN_RESET_ROUND):
        print(f"killing rank {hvd.rank()} during the reset to round {KILL_IN_RESET_ROUND}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
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
            if first_try() and hvd.rank() == KILL_RANK and state.steps == KILL_STEP:
                print(f"killing rank {hvd.rank()} at step {state.steps}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if first_try() and hvd.rank() == 0 and state.steps == GROW_AT_STEP:
                with open(os.environ["DISCOVERED"], "w") as hosts:
                    hosts.write("localhost:3\\n")
                notice = os.path.join(os.environ["BAGUAHVD_ELASTIC_DIR"], "hosts.json")
                deadline = time.monotonic() + 60
                while not os.path.exists(notice) and time.monotonic() < deadline:
                    time.sleep(0.05)
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(data), target).backward()
            optimizer.step()
            state.steps += 1
            state.sizes.append(hvd.size())
            sampler.record_batch(batch_idx, BATCH)
            if state.steps % COMMIT_EVERY == 0:
                if hvd.size() < JOIN_AT_COMMIT:
                    notice = os.path.join(os.environ["BAGUAHVD_ELASTIC_DIR"], "hosts.json")
                    deadline = time.monotonic() + 60
                    while not os.path.exists(notice) and time.monotonic() < deadline:
                        time.sleep(0.05)
                if first_try() and state.steps == KILL_IN_WRITE_STEP:
                    state.wait_for_commit()  # the commit before the killed write is durable
                state.commit()
                writer = state._writer
                if first_try() and state.steps == KILL_IN_WRITE_STEP and writer and writer.busy:
                    print(f"killing rank {hvd.rank()} during the write of commit "
                          f"{state._commits}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()


train(state)
if hvd.rank() == 0 or os.environ.get("EVERY_RANK"):
    weights = {name: tensor.cpu() for name, tensor in model.state_dict().items()}
    torch.save({"model": weights, "steps": state.steps, "sizes": state.sizes,
                "lr": optimizer.param_groups[0]["lr"]},
               f"{OUT}.{hvd.rank()}" if os.environ.get("EVERY_RANK") else OUT)
print(f"launch {launch}: rank {hvd.rank()} finished after {state.steps} steps", flush=True)
"""


def launch_training(
    args: list[str], tmp_path: pathlib.Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    # A failed job keeps its elastic folder (made in TMPDIR) for a resume: keep it here.
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {"TMPDIR": str(scratch), **(env or {})}
    return jobs.run_launcher([*args, sys.executable, str(script)], tmp_path, TIMEOUT_S, env)


def run_training_ok(
    args: list[str], tmp_path: pathlib.Path, out: pathlib.Path, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    result = launch_training(args, tmp_path, {**(env or {}), "OUT": str(out)})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return torch.load(out, weights_only=False), output
