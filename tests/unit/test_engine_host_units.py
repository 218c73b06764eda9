"""Allreduces of CPU tensors on a transport whose own threads carry them
(``Communicator.launches_allreduce``, gloo's): the dispatcher starts them and goes on; the
scaling after them, the copy out of the fusion buffer and the handles wait in
:class:`~baguahvd.engine.execution.completion.Completions` until they have completed, in
launch order, and a failed one fails its unit without writing the outputs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from baguahvd.backends.base import Communicator, Pending, SelfCommunicator, Started
from baguahvd.common.exceptions import ShutDownError
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution.completion import CollectiveFailure
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.loop import EngineLoop
from baguahvd.engine.messages import OpType, RequestMeta, build_response
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Entry, Request


class _Reduction(Started):
    """A started allreduce of two ranks whose peer holds the same values: it writes twice
    the input once the test lets it finish."""

    def __init__(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor) -> None:
        self.tensor_in, self.tensor_out = tensor_in, tensor_out
        self.finished = False
        self.failure: Exception | None = None
        self.waited = False

    def finish(self) -> None:
        self.tensor_out.copy_(self.tensor_in * 2)
        self.finished = True

    def test(self) -> bool:
        if self.failure is not None:
            raise self.failure
        return self.finished

    def wait(self) -> None:
        self.waited = True
        if not self.finished:
            self.finish()


class _Launching(SelfCommunicator):
    """Two ranks' communicator whose allreduces are started, not run in the call."""

    rank = 0
    size = 2
    launches_allreduce = True

    def __init__(self) -> None:
        self.started: list[_Reduction] = []

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        raise AssertionError("a launching communicator's allreduce is started, not run")

    def start_allreduce(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp
    ) -> Started:
        reduction = _Reduction(tensor_in, tensor_out)
        self.started.append(reduction)
        return reduction


def _dispatcher(comm: Communicator) -> Dispatcher:
    return Dispatcher(0, {0: ProcessSetState(0, (0, 1), comm)})


def _unit(
    names: Sequence[str], values: Sequence[list[float]], fuse: bool = True,
    joined: bool = False,
) -> list[Entry]:
    """An Average unit of float32 tensors (with a joined member's entry, without a request,
    at its end when ``joined``)."""
    entries: list[Entry] = []
    for name, value in zip(names, values):
        meta = RequestMeta(
            key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0, rank=0,
            dtype="float32", shapes=((len(value),),), reduce_op=ReduceOp.AVERAGE, fuse=fuse,
        )
        tensor = torch.tensor(value)
        request = Request(meta, [tensor], [torch.zeros_like(tensor)])
        entries.append((build_response([meta], (0, 1), ()), request))
    if joined:
        meta = entries[-1][0].meta._replace(name="allreduce.joined", key="allreduce.joined")
        entries.append((build_response([meta], (0, 1), ()), None))
    return entries


def _requests(unit: list[Entry]) -> list[Request]:
    return [request for _, request in unit if request is not None]


def _result(request: Request) -> list[list[float]]:
    return [tensor.tolist() for tensor in request.handle.wait() or ()]


def test_an_unfused_allreduce_is_started_and_scaled_once_it_has_completed() -> None:
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    unit = _unit(["bucket"], [[1.0, 2.0, 3.0]], fuse=False)
    (request,) = _requests(unit)
    dispatcher.run_unit(unit)
    (reduction,) = comm.started
    assert reduction.tensor_out is request.outputs[0]  # type: ignore[index]
    assert not request.handle.done() and len(dispatcher.pending) == 1
    dispatcher.pending.poll()
    assert not request.handle.done()
    reduction.finish()
    assert request.outputs[0].tolist() == [2.0, 4.0, 6.0]  # type: ignore[index]
    dispatcher.pending.poll()  # the scaling after it, and the unit completes
    assert _result(request) == [[1.0, 2.0, 3.0]]
    assert len(dispatcher.pending) == 0


def test_a_fused_unit_copies_out_once_it_has_completed_and_a_joined_member_adds_zeros() -> None:
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    unit = _unit(["a", "b"], [[1.0, 2.0], [3.0]], joined=True)
    dispatcher.run_unit(unit)
    (reduction,) = comm.started
    # The fusion buffer: both tensors, then the joined member's zeros.
    assert reduction.tensor_in.tolist() == [1.0, 2.0, 3.0, 0.0]
    reduction.finish()
    for request in _requests(unit):
        assert request.outputs[0].abs().sum() == 0  # type: ignore[index]
    dispatcher.pending.drain()
    a, b = _requests(unit)
    assert _result(a) == [[1.0, 2.0]]
    assert _result(b) == [[3.0]]
    # Its fusion buffers went back for the next unit.
    dispatcher.run_unit(_unit(["c", "d"], [[5.0], [6.0]]))
    assert comm.started[1].tensor_in.data_ptr() == reduction.tensor_in.data_ptr()


def test_units_complete_in_launch_order_while_later_ones_are_started() -> None:
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    first, second = _unit(["first"], [[1.0]], fuse=False), _unit(["second"], [[2.0]], False)
    dispatcher.run_unit(first)
    dispatcher.run_unit(second)
    assert len(comm.started) == 2  # the second started before the first completed
    comm.started[1].finish()
    for _ in range(3):
        dispatcher.pending.poll()
    assert not _requests(first)[0].handle.done() and not _requests(second)[0].handle.done()
    comm.started[0].finish()
    for _ in range(3):
        dispatcher.pending.poll()
    assert _result(_requests(first)[0]) == [[1.0]]
    assert _result(_requests(second)[0]) == [[2.0]]


def test_a_failed_allreduce_fails_its_unit_and_writes_no_output() -> None:
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    unit = _unit(["a", "b"], [[1.0], [2.0]])
    dispatcher.run_unit(unit)
    comm.started[0].failure = RuntimeError("Connection closed by peer")
    with pytest.raises(CollectiveFailure, match="Connection closed") as caught:
        dispatcher.pending.poll()
    assert caught.value.unit == unit
    for request in _requests(unit):
        assert request.outputs[0].tolist() == [0.0]  # type: ignore[index]
    dispatcher.pending.abandon(ShutDownError())
    for request in _requests(unit):
        with pytest.raises(ShutDownError):
            request.handle.wait()


def test_draining_waits_for_every_started_allreduce() -> None:
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    unit = _unit(["w"], [[4.0]], fuse=False)
    dispatcher.run_unit(unit)
    dispatcher.pending.drain()
    assert comm.started[0].waited
    assert _result(_requests(unit)[0]) == [[4.0]]


def test_a_collective_run_in_the_call_completes_after_the_units_still_running() -> None:
    # A barrier returns once the allreduces before it are done (their names are free).
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    first = _unit(["first"], [[1.0]], fuse=False)
    dispatcher.run_unit(first)
    meta = RequestMeta(key="b", name="b", op=OpType.BARRIER, process_set_id=0, rank=0)
    barrier = Request(meta, [], None)
    dispatcher.run_unit([(build_response([meta], (0, 1), ()), barrier)])
    dispatcher.pending.poll()
    assert not barrier.handle.done()
    comm.started[0].finish()
    for _ in range(3):
        dispatcher.pending.poll()
    assert _requests(first)[0].handle.done() and barrier.handle.done()


def test_other_collectives_and_other_transports_run_in_the_call() -> None:
    dispatcher = _dispatcher(SelfCommunicator())
    unit = _unit(["w"], [[4.0]])
    dispatcher.run_unit(unit)
    assert _requests(unit)[0].handle.done() and len(dispatcher.pending) == 0
    comm = _Launching()
    launching = _dispatcher(comm)
    meta = RequestMeta(key="b", name="b", op=OpType.BARRIER, process_set_id=0, rank=0)
    barrier = Request(meta, [], None)
    launching.run_unit([(build_response([meta], (0, 1), ()), barrier)])
    assert barrier.handle.done() and comm.started == []


class _SlowAnd(Pending):
    """A bitwise AND that completes 20 ms after it started; the unit started before it
    finishes 5 ms in (its bytes went out ahead of the AND's on the link)."""

    def __init__(self, reduction: _Reduction, done: Callable[[], bool]) -> None:
        self.start, self.reduction, self.done = time.perf_counter(), reduction, done
        self.completed_while_waiting = False

    def test(self) -> bool:
        elapsed = time.perf_counter() - self.start
        if elapsed >= 0.005 and not self.reduction.finished:
            self.reduction.finish()
        if elapsed < 0.02:
            self.completed_while_waiting |= self.done()
            return False
        return True

    def wait(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def result(self) -> np.ndarray:
        return np.zeros(1, dtype=np.uint8)


def test_a_unit_that_finishes_while_the_cycle_waits_for_its_peers_completes_then() -> None:
    comm = _Launching()
    dispatcher = _dispatcher(comm)
    unit = _unit(["bucket"], [[1.0]], fuse=False)
    (request,) = _requests(unit)
    dispatcher.run_unit(unit)
    and_ = _SlowAnd(comm.started[0], request.handle.done)
    loop = object.__new__(EngineLoop)  # only what the AND's wait uses
    loop.dispatch = dispatcher
    loop.control = SimpleNamespace(start_bitwise_and=lambda words: and_,
                                   threads_multiple=True)
    loop.lifecycle = SimpleNamespace(error=None)
    loop._bitwise_and(np.zeros(1, dtype=np.uint8))
    assert and_.completed_while_waiting and _result(request) == [[1.0]]
