"""The bound on how far the newest durable commit falls behind: a commit that finds the
commits owed older than ``max_lag_s`` waits for the write in flight, and one within the
bound never waits. Time is a clock the tests step; a write ends when the test says so."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from baguahvd.common.config import Config
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic.state import TorchState
from baguahvd.torch.elastic.store import CheckpointStore
from baguahvd.torch.elastic.writer import CommitWriter

WAIT_S = 30.0
BOUND_S = 60.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _HeldStore(CheckpointStore):
    """A store whose writes write nothing and end one at a time, when the test releases
    one: a writer that gets no CPU unless the test gives it some."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, host="node-a")
        self.permits = threading.Semaphore(0)
        self.started: list[int] = []
        self.parked = False

    def write(self, number: int, payload: Any) -> str:
        self.started.append(number)
        self.parked = True
        try:
            assert self.permits.acquire(timeout=WAIT_S), "the test never ended this write"
        finally:
            self.parked = False
        return ""


def _settle(writer: CommitWriter, store: _HeldStore) -> None:
    """Waits until the write thread is held in a write, or has ended (nothing due)."""
    deadline = time.monotonic() + WAIT_S
    while writer.busy and not store.parked:
        assert time.monotonic() < deadline, "the write thread neither wrote nor ended"
        time.sleep(0.0005)


class _Training:
    """Commits from a thread of their own, so that the test sees whether one waits."""

    def __init__(self, writer: CommitWriter, store: _HeldStore, clock: _Clock) -> None:
        self.writer, self.store, self.clock = writer, store, clock
        self.made: dict[int, float] = {}

    def commit(self, number: int, write_s: float = 0.0) -> bool:
        """Commits ``number`` at the clock's time; when it waits for the bound, the write
        in flight takes ``write_s`` and ends. Returns whether it waited."""
        self.made[number] = self.clock.now
        waits = self.writer.lag_waits
        call = threading.Thread(target=self.writer.submit, args=(number, {"n": number}))
        call.start()
        deadline = time.monotonic() + WAIT_S
        while call.is_alive() and self.writer.lag_waits == waits:
            assert time.monotonic() < deadline, f"commit {number} neither returned nor waited"
            time.sleep(0.0005)
        waited = self.writer.lag_waits > waits
        if waited:
            assert call.is_alive()  # it waits for the write in flight, and for nothing else
            self.clock.now += write_s
            self.store.permits.release()
        call.join(WAIT_S)
        assert not call.is_alive()
        _settle(self.writer, self.store)
        return waited

    def durable_age(self) -> float:
        """How old the newest durable commit is (since the first commit, before one is)."""
        durable = self.writer.durable
        if not self.made:
            return 0.0
        return self.clock.now - self.made[durable if durable >= 0 else min(self.made)]

    def finish(self) -> None:
        for _ in range(len(self.store.started) + 1):
            self.store.permits.release()
        self.writer.wait()


def _training(tmp_path: pathlib.Path, bound_s: float = BOUND_S) -> _Training:
    clock = _Clock()
    store = _HeldStore(str(tmp_path))
    return _Training(CommitWriter(store, max_lag_s=bound_s, clock=clock), store, clock)


def test_commits_within_the_bound_never_wait(tmp_path: pathlib.Path) -> None:
    training = _training(tmp_path)
    for number in range(1, 22):  # the write of 1 never ends: up to 58 s owed
        assert not training.commit(number)
        training.clock.now += 2.9
    assert training.store.started == [1] and training.writer.durable == -1
    assert training.writer.lag_waits == 0
    training.finish()
    assert training.store.started == [1, 21] and training.writer.durable == 21


def test_a_commit_past_the_bound_waits_for_the_write_in_flight_and_says_so_once(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    training = _training(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert not training.commit(1)  # its write starts, and stays in flight
        training.clock.now = 30.0
        assert not training.commit(2)  # waits in memory: 30 s owed
        training.clock.now = 61.0
        # 61 s since commit 1 was asked for: wait until its write ends, after taking the
        # place of 2 (which is never written).
        assert training.commit(3, write_s=4.0)
        assert training.writer.durable == 1 and training.store.started == [1, 3]
        training.clock.now = 70.0
        assert not training.commit(4)  # 40 s since 2, the oldest commit that 3 covers
        training.clock.now = 91.0
        assert training.commit(5, write_s=4.0)  # 61 s since 2: wait for the write of 3
        assert training.writer.durable == 3 and training.store.started == [1, 3, 5]
    waits = [r for r in caplog.records if "BAGUAHVD_ELASTIC_MAX_LAG_SECONDS" in r.message]
    assert len(waits) == 1 and training.writer.lag_waits == 2
    assert "commit 3 waits for the write of commit 1" in waits[0].message
    training.finish()
    assert training.writer.durable == 5


@pytest.mark.parametrize(("step_s", "write_s"), [(7.0, 5.0), (1.0, 20.0), (25.0, 2.0)])
def test_the_bound_holds_when_the_writer_gets_no_cpu_while_training_runs(
    tmp_path: pathlib.Path, step_s: float, write_s: float
) -> None:
    """The worst case: a write makes progress only while a commit waits for it. Then the
    newest durable commit is never more than the bound, two steps and one write old, and a
    commit waits only when it is more than the bound old."""
    training = _training(tmp_path)
    oldest = 0.0
    for number in range(1, 120):
        training.clock.now += step_s
        age_before = training.durable_age()
        if training.commit(number, write_s):
            assert age_before > BOUND_S
        oldest = max(oldest, age_before, training.durable_age())
    assert training.writer.lag_waits > 0
    assert oldest <= BOUND_S + 2 * step_s + write_s
    training.finish()


def test_commits_kept_in_memory_are_not_owed(tmp_path: pathlib.Path) -> None:
    """Under ``BAGUAHVD_ELASTIC_PERSIST_EVERY`` the folder stays behind by design: only
    commits asked to be written count towards the bound."""
    training = _training(tmp_path)
    training.writer.submit(1, {"n": 1})
    training.store.permits.release()
    training.writer.wait()
    for number in range(2, 10):
        training.clock.now += 100.0
        training.writer.submit(number, {"n": number}, write=False)
    assert training.writer.busy is False
    training.writer.submit(10, {"n": 10})  # asked for now: its write starts
    _settle(training.writer, training.store)
    training.clock.now += 1.0
    assert not training.commit(11, write_s=0.0)  # 1 s owed, though 1 is 901 s old
    training.finish()
    assert training.writer.durable == 11


def _late_commit_while_a_write_ends(
    store: _HeldStore, commit: Callable[[CommitWriter], None]
) -> tuple[CommitWriter, threading.Thread]:
    """Holds the write of commit 1 past the bound, runs ``commit`` (commit 2) on a thread
    until it waits for that write, then lets the write end; returns the writer and the
    thread, joined (within :data:`WAIT_S`)."""
    clock = _Clock()
    writer = CommitWriter(store, max_lag_s=BOUND_S, clock=clock)
    writer.submit(1, {"n": 1})
    _settle(writer, store)
    clock.now = 61.0
    call = threading.Thread(target=commit, args=(writer,))
    call.start()
    deadline = time.monotonic() + WAIT_S
    while writer.lag_waits == 0:
        assert time.monotonic() < deadline, "the late commit never waited for the write"
        time.sleep(0.0005)
    store.permits.release()
    call.join(WAIT_S)
    return writer, call


def test_a_failed_write_ends_the_wait_and_is_raised(tmp_path: pathlib.Path) -> None:
    class _Failing(_HeldStore):
        def write(self, number: int, payload: Any) -> str:
            super().write(number, payload)
            raise OSError(28, "No space left on device")

    raised: list[BaseException] = []

    def submit(writer: CommitWriter) -> None:
        try:
            writer.submit(2, {"n": 2})
        except BaseException as error:  # noqa: BLE001 - checked below
            raised.append(error)

    writer, _ = _late_commit_while_a_write_ends(_Failing(str(tmp_path)), submit)
    assert [type(e).__name__ for e in raised] == ["CommitWriteError"]
    assert "commit 1" in str(raised[0]) and not writer.busy


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_write_ended_by_what_ends_the_thread_ends_the_wait(tmp_path: pathlib.Path) -> None:
    class _Stop(BaseException):
        pass

    class _Stopping(_HeldStore):
        def write(self, number: int, payload: Any) -> str:
            super().write(number, payload)
            raise _Stop

    writer, call = _late_commit_while_a_write_ends(
        _Stopping(str(tmp_path)), lambda writer: writer.submit(2, {"n": 2})
    )
    # The commit returned once the write of 1 was over, though it is not durable.
    assert not call.is_alive() and writer.durable == -1
    for thread in threading.enumerate():  # its end is this test's
        if thread.name == "baguahvd-commit-writer":
            thread.join(WAIT_S)


def test_the_bound_is_a_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    assert Config.from_env({}).elastic_max_lag_s == 60.0
    config = Config.from_env({"BAGUAHVD_ELASTIC_MAX_LAG_SECONDS": "2.5"})
    assert config.elastic_max_lag_s == 2.5
    with pytest.raises(ValueError, match="BAGUAHVD_ELASTIC_MAX_LAG_SECONDS='-1'"):
        Config.from_env({"BAGUAHVD_ELASTIC_MAX_LAG_SECONDS": "-1"})
    base = runtime.config or Config()
    monkeypatch.setattr(runtime, "config", dataclasses.replace(
        base, elastic_max_lag_s=2.5, elastic_dir=str(tmp_path)))
    writer = TorchState(torch.nn.Linear(1, 1))._writer  # the state passes the setting on
    assert writer is not None and writer._max_lag_s == 2.5
    store = CheckpointStore(str(tmp_path), host="node-a")
    assert CommitWriter(store)._max_lag_s == 60.0
    with pytest.raises(ValueError, match="must not be negative"):
        CommitWriter(store, max_lag_s=-1.0)
    assert torch.zeros(1).sum() == 0  # torch stays importable beside the writer
