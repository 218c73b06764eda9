"""A collective that fails its local checks on one rank still takes its place.

The failing rank raises its own error at once; the other ranks' matching collective raises
``HorovodInternalError`` naming that rank and its error, and every later unnamed collective
pairs with the same collective on every rank (never a wrong value, never a stall).
"""

from __future__ import annotations

import time

import pytest
import torch

import baguahvd.torch as hvd

BAD = 1
"""The rank whose call fails its local checks."""

REASON = r"rank 1 failed its local checks: ValueError: Tensor type torch.BoolTensor is not " \
    r"supported\."


def test_unnamed_collectives_stay_paired_after_a_local_failure(rank: int, size: int) -> None:
    # The case: rank 1 catches the error and goes on; without a placeholder its next
    # allreduce would pair with the others' first one.
    hvd.barrier()
    if rank == BAD:
        with pytest.raises(ValueError, match="Tensor type torch.BoolTensor is not supported"):
            hvd.allreduce(torch.zeros(1, dtype=torch.bool), op=hvd.Sum)
    else:
        with pytest.raises(hvd.HorovodInternalError, match=REASON) as info:
            hvd.allreduce(torch.tensor([100.0]), op=hvd.Sum)
        assert "allreduce.noname." in str(info.value)
    for step in range(3):
        result = hvd.allreduce(torch.tensor([float(step + rank)]), op=hvd.Sum)
        assert result.item() == size * step + sum(range(size))


def test_async_local_failure_then_paired(rank: int, size: int) -> None:
    hvd.barrier()
    if rank == BAD:
        with pytest.raises(ValueError, match="op parameter supersedes average"):
            hvd.allreduce_async(torch.ones(2), average=True, op=hvd.Sum)
    else:
        handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
        with pytest.raises(hvd.HorovodInternalError, match="rank 1 failed its local checks"):
            hvd.synchronize(handle)
    gathered = hvd.allgather(torch.tensor([float(rank)]))
    assert gathered.tolist() == [float(r) for r in range(size)]


def test_a_bad_broadcast_root_takes_its_place(rank: int, size: int) -> None:
    hvd.barrier()
    root = size if rank == BAD else 0
    if rank == BAD:
        with pytest.raises(ValueError, match="invalid root rank"):
            hvd.broadcast(torch.ones(2), root_rank=root)
    else:
        with pytest.raises(hvd.HorovodInternalError, match="rank 1 failed its local checks"):
            hvd.broadcast(torch.ones(2), root_rank=root)
    assert hvd.broadcast(torch.tensor([float(rank)]), root_rank=0).item() == 0.0


def test_a_named_local_failure_fails_the_others_promptly(rank: int, size: int) -> None:
    hvd.barrier()
    start = time.monotonic()
    if rank == BAD:
        with pytest.raises(ValueError, match="not supported"):
            hvd.allreduce(torch.zeros(1, dtype=torch.bool), name="named_local_failure")
    else:
        with pytest.raises(hvd.HorovodInternalError, match=REASON) as info:
            hvd.allreduce(torch.ones(1), name="named_local_failure")
        assert "allreduce.named_local_failure" in str(info.value)
        # Not a stall: negotiation answers within a few cycles.
        assert time.monotonic() - start < 10.0
    result = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after.named_local_failure")
    assert torch.equal(result, torch.full((3,), float(size)))


def test_a_local_failure_on_a_cached_name_is_not_answered_from_the_cache(
    rank: int, size: int
) -> None:
    for _ in range(3):
        result = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="cached_local_failure")
        assert torch.equal(result, torch.full((2,), float(size)))
    if rank == BAD:
        with pytest.raises(ValueError, match="contiguous"):
            hvd.allreduce(torch.ones(2, 3).t(), op=hvd.Sum, name="cached_local_failure")
    else:
        with pytest.raises(hvd.HorovodInternalError, match="rank 1 failed its local checks"):
            hvd.allreduce(torch.ones(2), op=hvd.Sum, name="cached_local_failure")
    result = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="cached_local_failure")
    assert torch.equal(result, torch.full((2,), float(size)))


def test_a_named_in_place_async_call_that_fails_takes_its_name(rank: int, size: int) -> None:
    # allreduce_async_ places its own failures (it is not wrapped): the others' call of the
    # same name fails naming this rank, and the name is free again for the retry.
    hvd.barrier()
    if rank == BAD:
        with pytest.raises(ValueError, match="contiguous"):
            hvd.allreduce_async_(torch.ones(4, 2).t(), None, "grad.w", hvd.Sum)
    else:
        handle = hvd.allreduce_async_(torch.ones(2, 4), name="grad.w", op=hvd.Sum)
        with pytest.raises(hvd.HorovodInternalError, match="rank 1 failed its local checks: "
                           "ValueError: Tensor is required to be contiguous") as info:
            hvd.synchronize(handle)
        assert "allreduce.grad.w" in str(info.value)
    retried = hvd.synchronize(hvd.allreduce_async_(torch.ones(2, 4), name="grad.w", op=hvd.Sum))
    assert retried.eq(size).all()
