"""Which data plane the job's CPU collectives run on, and that MPI's negotiation and
gloo's data plane work together (run with BAGUAHVD_CPU_BACKEND=gloo under mpirun by
tests/e2e/test_parallel.py; on MPI alone it checks the default)."""

from __future__ import annotations

import os

import torch

import baguahvd.torch as hvd
from baguahvd.backends import gloo
from baguahvd.common.ops import ReduceOp
from baguahvd.runtime.runtime import runtime
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
