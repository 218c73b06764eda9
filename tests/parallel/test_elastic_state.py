"""hvd.elastic: TorchState save/restore/sync/commit, persisted commits, ElasticSampler.

Each rank starts from different values (seeded with its rank); after ``sync()`` every rank
must hold rank 0's, which the test rebuilds locally.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import pytest
import torch

import baguahvd.algorithms as hvd_algorithms
import baguahvd.torch as hvd
from baguahvd.common.exceptions import HostsUpdatedInterrupt
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic.base import CommitWriteError, FinishedJobError
from baguahvd.torch.elastic.store import CheckpointStore


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=generator)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def _state(rank: int, **extra: object) -> hvd.elastic.TorchState:
    model = _model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, optimizer, rank)  # momentum buffers differ per rank
    return hvd.elastic.TorchState(model, optimizer, epoch=rank, notes=[rank], **extra)


def _equal_models(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_sync_takes_rank_zero_values(rank: int, size: int) -> None:
    state = _state(rank)
    state.sync()
    reference = _state(0)
    assert _equal_models(state.model, reference.model)
    assert state.epoch == 0 and state.notes == [0]
    for group in state.optimizer.state_dict()["state"]:
        assert torch.equal(
            state.optimizer.state_dict()["state"][group]["momentum_buffer"],
            reference.optimizer.state_dict()["state"][group]["momentum_buffer"],
        )


def test_restore_returns_to_last_commit(rank: int) -> None:
    state = _state(rank)
    state.sync()
    state.commit()
    committed = {k: v.clone() for k, v in state.model.state_dict().items()}
    _train_step(state.model, state.optimizer, 100 + rank)
    state.epoch += 5
    state.notes.append("changed")
    state.restore()
    assert all(torch.equal(committed[k], v) for k, v in state.model.state_dict().items())
    assert state.epoch == 0 and state.notes == [0]


def test_assigning_a_model_retargets_the_handler(rank: int) -> None:
    state = _state(rank)
    replacement = _model(50)
    state.model = replacement
    assert state.model is replacement
    with torch.no_grad():
        for p in replacement.parameters():
            p.add_(1.0)
    state.restore()  # the assignment saved the replacement as it was then
    assert _equal_models(replacement, _model(50))


def test_sampler_state_is_synced(rank: int, size: int) -> None:
    sampler = hvd.elastic.ElasticSampler(list(range(40)), seed=7)
    sampler.set_epoch(3 + rank)
    sampler.record_batch(0, 2)
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    assert sampler.state_dict() == {"epoch": 3, "processed_num": 2 * size}
    seen = hvd.allgather_object(list(sampler))
    flat = sorted(i for part in seen for i in part)
    assert flat == sorted(_rest_of_epoch(40, 7, 3, 2 * size, size))


def _rest_of_epoch(n: int, seed: int, epoch: int, processed: int, size: int) -> list[int]:
    import random

    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    rest = order[processed:]
    padded = rest + rest[: (-len(rest)) % size]
    return padded


def test_host_update_interrupts_every_rank_at_commit(rank: int) -> None:
    state = _state(rank)
    state.sync()
    if rank == 0:  # rank 0 decides for everybody
        state.on_hosts_updated(1.0, hvd.elastic.state.HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as raised:
        state.commit()
    assert raised.value.skip_sync is True
    state.commit()  # reported once


@pytest.fixture
def elastic_dir() -> Iterator[str]:
    made = tempfile.mkdtemp(prefix="elastic-test-") if hvd.rank() == 0 else None
    folder = hvd.broadcast_object(made, 0, name="elastic_dir")
    previous = runtime.config
    assert previous is not None
    runtime.config = dataclasses.replace(previous, elastic_dir=folder)
    try:
        yield folder
    finally:
        runtime.config = previous
        hvd.barrier()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def test_commit_persists_and_a_new_state_resumes(rank: int, elastic_dir: str) -> None:
    state = _state(rank)
    state.sync()
    for step in range(3):
        _train_step(state.model, state.optimizer, step)
        state.epoch += 1
        state.commit()
    expected = {k: v.clone() for k, v in state.model.state_dict().items()}
    expected_momentum = {
        k: v["momentum_buffer"].clone() for k, v in state.optimizer.state_dict()["state"].items()
    }
    state.wait_for_commit()  # the last write may still be running
    hvd.barrier()
    # A fresh process would build its state from scratch; this one does the same.
    fresh = _state(rank + 10)
    resumed = fresh._resume()
    assert resumed
    fresh.sync()
    assert all(torch.equal(expected[k], v) for k, v in fresh.model.state_dict().items())
    for k, v in fresh.optimizer.state_dict()["state"].items():
        assert torch.equal(v["momentum_buffer"], expected_momentum[k])
    assert fresh.epoch == 3
    assert fresh._commits == 3


def test_run_resumes_and_calls_reset_callbacks(rank: int, elastic_dir: str) -> None:
    state = _state(rank)

    @hvd.elastic.run
    def first(state: hvd.elastic.TorchState) -> None:
        state.epoch = 41
        state.commit()

    first(state)
    calls: list[int] = []
    # A relaunch of the same job resumes even though the first run finished.
    runtime.config = dataclasses.replace(runtime.config, elastic_restart=1)
    fresh = _state(rank + 20)
    fresh.register_reset_callbacks([lambda: calls.append(hvd.size())])

    @hvd.elastic.run
    def second(state: hvd.elastic.TorchState, bonus: int) -> int:
        return state.epoch + bonus

    assert second(fresh, 1) == 42
    assert calls == [hvd.size()]


def test_host_change_without_launcher_resets_in_place(rank: int, size: int) -> None:
    state = _state(rank)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    calls: list[int] = []

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> int:
        calls.append(state.epoch)
        if len(calls) == 1:
            state.epoch = 7
            if hvd.rank() == 0:
                state.on_hosts_updated(2.0, hvd.elastic.state.HostUpdateResult.added)
            state.commit()  # raises HostsUpdatedInterrupt on every rank
        return hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after_reset").item()

    assert train(state) == size
    assert calls == [0, 7] and resets == [size]
    assert hvd.is_initialized()


def test_commit_pauses_background_averaging(rank: int) -> None:
    model = _model(rank)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        algorithm=hvd_algorithms.AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=0),
    )
    state = hvd.elastic.TorchState(model, optimizer)
    for step in range(3):
        _train_step(model, optimizer, step)
    impl = optimizer.algorithm_impl
    assert impl.running
    stops: list[bool] = []
    real_abort = impl.abort

    def watched_abort() -> None:
        real_abort()
        stops.append(impl.running)

    impl.abort = watched_abort
    state.commit()
    assert stops == [False]  # the copy was taken with averaging stopped
    assert impl.running  # and averaging goes on afterwards
    impl.abort = real_abort
    impl.abort()


def test_a_second_run_of_the_same_state_continues_from_memory(rank: int, elastic_dir: str) -> None:
    state = _state(rank)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState, epochs: int) -> int:
        state.epoch += epochs
        state.commit()
        state.epoch += 100  # after the last commit: kept in memory, not on disk
        return state.epoch

    assert train(state, 1) == 101
    # Another call in the same process does not go back to the folder's commit.
    assert train(state, 1) == 202


def _finished_run(rank: int) -> hvd.elastic.TorchState:
    state = _state(rank)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        state.epoch = 41
        state.commit()

    train(state)
    hvd.barrier()
    return state


def test_a_new_run_on_a_finished_job_starts_afresh(rank: int, elastic_dir: str) -> None:
    _finished_run(rank)
    assert os.path.exists(os.path.join(elastic_dir, "finished.json"))
    assert os.path.exists(os.path.join(elastic_dir, "training.started"))
    with open(os.path.join(elastic_dir, "job.json")) as stream:
        old_job = json.load(stream)["job_id"]
    hvd.barrier()
    fresh = _state(rank + 20)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> int:
        return state.epoch

    assert train(fresh) == 20  # rank 0's initial value, not the finished job's 41
    hvd.barrier()
    # A new job: the finished one's commits are gone, and the new one finished in turn.
    with open(os.path.join(elastic_dir, "finished.json")) as stream:
        finished = json.load(stream)
    assert finished["job_id"] != old_job and finished["commit"] == 0
    assert not [name for name in os.listdir(elastic_dir) if name.startswith("commit-")]


@pytest.mark.parametrize("policy", ["resume", "refuse"])
def test_the_finished_job_switch(rank: int, elastic_dir: str, policy: str) -> None:
    _finished_run(rank)
    runtime.config = dataclasses.replace(runtime.config, elastic_finished=policy)
    fresh = _state(rank + 20)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> int:
        return state.epoch

    if policy == "resume":
        assert train(fresh) == 41
    else:
        with pytest.raises(FinishedJobError, match="finished training"):
            train(fresh)


def _gate_writes(state: hvd.elastic.TorchState) -> threading.Event:
    """Holds the state's background writes until the returned event is set."""
    store = state._store
    assert store is not None
    real_write = store.write
    go = threading.Event()

    def gated(number: int, payload: object) -> str:
        assert go.wait(60)
        return real_write(number, payload)

    store.write = gated  # type: ignore[method-assign]
    return go


def _newest_on_disk(folder: str) -> int:
    return CheckpointStore(folder, host="reader").newest()


def test_a_commit_holds_the_state_at_commit_time(rank: int, elastic_dir: str) -> None:
    state = _state(rank)
    state.sync()
    committed = {k: v.clone() for k, v in state.model.state_dict().items()}
    go = _gate_writes(state)
    state.commit()  # returns with the write held back
    with torch.no_grad():
        for parameter in state.model.parameters():
            parameter.add_(1.0)
    state.notes.append("after the commit")
    go.set()
    state.wait_for_commit()
    hvd.barrier()
    payload = CheckpointStore(elastic_dir, host="reader").read(1)
    for name, tensor in payload["handlers"]["model"].items():
        assert torch.equal(tensor, committed[name]), name
    assert payload["objects"]["notes"] == [0]


def test_every_kth_commit_is_persisted(rank: int, elastic_dir: str) -> None:
    runtime.config = dataclasses.replace(runtime.config, elastic_persist_every=3)
    state = _state(rank)
    seen = []
    for _ in range(7):
        state.epoch += 1
        state.commit()
        if state._writer is not None:
            state._writer.wait()
        hvd.barrier()
        seen.append(_newest_on_disk(elastic_dir))
    assert seen == [-1, -1, 3, 3, 3, 6, 6]
    state.wait_for_commit()  # the last commit, kept in memory, is written on demand
    hvd.barrier()
    number, payload = CheckpointStore(elastic_dir, host="reader").load_newest()
    assert number == 7 and payload["objects"]["epoch"] == 7


def test_a_failed_write_fails_the_end_of_the_training_function(
    rank: int, elastic_dir: str
) -> None:
    state = _state(rank)
    store = state._store
    assert store is not None

    def full_disk(number: int, payload: object) -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    store.write = full_disk  # type: ignore[method-assign]

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        state.epoch = 41
        state.commit()

    if hvd.local_rank() == 0:  # the rank that writes this host's commits
        with pytest.raises(CommitWriteError, match="background write of commit 1"):
            train(state)
    else:
        train(state)
    hvd.barrier()
    assert _newest_on_disk(elastic_dir) == -1
    assert not os.path.exists(os.path.join(elastic_dir, "finished.json"))
