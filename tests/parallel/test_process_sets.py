"""Dynamic process sets: add_process_set / remove_process_set and collectives on subsets.

As in Horovod's suite, every test adds the even and the odd ranks as two sets (every rank
calls ``add_process_set``, members or not) and removes them at the end. With 2 ranks both
sets have one member; with 3 ranks they are ``[0, 2]`` and ``[1]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import baguahvd.torch as hvd


@pytest.fixture
def sets(size: int) -> Iterator[tuple[hvd.ProcessSet, hvd.ProcessSet]]:
    even = hvd.add_process_set(list(range(0, size, 2)))
    odd = hvd.add_process_set(list(range(1, size, 2)))
    yield even, odd
    assert hvd.remove_process_set(even)
    assert hvd.remove_process_set(odd)


def _mine(rank: int, sets: tuple[hvd.ProcessSet, hvd.ProcessSet]) -> hvd.ProcessSet:
    return sets[rank % 2]


def _foreign(rank: int, sets: tuple[hvd.ProcessSet, hvd.ProcessSet]) -> hvd.ProcessSet:
    return sets[(rank + 1) % 2]


def _world_still_works(size: int, name: str) -> None:
    result = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"world.{name}")
    assert torch.equal(result, torch.full((3,), float(size)))


def test_add_returns_the_registered_set(rank: int, size: int, sets) -> None:
    even, odd = sets
    assert even.ranks == list(range(0, size, 2))
    assert odd.ranks == list(range(1, size, 2))
    assert isinstance(even.process_set_id, int) and isinstance(odd.process_set_id, int)
    assert even.process_set_id > 0
    assert odd.process_set_id == even.process_set_id + 1


def test_size_rank_included(rank: int, size: int, sets) -> None:
    mine, foreign = _mine(rank, sets), _foreign(rank, sets)
    assert mine.size() == len(mine.ranks)
    assert mine.rank() == mine.ranks.index(rank) == rank // 2
    assert mine.included() is True
    assert foreign.included() is False
    assert foreign.size() == len(foreign.ranks)
    with pytest.raises(ValueError, match="Process is not part of provided process set."):
        foreign.rank()
    assert hvd.global_process_set.size() == size
    assert hvd.global_process_set.rank() == rank
    assert hvd.global_process_set.included() is True


def test_unregistered_set_queries_return_none() -> None:
    process_set = hvd.ProcessSet([0])
    assert process_set.process_set_id is None
    assert process_set.size() is None
    assert process_set.rank() is None
    assert process_set.included() is None


def test_str(size: int, sets) -> None:
    even, _ = sets
    assert str(even) == (
        f"ProcessSet(process_set_id={even.process_set_id}, ranks={list(range(0, size, 2))}, "
        "mpi_comm=None)"
    )
    unregistered = "ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)"
    assert str(hvd.ProcessSet([2, 0])) == unregistered


def test_constructor_sorts_and_validates() -> None:
    assert hvd.ProcessSet([3, 1, 2]).ranks == [1, 2, 3]
    assert hvd.ProcessSet(range(3)).ranks == [0, 1, 2]
    message = "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm"
    with pytest.raises(ValueError, match=message):
        hvd.ProcessSet(["a"])
    with pytest.raises(ValueError, match=message):
        hvd.ProcessSet([0.5])
    with pytest.raises(ValueError, match=message):
        hvd.ProcessSet(3)


def test_equality_is_identity() -> None:
    assert hvd.ProcessSet([0]) != hvd.ProcessSet([0])


def test_allreduce(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    tensor = torch.full((4, 2), float(rank + 1))
    total = float(sum(r + 1 for r in mine.ranks))
    summed = hvd.allreduce(tensor, op=hvd.Sum, name="ps_sum", process_set=mine)
    assert torch.equal(summed, torch.full((4, 2), total))
    averaged = hvd.allreduce(tensor, name="ps_avg", process_set=mine)
    assert torch.allclose(averaged, torch.full((4, 2), total / len(mine.ranks)))
    largest = hvd.allreduce(tensor, op=hvd.Max, process_set=mine)
    assert torch.equal(largest, torch.full((4, 2), float(max(mine.ranks) + 1)))
    in_place = tensor.clone()
    hvd.allreduce_(in_place, op=hvd.Sum, name="ps_inplace", process_set=mine)
    assert torch.equal(in_place, summed)
    _world_still_works(size, "allreduce")


def test_allreduce_integer_average_truncates(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    tensor = torch.full((3,), rank + 1, dtype=torch.int32)
    result = hvd.allreduce(tensor, op=hvd.Average, process_set=mine)
    expected = int(sum(r + 1 for r in mine.ranks) / len(mine.ranks))
    assert torch.equal(result, torch.full((3,), expected, dtype=torch.int32))


def test_grouped_allreduce_and_fusion(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    total = float(sum(r + 1 for r in mine.ranks))
    tensors = [torch.full((i + 1,), float(rank + 1)) for i in range(4)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="ps_group", process_set=mine)
    for i, result in enumerate(results):
        assert torch.equal(result, torch.full((i + 1,), total))
    # A burst of async requests on the set and on the world at the same time.
    set_handles = [
        hvd.allreduce_async(t, op=hvd.Sum, name=f"ps_burst.{i}", process_set=mine)
        for i, t in enumerate(tensors)
    ]
    world_handles = [
        hvd.allreduce_async(t, op=hvd.Sum, name=f"world_burst.{i}") for i, t in enumerate(tensors)
    ]
    world_total = float(sum(range(1, size + 1)))
    for i, handle in enumerate(set_handles):
        assert torch.equal(hvd.synchronize(handle), torch.full((i + 1,), total))
    for i, handle in enumerate(world_handles):
        assert torch.equal(hvd.synchronize(handle), torch.full((i + 1,), world_total))


def test_allgather(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    member = mine.rank()
    tensor = torch.full((member + 1, 2), float(rank))
    gathered = hvd.allgather(tensor, name="ps_gather", process_set=mine)
    expected = torch.cat([torch.full((i + 1, 2), float(r)) for i, r in enumerate(mine.ranks)])
    assert torch.equal(gathered, expected)
    _world_still_works(size, "allgather")


def test_broadcast(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    root = mine.ranks[-1]
    tensor = torch.full((3,), float(rank))
    result = hvd.broadcast(tensor, root_rank=root, name="ps_bcast", process_set=mine)
    assert torch.equal(result, torch.full((3,), float(root)))
    assert torch.equal(tensor, torch.full((3,), float(rank)))
    hvd.broadcast_(tensor, root_rank=root, process_set=mine)
    assert torch.equal(tensor, torch.full((3,), float(root)))
    _world_still_works(size, "broadcast")


def test_broadcast_root_outside_the_set(rank: int, size: int, sets) -> None:
    mine, foreign = _mine(rank, sets), _foreign(rank, sets)
    outsider = foreign.ranks[0]
    with pytest.raises(
        ValueError, match=f"broadcast received invalid root rank {outsider} for provided"
    ):
        hvd.broadcast(torch.ones(2), root_rank=outsider, process_set=mine)
    _world_still_works(size, "bcast_root")


def test_alltoall(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    members = len(mine.ranks)
    me = mine.rank()
    # Member i sends two rows to member j, valued 100 * i + j.
    tensor = torch.tensor([100.0 * me + j for j in range(members) for _ in range(2)])
    received = hvd.alltoall(tensor, name="ps_alltoall", process_set=mine)
    expected = torch.tensor([100.0 * i + me for i in range(members) for _ in range(2)])
    assert torch.equal(received, expected)
    # With explicit splits: member i sends i + 1 rows to everyone.
    splits = [me + 1] * members
    tensor = torch.full((sum(splits),), float(rank))
    received, received_splits = hvd.alltoall(tensor, splits=splits, process_set=mine)
    assert received_splits.tolist() == [i + 1 for i in range(members)]
    expected = torch.cat([torch.full((i + 1,), float(r)) for i, r in enumerate(mine.ranks)])
    assert torch.equal(received, expected)
    _world_still_works(size, "alltoall")


def test_reducescatter(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    members = len(mine.ranks)
    me = mine.rank()
    tensor = torch.arange(members * 2 * 3, dtype=torch.float32).reshape(members * 2, 3)
    tensor = tensor * (rank + 1)
    total = sum(r + 1 for r in mine.ranks)
    summed = hvd.reducescatter(tensor, op=hvd.Sum, name="ps_rs", process_set=mine)
    base = torch.arange(members * 2 * 3, dtype=torch.float32).reshape(members * 2, 3)
    assert torch.equal(summed, (base * total)[2 * me : 2 * me + 2])
    averaged = hvd.reducescatter(tensor, process_set=mine)
    assert torch.allclose(averaged, (base * total / members)[2 * me : 2 * me + 2])
    _world_still_works(size, "reducescatter")


def test_barrier(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    hvd.barrier(process_set=mine)
    hvd.barrier()
    _world_still_works(size, "barrier")


def test_non_member_raises(rank: int, size: int, sets) -> None:
    foreign = _foreign(rank, sets)
    member_error = f"Rank {rank} is not a member of the provided process set."
    tensor = torch.ones(2 * size)
    cases = [
        ("Allreduce", lambda: hvd.allreduce(tensor, process_set=foreign)),
        ("Allreduce", lambda: hvd.allreduce_async_(tensor, process_set=foreign)),
        ("Allreduce", lambda: hvd.grouped_allreduce([tensor], process_set=foreign)),
        ("Allgather", lambda: hvd.allgather(tensor, process_set=foreign)),
        ("Broadcast", lambda: hvd.broadcast(tensor, foreign.ranks[0], process_set=foreign)),
        ("Alltoall", lambda: hvd.alltoall(tensor, process_set=foreign)),
        ("Reducescatter", lambda: hvd.reducescatter(tensor, process_set=foreign)),
        ("Barrier", lambda: hvd.barrier(process_set=foreign)),
    ]
    for title, call in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == f"{title}: {member_error}"
    _world_still_works(size, "non_member")


def test_mismatch_inside_a_set(rank: int, size: int, sets) -> None:
    mine = _mine(rank, sets)
    if len(mine.ranks) < 2:
        # A single-member set cannot disagree with itself; still run the world check.
        _world_still_works(size, "set_mismatch")
        return
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(torch.ones(mine.rank() + 1), name="set_mismatch", process_set=mine)
    result = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=mine)
    assert torch.equal(result, torch.full((2,), float(len(mine.ranks))))
    _world_still_works(size, "set_mismatch")


def test_duplicate_add(size: int, sets) -> None:
    even, _ = sets
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(list(range(0, size, 2)))
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(hvd.ProcessSet(list(range(0, size, 2))))
    assert even.process_set_id is not None
    _world_still_works(size, "duplicate")


def test_remove_returns_true_then_false(size: int) -> None:
    process_set = hvd.add_process_set([0])
    ident = process_set.process_set_id
    assert ident is not None
    assert hvd.remove_process_set(process_set) is True
    assert process_set.process_set_id is None
    assert hvd.remove_process_set(process_set) is False
    assert process_set.size() is None
    assert process_set.included() is None
    _world_still_works(size, "remove")


def test_remove_unregistered_and_global(size: int) -> None:
    assert hvd.remove_process_set(hvd.ProcessSet([0])) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False
    assert hvd.global_process_set.process_set_id == 0
    _world_still_works(size, "remove_global")


def test_using_a_removed_set_raises(rank: int, size: int) -> None:
    process_set = hvd.add_process_set([size - 1])
    if process_set.included():
        result = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=process_set)
        assert torch.equal(result, torch.ones(2))
    assert hvd.remove_process_set(process_set)
    missing = "Process set provided does not exist, or has not been registered."
    with pytest.raises(ValueError, match=f"Allreduce: {missing}"):
        hvd.allreduce(torch.ones(2), process_set=process_set)
    with pytest.raises(ValueError, match=f"Allgather: {missing}"):
        hvd.allgather(torch.ones(2), process_set=process_set)
    with pytest.raises(ValueError, match=missing):
        hvd.barrier(process_set=process_set)
    _world_still_works(size, "removed")


def test_readding_after_remove(rank: int, size: int) -> None:
    first = hvd.add_process_set([size - 1])
    first_id = first.process_set_id
    assert hvd.remove_process_set(first)
    second = hvd.add_process_set([size - 1])
    assert second.process_set_id is not None and second.process_set_id != first_id
    if second.included():
        result = hvd.allreduce(
            torch.full((2,), float(rank)), op=hvd.Sum, name="readded", process_set=second
        )
        assert torch.equal(result, torch.full((2,), float(size - 1)))
    assert hvd.remove_process_set(second)
    _world_still_works(size, "readded")


def test_add_and_remove_many_times(rank: int, size: int) -> None:
    ids = set()
    for step in range(40):
        members = [step % size] if step % 2 or size < 3 else [0, size - 1]
        process_set = hvd.add_process_set(members)
        ids.add(process_set.process_set_id)
        if process_set.included():
            result = hvd.allreduce(
                torch.ones(2), op=hvd.Sum, name="churn", process_set=process_set
            )
            assert torch.equal(result, torch.full((2,), float(len(members))))
        assert hvd.remove_process_set(process_set)
    assert len(ids) == 40
    _world_still_works(size, "churn")


def test_a_set_of_every_rank_is_a_duplicate_of_the_global_set(size: int) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(range(size)))


def test_add_with_bad_ranks(size: int) -> None:
    with pytest.raises(ValueError):
        hvd.add_process_set([0, size])
    with pytest.raises(ValueError):
        hvd.add_process_set([-1])
    _world_still_works(size, "bad_ranks")


def test_mpi_communicator_cannot_be_added_dynamically(size: int) -> None:
    from mpi4py import MPI

    with pytest.raises(NotImplementedError):
        hvd.add_process_set(hvd.ProcessSet(MPI.COMM_WORLD))
    _world_still_works(size, "comm")


def test_many_sets_alive_at_once(rank: int, size: int) -> None:
    singles = [hvd.add_process_set([r]) for r in range(size)]
    ids = [s.process_set_id for s in singles]
    assert len(set(ids)) == size
    mine = singles[rank]
    assert mine.included() and mine.size() == 1 and mine.rank() == 0
    result = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, process_set=mine)
    assert torch.equal(result, torch.full((2,), float(rank)))
    gathered = hvd.allgather(torch.full((1,), float(rank)), process_set=mine)
    assert torch.equal(gathered, torch.full((1,), float(rank)))
    for process_set in singles:
        assert hvd.remove_process_set(process_set)
    _world_still_works(size, "singles")


def test_empty_process_set(rank: int, size: int) -> None:
    empty = hvd.add_process_set([])
    assert empty.process_set_id is not None
    assert empty.size() == 0
    assert empty.included() is False
    with pytest.raises(ValueError, match=f"Rank {rank} is not a member"):
        hvd.allreduce(torch.ones(1), process_set=empty)
    assert hvd.remove_process_set(empty)
    _world_still_works(size, "empty")


def test_join_counts_for_process_set_allreduce(rank: int, size: int) -> None:
    # A member that joined contributes zeros to allreduces on a set it belongs to.
    everyone_but_last = hvd.add_process_set(list(range(size - 1))) if size > 2 else None
    first = 0
    if rank == first:
        last = hvd.join()
    else:
        if everyone_but_last is not None and everyone_but_last.included():
            result = hvd.allreduce(
                torch.full((2,), float(rank)), op=hvd.Sum, name="joined_set",
                process_set=everyone_but_last,
            )
            assert torch.equal(result, torch.full((2,), float(sum(range(1, size - 1)))))
        # Completes only once rank 0's join is known, so rank 0 cannot be the last to join.
        world = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="joined_set_world")
        assert torch.equal(world, torch.full((2,), float(size - 1)))
        last = hvd.join()
    assert last != first
    assert hvd.allgather_object(last, name="joined_set_result") == [last] * size
    if everyone_but_last is not None:
        assert hvd.remove_process_set(everyone_but_last)
