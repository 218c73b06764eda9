"""The dispatcher on two threads at once: the engine thread runs agreed units while a user
thread runs a single-member set's collective itself (``Dispatcher.run_alone``).

Each test parks the engine thread inside a unit's communication (a communicator that waits
at a gate) and runs the user thread's collective meanwhile, so the interleaving is the same
on every run: nothing either thread keeps for the unit it runs may be seen by the other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from baguahvd.backends import cuda_support
from baguahvd.backends.base import Communicator, SelfCommunicator
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.messages import OpType, RequestMeta, Response, build_response
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request

TIMEOUT_S = 30.0


class Gate:
    """Where a communicator waits until the test lets it go on."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def wait(self) -> None:
        self.entered.set()
        assert self.release.wait(TIMEOUT_S)


class GatedComm(Communicator):
    """Rank 0 of two whose peer holds the same tensors: an allreduce doubles them, once the
    gate (if any) opens."""

    rank = 0
    size = 2

    def __init__(self) -> None:
        self.gate: Gate | None = None

    def allreduce(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor, op: ReduceOp) -> None:
        if self.gate is not None:
            self.gate.wait()
        tensor_out.copy_(tensor_in * 2)

    def allgather(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor,
                  counts: Sequence[int]) -> None:
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        raise NotImplementedError

    def alltoall(self, tensor_in: torch.Tensor, send_counts: Sequence[int],
                 tensor_out: torch.Tensor, recv_counts: Sequence[int]) -> None:
        raise NotImplementedError

    def reduce_scatter(self, tensor_in: torch.Tensor, tensor_out: torch.Tensor,
                       counts: Sequence[int], op: ReduceOp) -> None:
        raise NotImplementedError

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class Launched:
    def __init__(self) -> None:
        self.produced: list[torch.Tensor] = []
        self.fired = False


class GatedDevice(GatedComm):
    """A device communicator (``ordered``, ``finished``...) whose launched units finish when
    the test fires them."""

    device = torch.device("cuda", 0)

    def __init__(self, size: int = 2) -> None:
        super().__init__()
        self.size = size
        self.launched: list[Launched] = []

    @contextlib.contextmanager
    def ordered(self, device: torch.device, marks: Sequence[Any],
                what: str = "collective") -> Iterator[Launched]:
        launched = Launched()
        self.launched.append(launched)
        yield launched

    def finished(self, launched: Launched) -> bool:
        return launched.fired

    def wait(self, launched: Launched) -> None:
        launched.fired = True

    def abort(self, reason: str) -> None:
        pass


def allreduce(ident: int, members: tuple[int, ...], name: str, *tensors: torch.Tensor,
              device: str = "CPU") -> tuple[Request, list[tuple[Response, Request | None]]]:
    meta = RequestMeta(
        key=name, name=name, op=OpType.ALLREDUCE, process_set_id=ident, rank=0,
        dtype="float32", shapes=tuple(tuple(t.shape) for t in tensors), device=device,
    )
    request = Request(meta, list(tensors), [torch.empty_like(t) for t in tensors])
    return request, [(build_response([meta], members, ()), request)]


def dispatcher(states: dict[int, ProcessSetState], single_rank_nccl: bool = False) -> Dispatcher:
    return Dispatcher(0, states, single_rank_nccl=single_rank_nccl)


def engine_thread(body: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        torch.set_grad_enabled(False)
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_a_single_member_collective_completes_while_the_engine_runs_a_device_unit() -> None:
    device, gate = GatedDevice(), Gate()
    states = {
        0: ProcessSetState(0, (0, 1), comm=GatedComm(), device_comm=device),
        1: ProcessSetState(1, (0,), comm=SelfCommunicator()),
    }
    dispatch = dispatcher(states)
    engine_request, unit = allreduce(0, (0, 1), "engine", torch.ones(4), device="GPU")
    alone, _ = allreduce(1, (0,), "alone", torch.full((3,), 5.0))
    device.gate = gate
    thread, errors = engine_thread(lambda: dispatch.run_unit(unit))
    assert gate.entered.wait(TIMEOUT_S)  # the engine thread is inside its device unit
    try:
        dispatch.run_alone(alone, states[1])
        # A set of one completes before run_alone returns, whatever the engine is doing.
        assert alone.handle.done()
        assert torch.equal(alone.handle.wait()[0], torch.full((3,), 5.0))
    finally:
        gate.release.set()
        thread.join(TIMEOUT_S)
    assert not errors
    assert not engine_request.handle.done()  # its unit has not finished on the device
    dispatch.pending.drain()
    assert torch.equal(engine_request.handle.wait()[0], torch.full((4,), 2.0))


def test_a_device_unit_run_alone_leaves_the_engine_units_completions_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device, one_rank, gate = GatedDevice(), GatedDevice(size=1), Gate()
    states = {
        0: ProcessSetState(0, (0, 1), comm=GatedComm(), device_comm=device),
        1: ProcessSetState(1, (0,), comm=SelfCommunicator(), device_comm=one_rank),
    }
    dispatch = dispatcher(states, single_rank_nccl=True)
    # The single-member set's CUDA tensors take its one-rank device communicator.
    monkeypatch.setattr(cuda_support, "mark_submission", lambda tensors: None)
    monkeypatch.setattr(Dispatcher, "_through_nccl", lambda self, request, state: True)
    engine_request, unit = allreduce(0, (0, 1), "engine", torch.ones(4), device="GPU")
    alone, _ = allreduce(1, (0,), "alone", torch.full((3,), 5.0), device="GPU")
    device.gate = gate
    thread, errors = engine_thread(lambda: dispatch.run_unit(unit))
    assert gate.entered.wait(TIMEOUT_S)
    try:
        dispatch.run_alone(alone, states[1])
        assert alone.handle.done()
    finally:
        gate.release.set()
        thread.join(TIMEOUT_S)
    assert not errors
    # The engine's unit was launched, not finished: its handle waits for the device.
    assert not engine_request.handle.done()
    dispatch.pending.drain()
    assert engine_request.handle.done()


def test_grouped_single_member_allreduces_do_not_share_the_engines_fusion_buffer() -> None:
    data, gate = GatedComm(), Gate()
    states = {
        0: ProcessSetState(0, (0, 1), comm=data),
        1: ProcessSetState(1, (0,), comm=SelfCommunicator()),
    }
    dispatch = dispatcher(states)
    engine_request, unit = allreduce(0, (0, 1), "engine", torch.ones(3), torch.ones(2))
    alone, _ = allreduce(1, (0,), "alone", torch.full((3,), 7.0), torch.full((2,), 7.0))
    data.gate = gate
    thread, errors = engine_thread(lambda: dispatch.run_unit(unit))
    assert gate.entered.wait(TIMEOUT_S)  # the engine's fused unit is in its fusion buffer
    try:
        dispatch.run_alone(alone, states[1])
    finally:
        gate.release.set()
        thread.join(TIMEOUT_S)
    assert not errors
    assert [t.tolist() for t in engine_request.handle.wait()] == [[2.0] * 3, [2.0] * 2]
    assert [t.tolist() for t in alone.handle.wait()] == [[7.0] * 3, [7.0] * 2]
