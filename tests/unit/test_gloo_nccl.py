"""CUDA tensors of gloo jobs (torchrun, ``--gloo``, horovodrun --gloo) go through NCCL: the
device communicator of a gloo process set is an NCCL communicator whose unique id the set's
first rank publishes in the job's store. Run against the fake CuPy, two ranks as threads
over one in-process store."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from baguahvd.backends import gloo
from baguahvd.backends import nccl as backend
from baguahvd.backends.gloo import GlooCommunicator, StoreIdChannel
from baguahvd.common.config import Config
from baguahvd.common.ops import ReduceOp
from tests.fakes.fake_cupy import FakeCupy, installed

pytestmark = pytest.mark.bookkeeping

DEVICE = torch.device("cuda", 0)


def _member(store: object, rank: int, size: int) -> GlooCommunicator:
    group = SimpleNamespace(rank=lambda: rank, size=lambda: size)
    return GlooCommunicator(group, dist.PrefixStore("data/0-1/0/", store))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    return installed(monkeypatch, DEVICE)


def test_a_gloo_sets_device_communicator_is_nccl() -> None:
    member = _member(dist.HashStore(), 0, 2)
    device_comm = gloo.device_communicator(member)
    assert isinstance(device_comm, backend.NCCLCommunicator)
    assert (device_comm.rank, device_comm.size) == (0, 2)
    # Asked for, gloo carries CUDA tensors itself.
    assert gloo.host_staged_communicator(member) is member


def test_the_unique_id_travels_through_the_store(fake: FakeCupy) -> None:
    store = dist.HashStore()
    comms = [gloo.device_communicator(_member(store, rank, 2)) for rank in range(2)]
    errors: list[BaseException] = []

    def first_collective(comm: backend.NCCLCommunicator) -> None:
        try:
            token = torch.zeros(1)
            comm.allreduce(token, token, ReduceOp.SUM)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    # The second rank waits in the store until the first publishes the id.
    threads = [threading.Thread(target=first_collective, args=(comm,)) for comm in comms[::-1]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    created = [entry for entry in fake.log if entry[0] == "NcclCommunicator"]
    assert sorted(entry[3] for entry in created) == [0, 1]
    ids = {entry[2] for entry in created}
    assert len(ids) == 1 and isinstance(next(iter(ids)), bytes)
    assert [entry for entry in fake.log if entry[0] == "get_unique_id"] == [("get_unique_id",)]


def test_each_device_communicator_of_a_set_has_its_own_key() -> None:
    member = _member(dist.HashStore(), 1, 3)
    first, second = member.id_channel(), member.id_channel()
    assert first.key != second.key
    poll = second.start_unique_id(None)
    assert poll() is None
    member.store.set(second.key, b"x" * 128)
    assert poll() == b"x" * 128


def test_a_rank_that_never_gets_the_id_times_out(fake: FakeCupy) -> None:
    comm = backend.NCCLCommunicator(StoreIdChannel(dist.HashStore(), 1, 2, "k"), timeout_s=0.3)
    token = torch.zeros(1)
    with pytest.raises(backend.NCCLTimeoutError, match="exchange of the NCCL unique id"):
        comm.allreduce(token, token, ReduceOp.SUM)


def test_gpu_operations_setting() -> None:
    assert Config.from_env({}).gpu_operations == "nccl"
    assert Config.from_env({"HOROVOD_GPU_OPERATIONS": "GLOO"}).gpu_operations == "gloo"
    with pytest.raises(ValueError, match="GPU_OPERATIONS"):
        Config.from_env({"BAGUAHVD_GPU_OPERATIONS": "mpi"})
