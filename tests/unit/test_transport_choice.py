"""Which launcher started the process, and which transport ``init()`` takes for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from baguahvd.common.config import Config, Launch, launch_from_env
from baguahvd.runtime import transport
from baguahvd.runtime.transport import (
    Transport,
    auto_transport,
    check_joined,
    choose,
    fast_fabric_devices,
    mpi_is_tcp_only,
)

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


def test_horovod_rank_variables_next_to_torchruns_mean_torchruns_store() -> None:
    horovod_ranks = {k: v for k, v in HOROVODRUN_GLOO.items()
                     if not k.startswith("HOROVOD_GLOO_RENDEZVOUS")}
    assert launch_from_env({**TORCHRUN, **horovod_ranks}).launcher == "torchrun"
    assert launch_from_env({**TORCHRUN, **HOROVODRUN_GLOO}).launcher == "horovodrun-gloo"
    assert launch_from_env(horovod_ranks).launcher == "horovodrun-gloo"


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


def test_gloo_forced_under_mpirun_runs_gloo_beside_mpi() -> None:
    launch = launch_from_env({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    assert choose("gloo", launch, None) is Transport.MPI_GLOO
    assert choose("gloo", launch, [0, 1]) is Transport.MPI_GLOO
    assert choose("mpi", launch, None) is Transport.MPI
    # auto is settled after MPI has started (auto_transport), from MPI.
    assert choose("auto", launch, None) is Transport.MPI


def test_mpi_components_come_from_mpirun_mca_settings() -> None:
    launch = launch_from_env({
        "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self",
        "OMPI_MCA_btl_tcp_flags": "send",
    })
    assert launch.mpi_components == (("pml", "ob1"), ("btl", "tcp,self"))
    assert launch_from_env({"OMPI_COMM_WORLD_SIZE": "2"}).mpi_components == ()


@pytest.mark.parametrize(
    ("devices", "components", "tcp"),
    [
        ([], (), True),
        (["mlx5_0"], (), False),
        (["efa_0"], (), False),
        # mpirun restricted MPI to TCP: the RDMA device is not used.
        (["mlx5_0"], (("pml", "ob1"), ("btl", "tcp,self")), True),
        (["mlx5_0"], (("btl", "self,vader,tcp"),), True),
        # ... unless it is only excluded from a list that still has others.
        (["mlx5_0"], (("btl", "^openib"),), False),
        # A fabric PML or MTL asked for by name.
        ([], (("pml", "ucx"),), False),
        ([], (("mtl", "ofi"),), False),
        (["mlx5_0"], (("pml", "ucx"), ("btl", "tcp,self")), False),
    ],
)
def test_mpi_is_tcp_only(
    devices: list[str], components: tuple[tuple[str, str], ...], tcp: bool
) -> None:
    assert mpi_is_tcp_only(devices, components) is tcp


def test_fast_fabric_devices_lists_the_device_folders(tmp_path: Path) -> None:
    (tmp_path / "infiniband").mkdir()
    (tmp_path / "infiniband" / "mlx5_1").mkdir()
    (tmp_path / "infiniband" / "mlx5_0").mkdir()
    classes = (str(tmp_path / "infiniband"), str(tmp_path / "cxi"))
    assert fast_fabric_devices(classes) == ["mlx5_0", "mlx5_1"]
    assert fast_fabric_devices((str(tmp_path / "cxi"),)) == []


class _Answers:
    """A control plane stand-in: allgather_ints answers with every rank's given value."""

    def __init__(self, others: list[int]) -> None:
        self.others = others
        self.calls = 0

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        self.calls += 1
        return [list(values)] + [[v] for v in self.others]


def test_auto_takes_gloo_across_hosts_when_every_host_is_tcp_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "fast_fabric_devices", lambda: [])
    launch = launch_from_env({"OMPI_COMM_WORLD_SIZE": "4"})
    control = _Answers([1, 1, 1])
    assert auto_transport(True, launch, control) is Transport.MPI_GLOO  # type: ignore[arg-type]
    # One host with a fast fabric keeps every rank on MPI.
    assert auto_transport(True, launch, _Answers([1, 0, 1])) is Transport.MPI  # type: ignore[arg-type]
    # One host: shared memory, no question asked (nothing collective either).
    alone = _Answers([])
    assert auto_transport(False, launch, alone) is Transport.MPI  # type: ignore[arg-type]
    assert alone.calls == 0
    monkeypatch.setattr(transport, "fast_fabric_devices", lambda: ["mlx5_0"])
    assert auto_transport(True, launch, _Answers([1, 1, 1])) is Transport.MPI  # type: ignore[arg-type]


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
