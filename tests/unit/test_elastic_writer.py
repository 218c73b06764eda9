"""The two halves of a persisted commit: the host copy taken by ``submit()``, and the write on
a background thread (one at a time, failures raised by the next call)."""

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
from baguahvd.torch.elastic.writer import CommitWriteError, CommitWriter, HostStaging

WAIT_S = 30.0


class _GatedStore(CheckpointStore):
    """A real store whose writes wait for the test's go, counting the writes in flight."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, host="node-a")
        self.go = threading.Event()
        self.started = threading.Semaphore(0)
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()

    def write(self, number: int, payload: Any) -> str:
        with self._lock:
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


def test_at_most_one_write_is_in_flight(tmp_path: pathlib.Path) -> None:
    store = _GatedStore(str(tmp_path))
    writer = CommitWriter(store)
    writer.submit(1, {"w": torch.zeros(2)})
    assert store.started.acquire(timeout=WAIT_S)
    second = threading.Thread(target=writer.submit, args=(2, {"w": torch.ones(2)}))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # the next commit waits for the unfinished write
    store.go.set()
    second.join(WAIT_S)
    assert not second.is_alive()
    for number in range(3, 8):
        writer.submit(number, {"w": torch.full((2,), float(number))})
    writer.wait()
    assert store.most_in_flight == 1
    assert store.load_newest()[0] == 7


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


def test_the_host_copy_rebuilds_containers_and_keeps_cpu_tensors() -> None:
    weights = torch.arange(4.0)
    payload = {"handlers": {"model": {"w": weights}}, "objects": {"notes": [1, (2, 3)]}}
    staged = HostStaging().stage(payload)
    assert staged.copies == ()
    # A saved copy is fresh at every save: the write may read it as it is.
    assert staged.payload["handlers"]["model"]["w"] is weights
    payload["handlers"]["model"]["w"] = torch.zeros(4)
    payload["objects"]["notes"].append(4)
    assert staged.payload["handlers"]["model"]["w"] is weights
    assert staged.payload["objects"]["notes"] == [1, (2, 3)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_are_copied_into_pinned_buffers_reused_between_commits(
    tmp_path: pathlib.Path,
) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    writer = CommitWriter(store)
    saved = {"w": torch.arange(1 << 20, dtype=torch.float32, device="cuda"), "n": 1}
    writer.submit(1, saved)
    saved["w"].add_(1.0)  # queued after the copy on the same stream: not in commit 1
    writer.wait()
    assert torch.equal(store.read(1)["w"], torch.arange(1 << 20, dtype=torch.float32))
    first = writer._staging._buffers[0]
    assert first.is_pinned()
    writer.submit(2, {"w": saved["w"], "n": 2})
    writer.wait()
    assert writer._staging._buffers[0].data_ptr() == first.data_ptr()
    assert torch.equal(store.read(2)["w"], torch.arange(1 << 20, dtype=torch.float32) + 1)
