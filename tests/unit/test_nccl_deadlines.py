"""Every NCCL call that can block the calling thread runs under a deadline: the first
point-to-point launch (NCCL connects those peers inside ``ncclGroupEnd``), freeing a
communicator with work in flight (``ncclCommDestroy`` waits for it), the collectives NCCL
2.22+ would connect at their first launch, and Adasum's choice of coefficients (a host read
of a device value). Run against the fake CuPy."""

from __future__ import annotations

import threading

import pytest
import torch

from baguahvd.backends import nccl as backend
from baguahvd.backends import nccl_setup
from baguahvd.backends.base import SelfCommunicator
from baguahvd.engine.execution import execute
from tests.fakes import fake_mpi
from tests.fakes.fake_cupy import FakeCupy, installed

pytestmark = pytest.mark.bookkeeping

DEVICE = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    cupy = installed(monkeypatch, DEVICE)
    yield cupy
    for gate in cupy.blocked.values():  # lets helper threads left behind finish
        gate.set()


def _bound(timeout_s: float) -> backend.NCCLCommunicator:
    """Rank 1 of 2 with its NCCL communicator made."""
    members = fake_mpi.members(2)
    comm = backend.NCCLCommunicator(members[1], timeout_s=timeout_s)
    members[0].Ibcast(bytearray([1] * 128), root=0)
    token = torch.zeros(1)
    comm.broadcast(token, 0)
    return comm


def _in_thread(call: object) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return thread, raised


def test_a_peer_that_never_connects_point_to_point_ends_at_the_deadline(
    fake: FakeCupy,
) -> None:
    comm = _bound(timeout_s=0.3)
    fake.blocked["send"] = threading.Event()  # the peer never shows up
    thread, raised = _in_thread(lambda: comm.sendrecv(torch.ones(2), torch.empty(2), 0))
    assert not thread.is_alive(), "the first sendrecv blocked the calling thread"
    assert len(raised) == 1 and isinstance(raised[0], backend.NCCLTimeoutError)
    assert "connecting its peers" in str(raised[0])
    assert ("abort", 1) in fake.log


def test_only_the_first_point_to_point_launch_takes_a_helper_thread(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = _bound(timeout_s=30)
    threads: list[str] = []
    send = fake.cupy.cuda.nccl.NcclCommunicator.send

    def noting(self: object, *args: object) -> None:
        threads.append(threading.current_thread().name)
        send(self, *args)

    monkeypatch.setattr(fake.cupy.cuda.nccl.NcclCommunicator, "send", noting)
    for _ in range(2):
        comm.alltoall(torch.ones(2), [1, 1], torch.empty(2), [1, 1])
    # Two sends a call (one to each member, this rank included).
    assert threads == ["baguahvd-nccl-connect"] * 2 + [threading.current_thread().name] * 2


def test_freeing_with_work_in_flight_aborts_at_the_deadline(fake: FakeCupy) -> None:
    comm = _bound(timeout_s=0.3)
    fake.polls_until_done = -1  # the stream never drains: a peer is gone
    thread, raised = _in_thread(comm.free)
    assert not thread.is_alive() and raised == []
    assert ("abort", 1) in fake.log and ("destroy", 1) not in fake.log


def test_the_timeout_is_raised_while_the_abort_still_waits_for_the_device(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # ncclCommAbort frees device memory, which waits for the work queued on the device: behind
    # a producer kernel that has not finished, the abort blocks until that kernel ends.
    monkeypatch.setattr(nccl_setup, "ABORT_WAIT_S", 0.1)
    comm = _bound(timeout_s=0.3)
    fake.polls_until_done = -1
    fake.blocked["abort"] = threading.Event()
    thread, raised = _in_thread(lambda: comm.broadcast(torch.ones(2), 0))
    assert not thread.is_alive(), "the timeout waited for the abort"
    assert len(raised) == 1 and isinstance(raised[0], backend.NCCLTimeoutError)
    assert ("abort", 1) in fake.log and not fake.communicators[-1].aborted
    assert "still waiting for the device" in caplog.text
    fake.blocked["abort"].set()


def test_freeing_a_drained_communicator_destroys_it(fake: FakeCupy) -> None:
    comm = _bound(timeout_s=30)
    comm.free()
    assert ("destroy", 1) in fake.log and ("abort", 1) not in fake.log


def test_collectives_connect_at_creation_unless_the_user_said_otherwise() -> None:
    environ: dict[str, str] = {}
    nccl_setup.connect_at_creation(environ)
    assert environ == {"NCCL_RUNTIME_CONNECT": "0"}
    chosen = {"NCCL_RUNTIME_CONNECT": "1"}
    nccl_setup.connect_at_creation(chosen)
    assert chosen == {"NCCL_RUNTIME_CONNECT": "1"}


class _Mirror(SelfCommunicator):
    """Rank 0 of 2 whose peer sends back what it got (a = b at every level)."""

    rank, size = 0, 2

    def sendrecv(self, tensor_out: torch.Tensor, tensor_in: torch.Tensor, peer: int) -> None:
        tensor_in.copy_(tensor_out)


def test_adasum_never_reads_a_device_value_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def host_read(self: torch.Tensor, *args: object) -> object:
        raise AssertionError("a device value was read on the host")

    for values in ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]):
        tensor = torch.tensor(values)
        out = torch.empty(3)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "__bool__", host_read)
            patch.setattr(torch.Tensor, "item", host_read)
            execute.adasum(_Mirror(), tensor, out)
        # Equal vectors combine to themselves; zeros keep coefficients of one.
        assert torch.equal(out, tensor)
