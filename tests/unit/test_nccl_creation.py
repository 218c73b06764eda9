"""Creating an NCCL communicator with a deadline (``baguahvd.backends.nccl_setup``), against
the fake CuPy: a peer that never arrives, an ``ncclCommInitRank`` or a first connection
setup that never returns, and an engine that stops meanwhile end in named errors, never in
a hang."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from baguahvd.backends import cuda_support, nccl_setup
from baguahvd.backends import nccl as backend
from baguahvd.common.ops import ReduceOp
from tests.fakes import fake_mpi
from tests.fakes.fake_cupy import NCCL_STREAM_BASE, FakeCupy

pytestmark = pytest.mark.bookkeeping

DEVICE = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    cupy = FakeCupy()
    cupy.install(monkeypatch)
    monkeypatch.setattr(cuda_support, "tensor_device", lambda tensor: DEVICE)
    monkeypatch.setattr(cuda_support, "current_stream_ptr", lambda device: 0x7070)
    monkeypatch.setattr(cuda_support, "set_torch_device", lambda device: None)
    yield cupy
    for gate in cupy.blocked.values():  # lets abandoned helper threads finish
        gate.set()


def _create(comm: backend.NCCLCommunicator) -> float:
    """Runs a first collective (which creates the communicator); returns its seconds."""
    start = time.monotonic()
    comm.broadcast(torch.ones(2), 0)
    return time.monotonic() - start


def _wait_for(condition: object, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.005)
    return False


def test_creation_waits_for_an_init_in_progress_and_warms_the_communicator_up(
    fake: FakeCupy,
) -> None:
    fake.blocked["NcclCommunicator"] = gate = threading.Event()
    opened = time.monotonic() + 0.1  # measured before the timer starts
    threading.Timer(0.1, gate.set).start()
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=10)
    _create(comm)
    assert time.monotonic() >= opened
    assert comm.device == DEVICE
    (alloc,) = fake.log.of("alloc")
    warm_up = fake.log.of("allReduce")[0]
    # One byte, reduced in place on the communicator's stream before the first collective.
    assert warm_up == ("allReduce", 0, alloc[1], alloc[1], 1, 1, 0, NCCL_STREAM_BASE)
    assert fake.log.names().index("allReduce") < fake.log.names().index("broadcast")


def test_a_peer_that_never_sends_the_unique_id_times_out(fake: FakeCupy) -> None:
    members = fake_mpi.members(2)
    comm = backend.NCCLCommunicator(members[1], timeout_s=0.2)
    with pytest.raises(backend.NCCLTimeoutError, match="MPI broadcast of the NCCL unique id"):
        assert _create(comm) < 5
    assert "NcclCommunicator" not in fake.log.names()


def test_an_init_that_never_returns_times_out_and_is_aborted_if_it_ever_does(
    fake: FakeCupy,
) -> None:
    fake.blocked["NcclCommunicator"] = gate = threading.Event()
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(backend.NCCLTimeoutError, match="ncclCommInitRank did not finish"):
        comm.broadcast(torch.ones(2), 0)
    assert time.monotonic() - start < 5
    # NCCL returns after all: the helper aborts the communicator nobody will use.
    gate.set()
    assert _wait_for(lambda: fake.communicators and fake.communicators[0].aborted)


def test_a_first_connection_setup_that_hangs_times_out_and_aborts(fake: FakeCupy) -> None:
    fake.blocked["allReduce"] = threading.Event()
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=0.2)
    with pytest.raises(backend.NCCLTimeoutError, match="connection setup of the first allreduce"):
        _create(comm)
    assert fake.communicators[0].aborted
    assert "broadcast" not in fake.log.names()


def test_a_warm_up_that_never_completes_times_out_and_aborts(fake: FakeCupy) -> None:
    fake.polls_until_done = -1
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=0.2)
    with pytest.raises(backend.NCCLTimeoutError, match=r"the first allreduce did not finish "
                       r"within 0.2 s \(BAGUAHVD_NCCL_TIMEOUT_SECONDS\)") as info:
        _create(comm)
    assert "aborted" in str(info.value)
    assert fake.communicators[0].aborted


def test_an_asynchronous_error_during_the_warm_up_is_named(fake: FakeCupy) -> None:
    fake.polls_until_done = -1
    fake.async_error = 6
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=30)
    with pytest.raises(backend.NCCLError, match="failed during the first allreduce") as info:
        _create(comm)
    assert not isinstance(info.value, backend.NCCLTimeoutError)
    assert fake.communicators[0].aborted


def test_creation_is_abandoned_when_the_engine_stops(fake: FakeCupy) -> None:
    fake.blocked["NcclCommunicator"] = threading.Event()
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=60)
    comm.stopped = lambda: RuntimeError("rank 1 is gone")
    with pytest.raises(backend.NCCLError, match="engine stopped: rank 1 is gone") as info:
        assert _create(comm) < 5
    assert not isinstance(info.value, backend.NCCLTimeoutError)


def test_a_member_whose_creation_failed_refuses_later_collectives(fake: FakeCupy) -> None:
    fake.blocked["NcclCommunicator"] = threading.Event()
    comm = backend.NCCLCommunicator(fake_mpi.members(1)[0], timeout_s=0.1)
    with pytest.raises(backend.NCCLTimeoutError):
        _create(comm)
    fake.log.clear()
    with pytest.raises(backend.NCCLError, match="aborted earlier"):
        comm.allreduce(torch.ones(2), torch.ones(2), ReduceOp.SUM)
    assert fake.log == []


def test_an_mpi_communicator_without_ibcast_falls_back_to_bcast(
    fake: FakeCupy, caplog: pytest.LogCaptureFixture
) -> None:
    class BlockingOnly:
        def __init__(self, member: fake_mpi.FakeComm) -> None:
            self.member = member

        def Get_rank(self) -> int:
            return self.member.Get_rank()

        def Get_size(self) -> int:
            return self.member.Get_size()

        def bcast(self, obj: object, root: int = 0) -> object:
            return self.member.bcast(obj, root)

    members = fake_mpi.members(2)
    with caplog.at_level(logging.DEBUG, logger=nccl_setup.__name__):
        _create(backend.NCCLCommunicator(BlockingOnly(members[0])))
    assert members[0].bcasts and members[0].bcasts[0][0] == fake.communicators[0].comm_id
    assert "broadcast blocking" in caplog.text
    # The debug log says why creation runs on a helper thread.
    assert "no ncclCommInitRankConfig" in caplog.text
