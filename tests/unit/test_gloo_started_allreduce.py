"""gloo's allreduces started without waiting (``GlooCommunicator.start_allreduce``, which
the engine uses for host units): several in flight at once complete with the right sums,
in place or not, float16 through float32; ``wait`` and ``test`` both finish them, and a
failed one raises from both. Ranks are threads of one process over one in-memory store."""

from __future__ import annotations

import threading

import pytest
import torch

from baguahvd.backends.base import Communicator, Finished, SelfCommunicator
from baguahvd.backends.gloo import GlooControlPlane, PendingWork
from baguahvd.common.ops import ReduceOp
from tests.support.gloo_ranks import run_ranks


def test_started_allreduces_complete_in_flight_together() -> None:
    def body(control: GlooControlPlane) -> list[list[float]]:
        comm = control.create_group_comm(range(control.size))
        assert comm is not None and comm.launches_allreduce
        rank = comm.rank
        big = torch.full((1 << 20,), float(rank + 1))
        small_in = torch.full((3,), float(rank))
        small_out = torch.empty(3)
        half = torch.full((2,), rank + 0.5, dtype=torch.float16)
        started = [
            comm.start_allreduce(big, big, ReduceOp.SUM),
            comm.start_allreduce(small_in, small_out, ReduceOp.MAX),
            comm.start_allreduce(half, half, ReduceOp.SUM),
        ]
        assert all(isinstance(s, PendingWork) for s in started)
        started[0].wait()
        while not started[1].test():
            pass
        started[2].wait()
        assert all(s.test() for s in started)
        return [big.unique().tolist(), small_out.tolist(), half.tolist()]

    for result in run_ranks(3, body):
        assert result == [[6.0], [2.0] * 3, [4.5, 4.5]]


def test_a_failed_allreduce_raises_from_test_and_wait() -> None:
    class Broken:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer [10.0.0.2]:4242")

    failed = threading.Event()
    for finish in ("test", "wait"):
        pending = PendingWork(Broken(), (), failed=failed)
        with pytest.raises(RuntimeError, match="Connection closed"):
            getattr(pending, finish)()
        assert failed.is_set()
        failed.clear()


def test_other_transports_run_the_allreduce_in_the_call() -> None:
    comm: Communicator = SelfCommunicator()
    assert not comm.launches_allreduce
    x, y = torch.ones(2), torch.zeros(2)
    started = comm.start_allreduce(x, y, ReduceOp.SUM)
    assert isinstance(started, Finished) and started.test() and y.tolist() == [1.0, 1.0]
    started.wait()


def test_a_started_allreduce_tells_when_it_ends_and_test_agrees() -> None:
    # gloo completes the future (and runs its callbacks) just before the work says it is
    # completed: test() from another thread counts it as done once the callback has run.
    def body(control: GlooControlPlane) -> list[bool]:
        comm = control.create_group_comm(range(control.size))
        assert comm is not None
        seen = []
        for _ in range(5):
            tensor = torch.full((1 << 16,), float(comm.rank + 1))
            started = comm.start_allreduce(tensor, tensor, ReduceOp.SUM)
            told = threading.Event()
            assert started.notify(told.set)
            assert told.wait(30)
            seen.append(started.test())
            assert tensor.unique().tolist() == [3.0]
        return seen

    for seen in run_ranks(2, body):
        assert seen == [True] * 5


def test_a_finished_allreduce_tells_at_once() -> None:
    def body(control: GlooControlPlane) -> bool:
        comm = control.create_group_comm(range(control.size))
        assert comm is not None
        tensor = torch.ones(4)
        started = comm.start_allreduce(tensor, tensor, ReduceOp.SUM)
        started.wait()
        told = threading.Event()
        assert started.notify(told.set)
        return told.is_set()

    assert run_ranks(2, body) == [True, True]
