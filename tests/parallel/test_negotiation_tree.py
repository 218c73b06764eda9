"""The negotiation's point-to-point messages over MPI: the reports' tree to rank 0 on the
MPI control plane, against rank 0 reading every rank's report
(``tests/reference/coordinator_oracle.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from baguahvd.engine.messages import OpType, RequestMeta
from baguahvd.engine.negotiation import tree
from baguahvd.engine.negotiation.coordinator import Coordinator
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.notices import RankReport
from baguahvd.engine.process_sets import ProcessSetState
from tests.reference.coordinator_oracle import OracleCoordinator


@pytest.fixture
def control() -> Iterator[object]:
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        pytest.skip("the MPI control plane needs mpirun")
    from mpi4py import MPI

    from baguahvd.backends.mpi.control import MPIControlPlane

    plane = MPIControlPlane(MPI.COMM_WORLD)
    yield plane
    plane.free()


def _report(rank: int) -> RankReport:
    """Agreeing requests, one whose shape differs on the last rank, an allgather."""
    metas = [
        RequestMeta(f"allreduce.t{i}", f"allreduce.t{i}", OpType.ALLREDUCE, 0, rank,
                    dtype="float32", shapes=((3,),)) for i in range(4)
    ]
    metas.append(RequestMeta("allreduce.odd", "allreduce.odd", OpType.ALLREDUCE, 0, rank,
                             dtype="float32", shapes=((2 + rank // 2,),)))
    metas.append(RequestMeta("allgather.v", "allgather.v", OpType.ALLGATHER, 0, rank,
                             dtype="float32", shapes=((rank + 1, 2),)))
    return RankReport(metas, [0.1 * rank] * len(metas))


def test_the_tree_over_mpi_brings_rank_0_every_report(control: object, rank: int,
                                                      size: int) -> None:
    from baguahvd.backends.mpi.control import MPIControlPlane

    assert isinstance(control, MPIControlPlane)
    for peer in (rank, size, -1):
        with pytest.raises(ValueError, match="must be another rank of the job"):
            control.send("x", peer)
    tally = tree.up_the_tree(control, _report(rank))
    if rank != 0:
        assert tally is None
        return
    assert tally is not None
    sets = {0: ProcessSetState(0, tuple(range(size)), None)}
    reports = [_report(r) for r in range(size)]
    expected = OracleCoordinator(StallInspector(60.0, 0.0, False)).decide(
        reports, sets, size, 0.0)
    decision = Coordinator(StallInspector(60.0, 0.0, False), None).decide(tally, sets, size, 0.0)
    assert decision == expected
    assert [r.meta.key for r in decision.responses][-1] == "allgather.v"


def test_messages_between_two_ranks_arrive_in_order(control: object, rank: int,
                                                    size: int) -> None:
    from baguahvd.backends.mpi.control import MPIControlPlane

    assert isinstance(control, MPIControlPlane)
    if rank == 0:
        for peer in range(1, size):
            for i in range(3):
                control.send({"n": i, "pad": "x" * 100_000 * i}, peer)
    else:
        assert [control.recv(0)["n"] for _ in range(3)] == [0, 1, 2]
