"""Which data plane the job's CPU collectives run on, and that MPI's negotiation and
gloo's data plane work together (run with BAGUAHVD_CPU_BACKEND=gloo under mpirun by
tests/e2e/test_parallel.py; on MPI alone it checks the default)."""

from __future__ import annotations

import os

import torch

import baguahvd.torch as hvd
from baguahvd.backends import gloo
from baguahvd.common.ops import ReduceOp
from baguahvd.runtime.state import runtime
from baguahvd.runtime.transport import Transport

SPLIT = "OMPI_COMM_WORLD_SIZE" in os.environ and os.environ.get("BAGUAHVD_CPU_BACKEND") == "gloo"


def test_transport_follows_the_setting() -> None:
    if SPLIT:
        assert runtime.transport is Transport.MPI_GLOO
        assert hvd.mpi_enabled() and not hvd.gloo_enabled()
    elif "OMPI_COMM_WORLD_SIZE" in os.environ:
        # One machine: auto keeps MPI (shared memory).
        assert runtime.transport is Transport.MPI


def test_process_set_communicators(rank: int, size: int) -> None:
    engine = runtime.require_engine()
    ranks = list(range(0, size, 2)) if size > 2 else [0, 1]
    process_set = runtime.internal_process_set(ranks)
    if rank in ranks:
        total = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="data_plane.set",
                              process_set=process_set)
        assert total.item() == sum(ranks)
        comm = engine.process_sets[process_set.process_set_id].comm
        if SPLIT:
            assert isinstance(comm, gloo.TwinnedCommunicator)
            assert gloo.twin_of(comm).size == len(ranks)


def test_private_communicator_of_a_background_thread(rank: int, size: int) -> None:
    private = runtime.new_communicator()
    assert private is not None
    if SPLIT:
        assert isinstance(private, gloo.GlooCommunicator)
    out = torch.zeros(3)
    request = private.iallreduce(torch.full((3,), float(rank + 1)), out, ReduceOp.SUM)
    while not request.test():
        pass
    assert out.tolist() == [float(size * (size + 1) // 2)] * 3
    private.free()


def test_small_and_large_allreduces_on_both_halves(rank: int, size: int) -> None:
    # Under the split data plane, allreduces up to 64 KiB run on the MPI twin and larger
    # ones on gloo; the results must not depend on which.
    limit = gloo.TwinnedCommunicator.twin_allreduce_bytes // 4
    for count in (1, limit, limit + 1, 4 * limit):
        for dtype in (torch.float32, torch.float16, torch.int64):
            def values(r: int, count: int = count, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.arange(count, dtype=torch.float64).add(r).to(dtype)

            total = hvd.allreduce(values(rank), op=hvd.Sum, name=f"halves.{count}.{dtype}")
            # Exact in float32 (float16 is reduced in float32 and rounded once).
            expected = sum(values(r).double() for r in range(size))
            assert torch.equal(total, expected.to(dtype)), (count, dtype)
        mean = hvd.allreduce(torch.full((count,), float(rank)), name=f"halves.mean.{count}")
        assert torch.allclose(mean, torch.full((count,), (size - 1) / 2))
        inplace = torch.full((count,), float(rank + 1))
        hvd.allreduce_(inplace, op=hvd.Max, name=f"halves.max.{count}")
        assert inplace.eq(float(size)).all()
