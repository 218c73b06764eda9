"""Process sets registered at start-up: ``hvd.init(process_sets=[...])``.

The initialisation happens when this module is imported, before the autouse fixture's
``hvd.init()`` (which must then do nothing). The world size comes from mpirun's environment
because ``hvd.size()`` is not available before ``init()``.
"""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

import baguahvd.torch as hvd

if "OMPI_COMM_WORLD_SIZE" not in os.environ:
    pytest.skip("runs on every rank of an mpirun job", allow_module_level=True)

_WORLD_SIZE = int(os.environ["OMPI_COMM_WORLD_SIZE"])
_WORLD_RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])

FIRST_TWO = hvd.ProcessSet([0, 1])
EVERY_OTHER_FROM_LAST = hvd.ProcessSet(list(range(_WORLD_SIZE - 1, -1, -2)))
# Members of the communicator-based set, chosen to differ from the two sets above:
# [0] with 2 ranks, [1, 2] with 3.
_COMM_MEMBERS = list(range(1, _WORLD_SIZE)) if _WORLD_SIZE > 2 else [0]
_SPLIT = MPI.COMM_WORLD.Split(0 if _WORLD_RANK in _COMM_MEMBERS else MPI.UNDEFINED, _WORLD_RANK)
FROM_COMM = hvd.ProcessSet(_SPLIT)

# An entry listed twice is refused before anything starts, leaving baguahvd uninitialised.
_DUPLICATE = hvd.ProcessSet([0])
try:
    hvd.init(process_sets=[_DUPLICATE, _DUPLICATE])
except ValueError as exc:
    _DUPLICATE_ERROR: ValueError | None = exc
else:
    _DUPLICATE_ERROR = None
_INITIALIZED_AFTER_DUPLICATE = hvd.is_initialized()

hvd.init(process_sets=[FIRST_TWO, EVERY_OTHER_FROM_LAST, FROM_COMM])


def test_duplicate_entry_was_refused() -> None:
    assert _DUPLICATE_ERROR is not None
    assert str(_DUPLICATE_ERROR) == (
        "Horovod could not be initialized because process_sets entry number 1 is a "
        f"duplicate: {_DUPLICATE}"
    )
    assert not _INITIALIZED_AFTER_DUPLICATE
    assert _DUPLICATE.process_set_id is None


def test_reinit_is_a_no_op(rank: int, size: int) -> None:
    hvd.init(process_sets=[hvd.ProcessSet([0])])
    assert hvd.size() == _WORLD_SIZE and hvd.rank() == _WORLD_RANK
    assert FIRST_TWO.process_set_id == 1


def test_ids_in_list_order() -> None:
    assert FIRST_TWO.process_set_id == 1
    assert EVERY_OTHER_FROM_LAST.process_set_id == 2
    assert FROM_COMM.process_set_id == 3
    assert hvd.global_process_set.process_set_id == 0


def test_ranks_are_sorted(size: int) -> None:
    assert FIRST_TWO.ranks == [0, 1]
    assert EVERY_OTHER_FROM_LAST.ranks == sorted(range(size - 1, -1, -2))
    assert FROM_COMM.ranks == _COMM_MEMBERS
    assert hvd.global_process_set.ranks == list(range(size))


def test_comm_set_keeps_its_communicator() -> None:
    assert FROM_COMM.mpi_comm is _SPLIT
    assert "mpi_comm=" in str(FROM_COMM)
    assert str(FIRST_TWO) == "ProcessSet(process_set_id=1, ranks=[0, 1], mpi_comm=None)"


@pytest.mark.parametrize("which", ["first_two", "every_other", "from_comm"])
def test_size_rank_included(rank: int, which: str) -> None:
    process_set = {
        "first_two": FIRST_TWO, "every_other": EVERY_OTHER_FROM_LAST, "from_comm": FROM_COMM
    }[which]
    assert process_set.size() == len(process_set.ranks)
    assert process_set.included() == (rank in process_set.ranks)
    if rank in process_set.ranks:
        assert process_set.rank() == process_set.ranks.index(rank)
    else:
        with pytest.raises(ValueError, match="Process is not part of provided process set."):
            process_set.rank()


@pytest.mark.parametrize("which", ["first_two", "every_other", "from_comm"])
def test_collectives(rank: int, size: int, which: str) -> None:
    process_set = {
        "first_two": FIRST_TWO, "every_other": EVERY_OTHER_FROM_LAST, "from_comm": FROM_COMM
    }[which]
    members = process_set.ranks
    assert members is not None
    if rank not in members:
        with pytest.raises(ValueError, match=f"Rank {rank} is not a member"):
            hvd.allreduce(torch.ones(2), process_set=process_set)
    else:
        me = members.index(rank)
        summed = hvd.allreduce(
            torch.full((3,), float(rank + 1)), op=hvd.Sum, name=which, process_set=process_set
        )
        assert torch.equal(summed, torch.full((3,), float(sum(r + 1 for r in members))))
        gathered = hvd.allgather(
            torch.full((me + 1,), float(rank)), name=which, process_set=process_set
        )
        expected = torch.cat([torch.full((i + 1,), float(r)) for i, r in enumerate(members)])
        assert torch.equal(gathered, expected)
        root = members[-1]
        broadcast = hvd.broadcast(
            torch.full((2,), float(rank)), root, name=which, process_set=process_set
        )
        assert torch.equal(broadcast, torch.full((2,), float(root)))
        received = hvd.alltoall(
            torch.full((len(members),), float(rank)), name=which, process_set=process_set
        )
        assert torch.equal(received, torch.tensor([float(r) for r in members]))
        scattered = hvd.reducescatter(
            torch.ones(len(members), 2), op=hvd.Sum, name=which, process_set=process_set
        )
        assert torch.equal(scattered, torch.full((1, 2), float(len(members))))
        hvd.barrier(process_set=process_set)
    world = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"world.{which}")
    assert torch.equal(world, torch.full((2,), float(size)))


def test_static_set_can_be_removed_and_added_back(rank: int, size: int) -> None:
    # conftest enables dynamic sets, so static sets may be removed too; new ids continue
    # after the static ones.
    ranks = list(EVERY_OTHER_FROM_LAST.ranks or ())
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(ranks)
    assert hvd.remove_process_set(EVERY_OTHER_FROM_LAST) is True
    assert EVERY_OTHER_FROM_LAST.process_set_id is None
    assert hvd.remove_process_set(EVERY_OTHER_FROM_LAST) is False
    with pytest.raises(ValueError, match="does not exist, or has not been registered"):
        hvd.allreduce(torch.ones(1), process_set=EVERY_OTHER_FROM_LAST)
    added = hvd.add_process_set(ranks)
    assert added.process_set_id == 4
    if added.included():
        result = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=added)
        assert torch.equal(result, torch.full((1,), float(len(ranks))))
    assert FIRST_TWO.process_set_id == 1
    if FIRST_TWO.included():
        result = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=FIRST_TWO)
        assert torch.equal(result, torch.full((1,), 2.0))
    assert hvd.remove_process_set(added)
    world = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="world.after_remove")
    assert torch.equal(world, torch.full((2,), float(size)))
