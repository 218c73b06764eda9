"""Lifecycle, topology, capability queries, handles, barrier and join."""

from __future__ import annotations

import os
import time

import pytest
import torch

import baguahvd.torch as hvd


def _world_still_works(size: int, name: str) -> None:
    result = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"world.{name}")
    assert torch.equal(result, torch.full((3,), float(size)))


# ---------------------------------------------------------------------------------------
# Topology and capabilities


def test_size_and_rank_match_the_launcher(rank: int, size: int) -> None:
    assert hvd.is_initialized()
    # mpirun's variables, or torchrun's (which baguahvdrun --gloo also sets).
    assert size == int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    assert rank == int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["RANK"])
    assert isinstance(size, int) and isinstance(rank, int)


def test_topology_on_one_node(rank: int, size: int) -> None:
    # The harness runs every rank on this machine. (OMPI_COMM_WORLD_LOCAL_RANK is not
    # compared: Open MPI 5 may number local ranks out of world order when oversubscribed.)
    assert hvd.local_size() == size
    assert hvd.local_rank() == rank
    assert hvd.cross_size() == 1
    assert hvd.cross_rank() == 0
    assert hvd.is_homogeneous() is True


def test_topology_agrees_across_ranks(rank: int, size: int) -> None:
    mine = (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    everyone = hvd.allgather_object(mine, name="topology")
    assert [entry[0] for entry in everyone] == list(range(size))
    assert {entry[2] for entry in everyone} == {size}
    assert sorted(entry[1] for entry in everyone) == list(range(size))


def test_capability_queries() -> None:
    under_mpirun = "OMPI_COMM_WORLD_SIZE" in os.environ
    assert hvd.mpi_built() is True
    assert hvd.mpi_enabled() is under_mpirun
    assert hvd.gloo_built() is True
    assert hvd.gloo_enabled() is not under_mpirun
    assert hvd.ccl_built() is False
    assert hvd.ddl_built() is False
    assert hvd.rocm_built() is False
    assert isinstance(hvd.cuda_built(), bool)
    nccl = hvd.nccl_built()
    assert isinstance(nccl, int) and not isinstance(nccl, bool) and nccl >= 0
    assert isinstance(hvd.mpi_threads_supported(), bool)


def test_init_again_is_a_no_op(rank: int, size: int) -> None:
    for _ in range(3):
        hvd.init()
    assert hvd.rank() == rank and hvd.size() == size
    _world_still_works(size, "reinit")


def test_init_forgets_outstanding_handles(size: int) -> None:
    handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="forgotten")
    hvd.init()
    assert hvd.synchronize(handle) is None
    with pytest.raises(ValueError):
        hvd.poll(handle)
    # The forgotten request still ran everywhere: the same name can be used again.
    hvd.barrier()
    result = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="forgotten")
    assert torch.equal(result, torch.full((2,), float(size)))


# ---------------------------------------------------------------------------------------
# poll / synchronize


def test_synchronize_returns_result_once(size: int) -> None:
    handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="sync_once")
    assert isinstance(handle, int)
    result = hvd.synchronize(handle)
    assert torch.equal(result, torch.full((3,), float(size)))
    assert hvd.synchronize(handle) is None


def test_synchronize_unknown_handle_returns_none() -> None:
    assert hvd.synchronize(987654321) is None
    assert hvd.synchronize(-1) is None


def test_poll_unknown_or_consumed_handle_raises(size: int) -> None:
    with pytest.raises(ValueError):
        hvd.poll(987654321)
    handle = hvd.allreduce_async(torch.ones(1), name="poll_consumed")
    hvd.synchronize(handle)
    with pytest.raises(ValueError):
        hvd.poll(handle)


def test_poll_becomes_true_and_does_not_consume(size: int) -> None:
    handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="poll_true")
    while not hvd.poll(handle):
        pass
    assert hvd.poll(handle) is True
    result = hvd.synchronize(handle)
    assert torch.equal(result, torch.full((3,), float(size)))


def test_async_is_really_async(rank: int, size: int) -> None:
    tensors = [torch.full((1024,), float(rank)) for _ in range(15)]
    handles = []
    not_done_at_submission = []
    for i, tensor in enumerate(tensors):
        handle = hvd.allreduce_async(tensor, op=hvd.Sum, name=f"really_async.{i}")
        not_done_at_submission.append(not hvd.poll(handle))
        handles.append(handle)
    assert any(not_done_at_submission), "not an async op?"
    expected = torch.full((1024,), float(sum(range(size))))
    for handle in handles:
        assert torch.equal(hvd.synchronize(handle), expected)


def test_synchronize_in_reverse_order(rank: int, size: int) -> None:
    handles = [
        hvd.allreduce_async(torch.full((i + 1,), float(rank)), op=hvd.Sum, name=f"rev.{i}")
        for i in range(6)
    ]
    for i in reversed(range(6)):
        result = hvd.synchronize(handles[i])
        assert torch.equal(result, torch.full((i + 1,), float(sum(range(size)))))


def test_every_async_variant_returns_its_output(rank: int, size: int) -> None:
    tensor = torch.full((size, 2), float(rank))
    total = float(sum(range(size)))
    in_place = tensor.clone()
    handles = {
        "allreduce": hvd.allreduce_async(tensor, op=hvd.Sum, name="v.ar"),
        "allreduce_": hvd.allreduce_async_(in_place, op=hvd.Sum, name="v.ar_"),
        "allgather": hvd.allgather_async(tensor, name="v.ag"),
        "broadcast": hvd.broadcast_async(tensor, size - 1, name="v.bc"),
        "alltoall": hvd.alltoall_async(tensor, name="v.a2a"),
        "reducescatter": hvd.reducescatter_async(tensor, op=hvd.Sum, name="v.rs"),
    }
    assert torch.equal(hvd.synchronize(handles["allreduce"]), torch.full((size, 2), total))
    assert hvd.synchronize(handles["allreduce_"]) is in_place
    assert torch.equal(in_place, torch.full((size, 2), total))
    gathered = hvd.synchronize(handles["allgather"])
    assert torch.equal(gathered, torch.cat([torch.full((size, 2), float(r)) for r in range(size)]))
    assert torch.equal(hvd.synchronize(handles["broadcast"]), torch.full((size, 2), size - 1.0))
    received, splits = hvd.synchronize(handles["alltoall"])
    assert torch.equal(received, torch.tensor([[float(r)] * 2 for r in range(size)]))
    assert splits.tolist() == [1] * size
    assert torch.equal(hvd.synchronize(handles["reducescatter"]), torch.full((1, 2), total))


# ---------------------------------------------------------------------------------------
# Barrier


def test_exit_barrier_among_survivors_does_not_wait_for_a_gone_rank(
    rank: int, size: int
) -> None:
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        pytest.skip("the MPI control plane needs mpirun")
    from mpi4py import MPI

    from baguahvd.backends.mpi.control import MPIControlPlane

    control = MPIControlPlane(MPI.COMM_WORLD)
    gone = size - 1
    if rank != gone:
        # The gone rank never calls it (a barrier of the whole communicator would wait
        # for it), and rank 0 calls it last.
        if rank == 0:
            time.sleep(0.3)
        assert control.exit_barrier(10, list(range(gone)))
    MPI.COMM_WORLD.Barrier()


def test_barrier(size: int) -> None:
    for _ in range(3):
        hvd.barrier()
    _world_still_works(size, "barrier")


def test_barrier_with_outstanding_async_ops(rank: int, size: int) -> None:
    tensor = torch.full((5,), float(rank))
    total = float(sum(range(size)))
    reduce_handle = hvd.allreduce_async(tensor, op=hvd.Sum, name="barrier.ar")
    broadcast_handle = hvd.broadcast_async(tensor, 0, name="barrier.bc")
    gather_handle = hvd.allgather_async(tensor, name="barrier.ag")
    hvd.barrier()
    assert torch.equal(hvd.synchronize(reduce_handle), torch.full((5,), total))
    assert torch.equal(hvd.synchronize(broadcast_handle), torch.zeros(5))
    assert torch.equal(
        hvd.synchronize(gather_handle),
        torch.cat([torch.full((5,), float(r)) for r in range(size)]),
    )


def test_barrier_with_handles_never_synchronized(rank: int, size: int) -> None:
    # Horovod's suite leaves these handles behind; init() in the next test forgets them.
    hvd.broadcast_async(torch.full((2,), float(rank)), 0, name="abandoned.bc")
    hvd.allgather_async(torch.full((2,), float(rank)), name="abandoned.ag")
    hvd.barrier()
    _world_still_works(size, "abandoned")


def test_positional_arguments_average_name_op(rank: int, size: int) -> None:
    tensor = torch.IntTensor([rank, rank + 1])
    hvd.allreduce_(tensor, None, "positional", hvd.Sum)
    total = sum(range(size))
    assert tensor.tolist() == [total, total + size]


# ---------------------------------------------------------------------------------------
# Join


def test_join_alone_returns_same_rank_everywhere(rank: int, size: int) -> None:
    last = hvd.join()
    assert isinstance(last, int) and 0 <= last < size
    assert hvd.allgather_object(last, name="join_alone") == [last] * size
    _world_still_works(size, "join_alone")


def test_join_accepts_a_device(rank: int, size: int) -> None:
    last = hvd.join(hvd.local_rank())
    assert hvd.allgather_object(last, name="join_device") == [last] * size


@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached"])
def test_join_early_rank_contributes_zeros(rank: int, size: int, cached: bool) -> None:
    first = size - 1
    floats = torch.full((4, 3), float(rank + 1))
    ints = torch.full((5,), 3 * (rank + 1), dtype=torch.int32)
    others = [r for r in range(size) if r != first]
    float_sum = float(sum(r + 1 for r in others))
    int_sum = sum(3 * (r + 1) for r in others)
    if cached:
        # Put the names in the response cache before the join.
        full = hvd.allreduce(floats, op=hvd.Sum, name="join.sum")
        assert torch.equal(full, torch.full((4, 3), float(sum(range(1, size + 1)))))
        hvd.allreduce(floats, name="join.avg")
        hvd.allreduce(ints, name="join.int_avg")
    if rank == first:
        last = hvd.join()
    else:
        for _ in range(3):
            summed = hvd.allreduce(floats, op=hvd.Sum, name="join.sum")
            assert torch.equal(summed, torch.full((4, 3), float_sum))
            averaged = hvd.allreduce(floats, name="join.avg")
            # Average divides by the full size, joined ranks included.
            assert torch.allclose(averaged, torch.full((4, 3), float_sum / size))
            int_averaged = hvd.allreduce(ints, name="join.int_avg")
            expected_int = torch.full((5,), int(int_sum / size), dtype=torch.int32)
            assert torch.equal(int_averaged, expected_int)
            handles = [
                hvd.allreduce_async(torch.full((2,), float(rank + 1)), op=hvd.Sum,
                                    name=f"join.fused.{i}")
                for i in range(4)
            ]
            for handle in handles:
                assert torch.equal(hvd.synchronize(handle), torch.full((2,), float_sum))
        last = hvd.join()
    # The early rank joined first, so someone else joined last.
    assert last != first
    assert 0 <= last < size
    assert hvd.allgather_object(last, name=f"join_result.{cached}") == [last] * size
    _world_still_works(size, f"join.{cached}")


def test_join_grouped_allreduce(rank: int, size: int) -> None:
    first = 0
    others = [r for r in range(size) if r != first]
    if rank == first:
        last = hvd.join()
    else:
        results = hvd.grouped_allreduce(
            [torch.full((i + 1,), float(rank)) for i in range(3)], op=hvd.Sum, name="join.group"
        )
        for i, result in enumerate(results):
            assert torch.equal(result, torch.full((i + 1,), float(sum(others))))
        last = hvd.join()
    assert last != first
    assert hvd.allgather_object(last, name="join_group_result") == [last] * size


def test_other_collectives_fail_while_a_rank_has_joined(rank: int, size: int) -> None:
    first = size - 1
    tensor = torch.full((size, 2), float(rank))
    if rank == first:
        last = hvd.join()
    else:
        with pytest.raises(hvd.HorovodInternalError,
                           match="Allgather is not supported with Join at this time."):
            hvd.allgather(tensor, name="joined.ag")
        with pytest.raises(hvd.HorovodInternalError,
                           match="Broadcast is not supported with Join at this time."):
            hvd.broadcast(tensor, 0, name="joined.bc")
        with pytest.raises(hvd.HorovodInternalError,
                           match="Alltoall is not supported with Join at this time."):
            hvd.alltoall(tensor, name="joined.a2a")
        with pytest.raises(hvd.HorovodInternalError,
                           match="Reducescatter is not supported with Join at this time."):
            hvd.reducescatter(tensor, name="joined.rs")
        # Allreduce still works while joined.
        summed = hvd.allreduce(tensor, op=hvd.Sum, name="joined.ar")
        assert torch.equal(summed, torch.full((size, 2), float(sum(range(first)))))
        last = hvd.join()
    assert last != first
    assert hvd.allgather_object(last, name="joined_result") == [last] * size
    # After everybody joined, the collectives work again.
    gathered = hvd.allgather(tensor, name="joined.ag")
    assert torch.equal(gathered, torch.cat([torch.full((size, 2), float(r)) for r in range(size)]))
    _world_still_works(size, "after_join")


def test_join_repeatedly(rank: int, size: int) -> None:
    for round_ in range(3):
        first = round_ % size
        if rank == first:
            last = hvd.join()
        else:
            summed = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"rejoin.{round_}")
            assert torch.equal(summed, torch.full((2,), float(size - 1)))
            last = hvd.join()
        assert last != first
        assert hvd.allgather_object(last, name=f"rejoin_result.{round_}") == [last] * size
