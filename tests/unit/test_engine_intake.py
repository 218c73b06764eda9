"""Handing requests to the engine thread (``baguahvd.engine.intake`` and the handles of
``baguahvd.engine.requests``): when a waiting caller wakes the engine."""

from __future__ import annotations

import threading
import time

import pytest

from baguahvd.common.exceptions import DuplicateNameError
from baguahvd.engine import intake
from baguahvd.engine.intake import RequestQueue
from baguahvd.engine.messages import OpType, RequestMeta
from baguahvd.engine.requests import Request


def _meta(rank: int, op: OpType = OpType.ALLREDUCE, name: str = "allreduce.w", **fields):
    fields.setdefault("dtype", "float32")
    fields.setdefault("shapes", ((4, 2),))
    return RequestMeta(key=name, name=name, op=op, process_set_id=0, rank=rank, **fields)


def test_a_handle_tells_the_engine_before_it_blocks() -> None:
    told = threading.Event()
    handle = Request(_meta(0), [], None).handle
    handle.wakes = (told,)
    threading.Timer(0.05, handle.complete, args=([],)).start()
    assert handle.wait() == [] and told.is_set()
    # A finished handle does not block, so the engine is not told.
    told.clear()
    assert handle.wait() == [] and not told.is_set()


def test_a_blocking_request_wakes_the_engine_when_its_caller_waits() -> None:
    queue = RequestQueue()
    asynchronous = Request(_meta(0, name="allreduce.a"), [], None)
    queue.put(asynchronous, lambda: None)
    assert queue.wake.is_set() and not queue.flush.is_set()
    queue.take()
    queue.wake.clear()
    blocking = Request(_meta(0, name="allreduce.b"), [], None)
    queue.put(blocking, lambda: None, blocking=True)
    assert not queue.wake.is_set() and not queue.flush.is_set()
    threading.Timer(0.05, blocking.handle.complete, args=([],)).start()
    assert blocking.handle.wait() == []
    # Its caller waited: the burst is over and the cycle starts.
    assert queue.wake.is_set() and queue.flush.is_set()
    assert [r.meta.name for r in queue.take()] == ["allreduce.b"]


def test_unnamed_requests_are_queued_without_holding_a_name() -> None:
    # Their keys are numbered in submission order, so they can never clash: the intake
    # keeps no record of them, while named requests still hold their names.
    queue = RequestQueue()
    for number in range(100):
        key = f"noname.{number}"
        request = Request(_meta(0)._replace(key=key, name=f"allreduce.{key}"), [], None)
        queue.put(request, lambda: None)
    queue.put(Request(_meta(0, name="allreduce.w"), [], None), lambda: None)
    with pytest.raises(DuplicateNameError):
        queue.put(Request(_meta(0, name="allreduce.w"), [], None), lambda: None)
    assert list(queue._inflight) == [(0, "allreduce.w")]
    assert len(queue.take()) == 101


def test_a_burst_is_waited_for_until_it_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "QUIET_S", 0.05)
    queue = RequestQueue()
    queue.put(Request(_meta(0, name="allreduce.a"), [], None), lambda: None)
    start = time.perf_counter()
    queue.let_burst_finish(cycle_time_ms=1000.0)
    assert time.perf_counter() - start >= 0.05


@pytest.mark.parametrize("before", [0, 3])
def test_a_request_that_runs_alone_ends_the_burst(
    monkeypatch: pytest.MonkeyPatch, before: int
) -> None:
    # A gradient bucket (fuse=False) is negotiated as soon as the engine sees it: waiting
    # for more submissions would fuse nothing with it and only delay its transfer.
    monkeypatch.setattr(intake, "QUIET_S", 30.0)
    queue = RequestQueue()
    for index in range(before):
        queue.put(Request(_meta(0, name=f"allreduce.g{index}"), [], None), lambda: None)
    queue.put(Request(_meta(0, name="allreduce.bucket", fuse=False), [], None), lambda: None)
    start = time.perf_counter()
    queue.let_burst_finish(cycle_time_ms=10_000.0)
    assert time.perf_counter() - start < 5.0
    assert len(queue.take()) == before + 1
