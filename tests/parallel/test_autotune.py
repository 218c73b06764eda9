"""Autotune on a real job: results never change, every rank switches together, rank 0 logs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime

STEPS = 30


def _train(algorithm: str | None = None) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 2),
    )
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), algorithm=algorithm,
    )
    generator = torch.Generator().manual_seed(1000 + hvd.rank())
    for _ in range(STEPS):
        x = torch.randn(16, 10, generator=generator)
        y = torch.randn(16, 2, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], optimizer


def _autotune_env(log: Path) -> dict[str, str]:
    return {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(log),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "3",
        # Small buckets, so that the tuned sizes regroup the gradients.
        "BAGUAHVD_BUCKET_SIZE": "4096",
    }


@contextlib.contextmanager
def _restarted(env: dict[str, str]) -> Iterator[None]:
    """Runs the block under a fresh init() that reads ``env``, then restores the job."""
    hvd.shutdown()
    os.environ.update(env)
    try:
        hvd.init()
        yield
    finally:
        hvd.shutdown()
        for name in env:
            del os.environ[name]
        hvd.init()


def test_autotune_changes_no_result_and_writes_the_log(rank: int, size: int, tmp_path: Path):
    plain, _ = _train()
    log = tmp_path / "autotune.csv"
    with _restarted(_autotune_env(log)):
        tuned, _ = _train()
        changes = list(runtime.require_engine().settings_changes)
        every_rank = hvd.allgather_object(changes)
    assert len(changes) == 3
    assert all(other == changes for other in every_rank)
    for a, b in zip(plain, tuned):
        # Two ranks add in one order whatever the message sizes; with more, MPI's choice
        # of reduction algorithm by size may reassociate the sum.
        if size == 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if rank == 0:
        lines = log.read_text().splitlines()
        assert lines[0].endswith("cycle_time_ms,tensor_fusion_threshold,score")
        assert len(lines) == 1 + 3
    else:
        assert not log.exists()


def test_the_bucket_size_changes_after_the_same_step_everywhere_and_freezes(
    rank: int, size: int, tmp_path: Path
):
    plain, _ = _train("gradient_allreduce")
    log = tmp_path / "autotune.csv"
    with _restarted(_autotune_env(log)):
        tuned, optimizer = _train("gradient_allreduce")
        tuner = optimizer.algorithm_impl.bucket_tuner
        every_rank = hvd.allgather_object(tuner.changes)
        optimizer.close()
    # Engine samples, then one warmup sample and three bucket sizes.
    assert tuner.done
    assert len(tuner.changes) == 3
    assert all(other == tuner.changes for other in every_rank)
    for a, b in zip(plain, tuned):
        if size == 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if rank == 0:
        lines = Path(f"{log}.buckets.csv").read_text().splitlines()
        assert lines[0] == "bucket_size,score,train_iter"
        assert len(lines) == 1 + 3
