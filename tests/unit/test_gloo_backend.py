"""The gloo data plane and control plane, with the ranks as threads of one process over
one in-memory store (torch's ``HashStore``): the same calls a job's ranks make."""

from __future__ import annotations

import ast
import pathlib
import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from baguahvd.backends.gloo import GlooControlPlane
from baguahvd.common.ops import ReduceOp
from tests.support.gloo_ranks import run_ranks


def test_negotiation_calls() -> None:
    def body(control: GlooControlPlane) -> Any:
        words = np.array([0xFF, 0x0F if control.rank else 0xF3], dtype=np.uint8)
        return (
            control.bitwise_and(words).tolist(),
            control.gather({"rank": control.rank, "pad": "x" * control.rank * 50}),
            control.broadcast(f"from {control.rank}"),
            control.allgather_ints([control.rank, 7]),
        )

    results = run_ranks(3, body)
    for rank, (anded, gathered, broadcast, ints) in enumerate(results):
        assert anded == [0xFF, 0x03]
        if rank == 0:
            assert [g["rank"] for g in gathered] == [0, 1, 2]
            assert len(gathered[2]["pad"]) == 100
        else:
            assert gathered is None
        assert broadcast == "from 0"
        assert ints == [[0, 7], [1, 7], [2, 7]]


def test_data_collectives() -> None:
    def body(control: GlooControlPlane) -> Any:
        comm = control.create_group_comm(range(control.size))
        assert comm is not None
        rank, size = comm.rank, comm.size
        out: dict[str, Any] = {}
        x = torch.full((4,), float(rank + 1))
        y = torch.empty(4)
        comm.allreduce(x, y, ReduceOp.SUM)
        out["sum"] = y.tolist()
        h = torch.full((3,), rank + 1.0, dtype=torch.float16)
        comm.allreduce(h, h, ReduceOp.MAX)
        out["max16"] = h.tolist()
        counts = [r + 1 for r in range(size)]
        gathered = torch.empty(sum(counts), dtype=torch.int32)
        comm.allgather(torch.full((rank + 1,), rank, dtype=torch.int32), gathered, counts)
        out["allgather"] = gathered.tolist()
        flag = torch.tensor([rank == 1, True])
        comm.broadcast(flag, 1)
        out["broadcast"] = flag.tolist()
        send = torch.arange(size, dtype=torch.float64) + 10 * rank
        received = torch.empty(size, dtype=torch.float64)
        comm.alltoall(send, [1] * size, received, [1] * size)
        out["alltoall"] = received.tolist()
        block = torch.empty(rank + 1)
        comm.reduce_scatter(torch.ones(sum(counts)), block, counts, ReduceOp.SUM)
        out["reduce_scatter"] = block.tolist()
        peer = torch.empty(2)
        comm.sendrecv(torch.full((2,), float(rank)), peer, rank ^ 1 if size % 2 == 0 else rank)
        out["sendrecv"] = peer.tolist()
        pending = comm.iallreduce(x, x, ReduceOp.PRODUCT)
        while not pending.test():
            pass
        out["product"] = x.tolist()
        comm.barrier()
        return out

    results = run_ranks(2, body)
    for rank, out in enumerate(results):
        assert out["sum"] == [3.0] * 4
        assert out["max16"] == [2.0] * 3
        assert out["allgather"] == [0, 1, 1]
        assert out["broadcast"] == [True, True]
        assert out["alltoall"] == [float(rank), 10.0 + rank]
        assert out["reduce_scatter"] == [2.0] * (rank + 1)
        assert out["sendrecv"] == [float(rank ^ 1)] * 2
        assert out["product"] == [2.0] * 4


def test_group_of_some_ranks_is_made_by_its_members_only() -> None:
    def body(control: GlooControlPlane) -> Any:
        comm = control.create_group_comm([0, 2])
        if comm is None:
            return None
        t = torch.tensor([control.rank])
        comm.allreduce(t, t, ReduceOp.SUM)
        return (comm.rank, comm.size, t.item())

    assert run_ranks(3, body) == [(0, 2, 2), None, (1, 2, 2)]


def test_alarms_acknowledgements_and_exit_barrier() -> None:
    barrier = threading.Barrier(2)

    def body(control: GlooControlPlane) -> Any:
        if control.rank == 0:
            control.raise_alarm({"why": "boom"}, [1])
            while control.acknowledged() != {1}:
                pass
            received = None
        else:
            received = None
            while received is None:
                received = control.poll_alarm()
            control.acknowledge(received[0])
            assert control.poll_alarm() is None
        barrier.wait()
        return received, control.exit_barrier(10, [0, 1])

    results = run_ranks(2, body)
    assert results[0] == (None, True)
    assert results[1] == ((0, {"why": "boom"}), True)


def test_exit_barrier_times_out_while_a_rank_is_missing() -> None:
    late = threading.Event()

    def body(control: GlooControlPlane) -> Any:
        if control.rank == 0:
            alone = control.exit_barrier(0.1, [0, 1])
            late.set()
            return alone
        late.wait()
        return control.exit_barrier(10, [0, 1])

    assert run_ranks(2, body) == [False, True]


def test_exit_barrier_among_survivors_does_not_wait_for_the_others() -> None:
    def body(control: GlooControlPlane) -> Any:
        if control.rank == 1:
            return None  # gone
        return control.exit_barrier(10, [0, 2])

    assert run_ranks(3, body) == [True, None, True]


def test_unknown_dtype_is_named() -> None:
    def body(control: GlooControlPlane) -> Any:
        comm = control.create_group_comm(range(control.size))
        assert comm is not None
        with pytest.raises(TypeError, match="complex64"):
            comm.allreduce(torch.zeros(2, dtype=torch.complex64), torch.zeros(2,
                           dtype=torch.complex64), ReduceOp.SUM)

    run_ranks(2, body)


def test_only_the_backends_import_torch_distributed() -> None:
    # import-linter cannot forbid a subpackage of an external package, so this looks.
    root = pathlib.Path(__file__).resolve().parents[2] / "baguahvd"
    offenders = []
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.")
                   for n in names):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


class _FailedWork:
    """A gloo work whose peer closed its connection."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


class _ClosedGroup:
    """A process group one of whose peers closed its connection."""

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> _FailedWork:
        return _FailedWork()


def test_a_failed_bitwise_and_raises_gloo_s_error_and_marks_the_world_failed() -> None:
    # The engine waits a while for the cause (the dead rank) before it raises, and the
    # watchdog names a gone peer at once when the world has failed.
    def body(control: GlooControlPlane) -> bool:
        control._group = _ClosedGroup()
        pending = control.start_bitwise_and(np.array([0xFF], dtype=np.uint8))
        assert not control.collective_failed()
        with pytest.raises(RuntimeError, match="Connection closed"):
            pending.test()
        return control.collective_failed()

    assert run_ranks(1, body) == [True]


class _GoneStore:
    """A store whose host is gone: every call fails as torch's TCPStore then fails."""

    def add(self, key: str, amount: int) -> int:
        raise dist.DistNetworkError("Broken pipe")


def test_an_alarm_through_a_gone_store_is_reported_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A survivor of the store's host must still fail its own collectives after the alarm.
    def body(control: GlooControlPlane) -> Any:
        control._store = _GoneStore()
        control.raise_alarm({"why": "rank 0 is gone"}, [1])

    run_ranks(1, body)
    assert "cannot raise the alarm for ranks [1]" in caplog.text
