"""Device units launched without waiting (``baguahvd.engine.execution.completion``): they
complete in launch order, and those launched in two parts (the communication, then, once
the host has seen it finish without error, what writes the users' outputs) complete after
their second part."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from baguahvd.backends.base import Pending, Started
from baguahvd.common.exceptions import ShutDownError
from baguahvd.engine.execution.completion import (
    CollectiveFailure,
    Completions,
    HostLaunched,
    Outcome,
)
from baguahvd.engine.messages import OpType, RequestMeta, build_response
from baguahvd.engine.requests import Request


def _meta(rank: int, op: OpType = OpType.ALLREDUCE, name: str = "allreduce.w", **fields):
    fields.setdefault("dtype", "float32")
    fields.setdefault("shapes", ((4, 2),))
    return RequestMeta(key=name, name=name, op=op, process_set_id=0, rank=rank, **fields)


class _Device:
    """A device communicator whose launched units finish when the test says so."""

    def __init__(self) -> None:
        self.fired: set[str] = set()
        self.failure: Exception | None = None
        self.aborted: list[str] = []

    def finished(self, launched: str) -> bool:
        if self.failure is not None:
            raise self.failure
        return launched in self.fired

    def wait(self, launched: str) -> None:
        self.fired.add(launched)

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


class _Order(list):
    """A timeline stand-in that lists the names of the requests as they complete."""

    active = True

    def done(self, name: str, args: object = None) -> None:
        self.append(name)


def _launched(completions: Completions, comm: _Device, name: str) -> Request:
    request = Request(_meta(0, name=name), [torch.ones(1)], None)
    response = build_response([request.meta], (0, 1), ())
    completions.add(comm, name, [(response, request)], [Outcome(request, [])])
    return request


def _completions() -> tuple[Completions, _Order]:
    order = _Order()
    return Completions(order), order  # type: ignore[arg-type]


def test_launched_units_complete_in_launch_order_across_communicators() -> None:
    completions, order = _completions()
    first, second = _Device(), _Device()
    _launched(completions, first, "a")
    _launched(completions, second, "b")
    second.fired.add("b")
    completions.poll()
    assert order == [] and len(completions) == 2
    first.fired.add("a")
    completions.poll()
    assert order == ["a", "b"] and len(completions) == 0


def test_a_launched_unit_that_fails_names_its_unit() -> None:
    completions, order = _completions()
    comm = _Device()
    request = _launched(completions, comm, "a")
    comm.failure = RuntimeError("NCCL timeout")
    with pytest.raises(CollectiveFailure, match="NCCL timeout") as info:
        completions.poll()
    assert info.value.unit[0][1] is request


def test_waiting_for_the_next_cycle_completes_units_that_finish_meanwhile() -> None:
    completions, order = _completions()
    comm = _Device()
    _launched(completions, comm, "a")
    threading.Timer(0.01, lambda: comm.fired.add("a")).start()
    completions.wait(threading.Event(), 2.0)
    assert order == ["a"]


def test_abandoned_units_abort_their_communicator_and_fail_their_handles() -> None:
    completions, order = _completions()
    comm = _Device()
    requests = [_launched(completions, comm, name) for name in "ab"]
    completions.abandon(ShutDownError())
    assert len(comm.aborted) == 1 and order == []
    for request in requests:
        with pytest.raises(ShutDownError):
            request.handle.wait()


class Log(list):
    """What happened, in order; stands in for the timeline, which notes each completed
    request as ``<name>.done``."""

    active = True

    def done(self, name: str, args: object = None) -> None:
        self.append(f"{name}.done")


def started() -> tuple[Completions, Device, Log]:
    log = Log()
    return Completions(log), Device(), log  # type: ignore[arg-type]


class Device:
    """A device communicator whose launched parts finish when the test says so."""

    def __init__(self) -> None:
        self.fired: set[str] = set()
        self.failure: Exception | None = None
        self.checked: list[str] = []

    def finished(self, launched: str) -> bool:
        return launched in self.fired

    def wait(self, launched: str) -> None:
        self.fired.add(launched)

    def check_succeeded(self, launched: str) -> None:
        self.checked.append(launched)
        if self.failure is not None:
            raise self.failure

    def abort(self, reason: str) -> None:
        pass


def two_parts(completions: Completions, comm: Device, name: str,
              log: list[str]) -> Request:
    meta = RequestMeta(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0, rank=0,
                       dtype="float32", shapes=((1,),), device="GPU")
    request = Request(meta, [torch.ones(1)], None)

    def then() -> str:
        log.append(f"{name}.rest")
        return f"{name}.rest"

    completions.add(comm, name, [(build_response([meta], (0, 1), ()), request)],
                    [Outcome(request, [])], then)
    return request


def test_the_rest_is_launched_once_the_first_part_finished_and_completes_after_it() -> None:
    completions, comm, log = started()
    two_parts(completions, comm, "a", log)
    assert not completions.poll()
    assert log == []
    comm.fired.add("a")
    assert completions.poll()  # launched the rest: worth polling again soon
    assert log == ["a.rest"] and comm.checked == ["a"]
    assert not completions.poll()
    assert log == ["a.rest"]  # the rest has not finished
    comm.fired.add("a.rest")
    assert not completions.poll()
    assert log == ["a.rest", "a.done"] and len(completions) == 0


def test_later_units_go_on_while_an_earlier_one_still_runs() -> None:
    completions, comm, log = started()
    for name in "abc":
        two_parts(completions, comm, name, log)
    comm.fired.update({"a", "b"})
    completions.poll()
    assert log == ["a.rest", "b.rest"]
    comm.fired.update({"b.rest", "c", "c.rest"})
    completions.poll()
    # c's rest is launched; nothing completes before a.
    assert log == ["a.rest", "b.rest", "c.rest"]
    comm.fired.add("a.rest")
    completions.poll()
    assert log == ["a.rest", "b.rest", "c.rest", "a.done", "b.done", "c.done"]


def test_draining_launches_and_waits_for_the_rest() -> None:
    completions, comm, log = started()
    two_parts(completions, comm, "a", log)
    completions.drain()
    assert log == ["a.rest", "a.done"]


def test_an_error_seen_after_the_first_part_stops_the_rest() -> None:
    completions, comm, log = started()
    request = two_parts(completions, comm, "a", log)
    comm.fired.add("a")
    comm.failure = RuntimeError("NCCL_ERROR_6")
    with pytest.raises(CollectiveFailure, match="NCCL_ERROR_6") as info:
        completions.poll()
    assert info.value.unit[0][1] is request
    assert log == []


class _EndsWhenTold:
    """A transport's operation that ends when the test says so, and tells the callbacks
    given to :meth:`notify` where ``tells``."""

    def __init__(self, tells: bool) -> None:
        self.tells = tells
        self.tests = 0
        self.ended = False
        self.callbacks: list[Callable[[], object]] = []

    def test(self) -> bool:
        self.tests += 1
        return self.ended

    def notify(self, callback: Callable[[], object]) -> bool:
        if not self.tells:
            return False
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback()


class _HostAllreduce(_EndsWhenTold, Started):
    """A host transport's started allreduce."""

    def wait(self) -> None:
        self.ended = True


def _host_unit(completions: Completions, tells: bool) -> tuple[_HostAllreduce, Request]:
    """A host unit of one request, launched and added to ``completions``."""
    started = _HostAllreduce(tells)
    request = Request(_meta(0, name="bucket"), [torch.ones(1)], None)
    response = build_response([request.meta], (0, 1), ())
    completions.add(completions.host, HostLaunched((started,)), [(response, request)],
                    [Outcome(request, [])])
    return started, request


@pytest.mark.parametrize("tells", [True, False])
def test_a_host_unit_that_tells_when_it_ends_is_not_polled(tells: bool) -> None:
    # The engine waits for its next cycle in Completions.wait; a host unit whose transport
    # tells when it ends wakes it then, instead of being polled every millisecond.
    completions, order = _completions()
    wake = threading.Event()
    completions.woken = wake
    started, request = _host_unit(completions, tells)
    timer = threading.Timer(0.2, started.end)
    timer.start()
    begin = time.monotonic()
    completions.wait(wake, 0.6 if tells else 0.4)
    timer.join()
    if tells:
        assert wake.is_set() and time.monotonic() - begin < 0.5
        assert request.handle.done() and order == ["bucket"]
        assert started.tests <= 3
    else:
        # Polled (the first unit's polls double up to a millisecond): found all the same.
        assert request.handle.done() and order == ["bucket"]
        assert started.tests > 20


class _And(_EndsWhenTold, Pending):
    """A cycle's bitwise AND."""

    def result(self) -> np.ndarray:
        return np.zeros(1, dtype=np.uint8)


@pytest.mark.parametrize("tells", [True, False])
def test_a_unit_that_ends_during_the_and_completes_before_the_and_does(tells: bool) -> None:
    # Over a slow link a cycle's AND waits behind the units' bytes: a unit that ends
    # meanwhile completes at once. Where the AND and the units tell when they end, the
    # engine thread sleeps until one does instead of testing every 0.1 ms.
    completions, order = _completions()
    completions.woken = threading.Event()
    started, request = _host_unit(completions, tells)
    pending = _And(tells)
    seen_at_and_end: list[bool] = []

    def end_and() -> None:
        seen_at_and_end.append(request.handle.done())
        pending.end()

    timers = [threading.Timer(0.1, started.end), threading.Timer(0.3, end_and)]
    for timer in timers:
        timer.start()
    checks: list[float] = []
    completions.through(pending, lambda: checks.append(time.monotonic()))
    for timer in timers:
        timer.join()
    assert seen_at_and_end == [True] and order == ["bucket"]
    if tells:
        # The first 50 us spin (SPIN_S), then a test per wake-up.
        assert pending.tests < 200 and started.tests < 40
    else:
        assert pending.tests > 1000


def test_waiting_through_an_and_gives_up_when_told_to() -> None:
    completions, _ = _completions()
    pending = _And(tells=True)

    class Stop(Exception):
        pass

    def check() -> None:
        raise Stop

    begin = time.monotonic()
    with pytest.raises(Stop):
        completions.through(pending, check)
    assert time.monotonic() - begin < 0.2  # within a wait of TOLD_WAIT_S
