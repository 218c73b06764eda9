"""The two halves of a persisted commit: the commit kept by ``submit()``, and the write on a
background thread (one at a time, the newest commit next, failures raised by the next
call)."""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import threading
import time
from typing import Any

import pytest
import torch

from baguahvd.torch.elastic.store import CheckpointStore
from baguahvd.torch.elastic.writer import CommitWriteError, CommitWriter, PendingCommit

WAIT_S = 30.0


class _GatedStore(CheckpointStore):
    """A real store whose writes wait for the test's go, counting the writes in flight."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, host="node-a")
        self.go = threading.Event()
        self.started = threading.Semaphore(0)
        self.in_flight = 0
        self.most_in_flight = 0
        self.written: list[int] = []
        self.priorities: list[int | None] = []
        self._lock = threading.Lock()

    def write(self, number: int, payload: Any) -> str:
        with self._lock:
            self.written.append(number)
            self.priorities.append(_priority())
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.started.release()
        try:
            assert self.go.wait(WAIT_S)
            return super().write(number, payload)
        finally:
            with self._lock:
                self.in_flight -= 1


def test_submit_returns_while_the_write_runs(tmp_path: pathlib.Path) -> None:
    store = _GatedStore(str(tmp_path))
    writer = CommitWriter(store)
    writer.submit(1, {"w": torch.ones(3)})
    assert store.started.acquire(timeout=WAIT_S)
    assert writer.busy and store.newest() == -1  # nothing counts before it is durable
    store.go.set()
    writer.wait()
    assert not writer.busy and writer.durable == 1
    number, payload = store.load_newest()
    assert number == 1 and torch.equal(payload["w"], torch.ones(3))


def _priority() -> int | None:
    if not hasattr(os, "getpriority") or not hasattr(threading, "get_native_id"):
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _commit_files(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "job.json")


def test_commits_made_during_a_write_wait_in_memory_and_only_the_newest_is_written(
    tmp_path: pathlib.Path,
) -> None:
    store = _GatedStore(str(tmp_path))
    writer = CommitWriter(store)
    writer.submit(1, {"w": torch.zeros(2)})
    assert store.started.acquire(timeout=WAIT_S)
    for number in range(2, 8):  # none of these waits for the write in flight
        writer.submit(number, {"w": torch.full((2,), float(number))})
    assert writer.durable == -1 and store.written == [1]
    assert _commit_files(tmp_path) == []  # nothing of a write in flight is listed
    store.go.set()
    writer.wait()
    # 2 to 6 were superseded before the writer took them: never written, not even in part.
    assert store.written == [1, 7] and store.most_in_flight == 1
    assert writer.durable == 7 and not writer.busy
    assert _commit_files(tmp_path) == [
        f"commit-{n}.node-a.{k}" for n in (1, 7) for k in ("json", "pt")
    ]
    number, payload = store.load_newest()
    assert number == 7 and torch.equal(payload["w"], torch.full((2,), 7.0))


def test_the_write_thread_runs_at_a_low_priority(tmp_path: pathlib.Path) -> None:
    before = _priority()
    if before is None:
        pytest.skip("threads have no scheduling priority of their own here")
    store = _GatedStore(str(tmp_path))
    store.go.set()
    writer = CommitWriter(store)
    writer.submit(1, {"w": torch.zeros(2)})
    writer.wait()
    assert store.priorities == [max(19, before)]  # a nicer process keeps its own
    assert _priority() == before  # the caller's is left alone


def test_a_commit_kept_in_memory_is_written_by_flush_or_in_place_of_an_older_one(
    tmp_path: pathlib.Path,
) -> None:
    store = _GatedStore(str(tmp_path))
    store.go.set()
    writer = CommitWriter(store)
    writer.submit(1, {"w": torch.zeros(2)}, write=False)
    writer.submit(2, {"w": torch.ones(2)}, write=False)
    writer.wait()  # waits for due writes only
    assert not writer.busy and store.written == []
    writer.flush()
    assert store.written == [2] and writer.durable == 2
    store.go.clear()
    writer.submit(3, {"w": torch.zeros(2)})
    assert store.started.acquire(timeout=WAIT_S) and store.started.acquire(timeout=WAIT_S)
    writer.submit(4, {"w": torch.zeros(2)})  # due, behind the write of 3
    writer.submit(5, {"w": torch.full((2,), 5.0)}, write=False)  # supersedes 4, in its place
    store.go.set()
    writer.wait()
    assert store.written == [2, 3, 5] and store.load_newest()[0] == 5


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def write(descriptor: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("surfaced_by", ["submit", "wait"])
def test_a_failed_write_is_logged_at_once_and_raised_by_the_next_call(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    surfaced_by: str,
) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    writer = CommitWriter(store)
    writer.submit(1, {"w": torch.zeros(2)})
    writer.wait()
    before = sorted(p.name for p in tmp_path.iterdir())
    _full_disk(monkeypatch)
    with caplog.at_level(logging.ERROR):
        writer.submit(2, {"w": torch.ones(2)})  # the failure is not this call's
        while writer.busy:
            time.sleep(0.01)
    assert "background write of commit 2" in caplog.text
    monkeypatch.undo()
    with pytest.raises(CommitWriteError, match="commit 2") as raised:
        if surfaced_by == "submit":
            writer.submit(3, {"w": torch.full((2,), 3.0)})
        else:
            writer.wait()
    message = str(raised.value)
    assert str(tmp_path) in message and "No space left" in message
    assert "commit 1 is the newest this process made durable" in message
    assert isinstance(raised.value.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert store.load_newest()[0] == 1  # a restart resumes from the last durable commit
    writer.submit(3, {"w": torch.full((2,), 3.0)})  # reported once; commits go on
    writer.wait()
    assert store.load_newest()[0] == 3


def test_a_commit_rebuilds_containers_and_keeps_cpu_tensors() -> None:
    weights = torch.arange(4.0)
    payload: dict[str, Any] = {
        "handlers": {"model": {"w": weights}},
        "objects": {"notes": [1, (2, 3)]},
    }
    commit = PendingCommit.take(1, payload)
    assert commit.ready == ()
    # A saved copy is fresh at every save: the write may read it as it is.
    assert commit.payload["handlers"]["model"]["w"] is weights
    payload["handlers"]["model"]["w"] = torch.zeros(4)
    payload["objects"]["notes"].append(4)
    assert commit.payload["handlers"]["model"]["w"] is weights
    assert commit.payload["objects"]["notes"] == [1, (2, 3)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_are_copied_into_pinned_buffers_reused_between_writes(
    tmp_path: pathlib.Path,
) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    writer = CommitWriter(store)
    expected = torch.arange(1 << 20, dtype=torch.float32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # the commit's tensor is made long after submit()
        made = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        writer.submit(1, {"w": made, "n": 1})
    writer.wait()
    assert torch.equal(store.read(1)["w"], expected)
    first = writer._staging._buffers[0]
    assert first.is_pinned()
    writer.submit(2, {"w": made + 1, "n": 2})  # a fresh saved copy, as save() makes
    writer.wait()
    assert writer._staging._buffers[0].data_ptr() == first.data_ptr()
    assert torch.equal(store.read(2)["w"], expected + 1)
