"""A unique id made by the real NCCL travels to every rank and reaches the real
``NcclCommunicator``'s argument check as the type it takes, over both carriers: MPI (jobs
under mpirun) and the job's store (jobs on gloo). Past that check ncclCommInitRank needs a
GPU, so on a machine without one each rank gets NCCL's own error there, never a TypeError.

Skips where CuPy is not installed (CI installs it).
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch.distributed as dist
from mpi4py import MPI

from baguahvd.backends import nccl_setup
from baguahvd.backends.gloo import StoreIdChannel
from baguahvd.kernels import cupy_api

real_nccl = pytest.importorskip("cupy.cuda.nccl")


def _reaches_the_device_boundary(raw: bytes, size: int, rank: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(real_nccl.NcclError):
            cupy_api.new_communicator(real_nccl, size, raw, rank)


def _same_everywhere(raw: bytes) -> None:
    views = MPI.COMM_WORLD.allgather(raw)
    assert all(view == views[0] for view in views)
    assert isinstance(raw, bytes) and len(raw) == cupy_api.UNIQUE_ID_BYTES


def test_the_id_travels_over_mpi(rank: int, size: int) -> None:
    comm = MPI.COMM_WORLD.Dup()
    try:
        watch = nccl_setup._Watch("the MPI id exchange", 60.0, None)
        raw = nccl_setup.exchange_unique_id(comm, rank, real_nccl, watch)
    finally:
        comm.Free()
    _same_everywhere(raw)
    _reaches_the_device_boundary(raw, size, rank)


def test_the_id_travels_through_the_store(rank: int, size: int) -> None:
    world = MPI.COMM_WORLD
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False) if (
        rank == 0
    ) else None
    port = world.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout, wait_for_workers=False)
    channel = StoreIdChannel(dist.PrefixStore("job/", store), rank, size, "nccl-unique-id/1")
    watch = nccl_setup._Watch("the store id exchange", 60.0, None)
    raw = nccl_setup.exchange_unique_id(channel, rank, real_nccl, watch)
    _same_everywhere(raw)
    _reaches_the_device_boundary(raw, size, rank)
    # The host of the store leaves last.
    world.Barrier()
