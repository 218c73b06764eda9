"""``baguahvdrun``'s Open MPI TCP setting: ``-mca btl_tcp_flags send`` across hosts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import pytest

from baguahvd.runner import cli
from baguahvd.runner.mpirun import build_command

MPIRUN = "/opt/mpi/bin/mpirun"


@pytest.fixture(autouse=True)
def _plain_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)


def build(
    argv: Sequence[str], env: Mapping[str, str] | None = None, major: int | None = 5
) -> list[str]:
    args = cli.parse_args(list(argv))
    command, _ = build_command(args, dict(env or {}), mpirun=MPIRUN, open_mpi_major=major)
    return command


def test_open_mpi_5_across_hosts_sends_plainly() -> None:
    command = build(["-np", "2", "-H", "node1:1,node2:1", "python", "train.py"])
    i = command.index("btl_tcp_flags")
    assert command[i - 1 : i + 2] == ["-mca", "btl_tcp_flags", "send"]
    assert command.index("btl_tcp_flags") < command.index("python")
    # One remote host still talks over TCP (to this machine's mpirun, and between ranks).
    assert "btl_tcp_flags" in build(["-np", "2", "-H", "node1:2", "python"])


@pytest.mark.parametrize(
    ("argv", "env", "major"),
    [
        (["-np", "2", "python"], {}, 5),  # one machine: shared memory
        (["-np", "2", "-H", "localhost:1,127.0.0.1:1", "python"], {}, 5),
        (["-np", "2", "-H", "node1:1,node2:1", "python"], {}, 4),  # no put protocol issue
        (["-np", "2", "-H", "node1:1,node2:1", "python"], {}, None),  # unknown version
        (["-np", "2", "-H", "node1:1,node2:1", "--open-mpi-tcp-defaults", "python"], {}, 5),
        (["-np", "2", "-H", "node1:1,node2:1", "python"], {"OMPI_MCA_btl_tcp_flags": "9"}, 5),
    ],
)
def test_left_out(argv: list[str], env: dict[str, str], major: int | None) -> None:
    assert "btl_tcp_flags" not in build(argv, env, major)


def test_the_users_own_setting_wins() -> None:
    command = build(["-np", "2", "-H", "node1:1,node2:1", "--mpi-args",
                     "--mca btl_tcp_flags 7", "python"])
    assert command.count("btl_tcp_flags") == 1
    assert command[command.index("btl_tcp_flags") + 1] == "7"
