"""Which launcher started the process, and which transport ``init()`` takes for it."""

from __future__ import annotations

import pytest

from baguahvd.common.config import Config, Launch, launch_from_env
from baguahvd.runtime.transport import Transport, check_joined, choose

TORCHRUN = {
    "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2",
}
HOROVODRUN_GLOO = {
    "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_HOSTNAME": "node2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321", "HOROVOD_CONTROLLER": "gloo",
    "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0",
}


def test_torchrun() -> None:
    launch = launch_from_env(TORCHRUN)
    assert launch.launcher == "torchrun"
    assert (launch.rank, launch.size, launch.local_rank, launch.local_size) == (1, 4, 1, 2)
    assert (launch.cross_rank, launch.cross_size) == (0, 2)
    assert (launch.store_host, launch.store_port) == ("10.0.0.1", 29500)
    assert launch.store_hosted_by_agent and launch.restart == 2
    assert choose("auto", launch, None) is Transport.GLOO


def test_horovodrun_gloo() -> None:
    launch = launch_from_env(HOROVODRUN_GLOO)
    assert launch.launcher == "horovodrun-gloo"
    assert (launch.rank, launch.size, launch.local_rank, launch.local_size) == (3, 4, 1, 2)
    assert (launch.cross_rank, launch.cross_size) == (1, 2)
    assert (launch.rendezvous_host, launch.rendezvous_port) == ("10.0.0.9", 4321)
    assert launch.interface == "eth0"
    assert choose("auto", launch, None) is Transport.GLOO
    assert Config.from_env(HOROVODRUN_GLOO).cpu_backend == "gloo"


def test_mpirun_stays_mpi_even_with_other_variables() -> None:
    launch = launch_from_env({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                              **TORCHRUN})
    assert launch.launcher == "mpi"
    assert choose("auto", launch, None) is Transport.MPI
    assert launch_from_env({"PMIX_RANK": "0"}).launcher == "mpi"


def test_alone_and_forced_choices() -> None:
    alone = launch_from_env({})
    assert alone.launcher is None and alone.size == 1
    assert choose("auto", alone, None) is Transport.MPI
    assert choose("gloo", alone, None) is Transport.GLOO
    assert choose("mpi", launch_from_env(TORCHRUN), None) is Transport.MPI
    # A communicator or rank list given to init() means MPI.
    assert choose("auto", launch_from_env(TORCHRUN), [0, 1]) is Transport.MPI


def test_gloo_forced_under_mpirun_is_refused_not_run_alone() -> None:
    launch = launch_from_env({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    with pytest.raises(ValueError, match=r"asks for gloo.*OMPI_COMM_WORLD_SIZE.*alone"):
        choose("gloo", launch, None)


def test_cpu_backend_setting() -> None:
    assert Config.from_env({}).cpu_backend == "auto"
    assert Config.from_env({"BAGUAHVD_CPU_BACKEND": "GLOO"}).cpu_backend == "gloo"
    assert Config.from_env({"BAGUAHVD_CPU_BACKEND": "mpi",
                            "HOROVOD_CONTROLLER": "gloo"}).cpu_backend == "mpi"
    with pytest.raises(ValueError, match="BAGUAHVD_CPU_BACKEND='nccl'"):
        Config.from_env({"BAGUAHVD_CPU_BACKEND": "nccl"})


def test_a_job_of_several_ranks_never_trains_alone() -> None:
    launch = launch_from_env(TORCHRUN)
    with pytest.raises(ValueError, match=r"RANK, WORLD_SIZE.*4 ranks.*MPI started"):
        check_joined(launch, Transport.MPI, 1)
    check_joined(launch, Transport.GLOO, 4)
    check_joined(Launch(), Transport.MPI, 1)
    with pytest.raises(ValueError, match="not a whole number"):
        launch_from_env({"RANK": "x", "WORLD_SIZE": "2"})
