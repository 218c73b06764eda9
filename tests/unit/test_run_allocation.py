"""Hosts from a batch system's allocation: Slurm, PBS, LSF and Open MPI default host files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from baguahvd.runner import cli
from baguahvd.runner.allocation import (
    MPI_HOSTFILE_VARIABLES,
    detect_allocation,
    expand_slurm_counts,
    expand_slurm_nodelist,
    parse_lsf_mcpu_hosts,
)
from baguahvd.runner.elastic.settings import ElasticSettings
from baguahvd.runner.hosts import Host, LaunchError
from baguahvd.runner.mpirun import build_command

MPIRUN = "/opt/mpi/bin/mpirun"


@pytest.fixture(autouse=True)
def _plain_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for name in (
        *MPI_HOSTFILE_VARIABLES,
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "PBS_NODEFILE",
        "LSB_MCPU_HOSTS",
        "LSB_DJOB_HOSTFILE",
    ):
        monkeypatch.delenv(name, raising=False)


def hosts_of(env: Mapping[str, str]) -> list[tuple[str, int]]:
    allocation = detect_allocation(env)
    assert allocation is not None
    return [(host.name, host.slots) for host in allocation.hosts]


def build(argv: list[str], env: Mapping[str, str]) -> list[str]:
    command, _ = build_command(cli.parse_args(argv), env, mpirun=MPIRUN)
    return command


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[8-11],login1", ["a8", "a9", "a10", "a11", "login1"]),
        ("gpu-[001-002],cpu[1]", ["gpu-001", "gpu-002", "cpu1"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("n1.cluster,n2.cluster", ["n1.cluster", "n2.cluster"]),
    ],
)
def test_slurm_nodelist(text: str, names: list[str]) -> None:
    assert expand_slurm_nodelist(text) == names


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node[01-03", "'[' without ']'"),
        ("node01]", "']' without '['"),
        ("node[a-b]", "is not a number or a range"),
        ("node[5-3]", "runs backwards"),
        ("node1,,node2", "empty host name"),
        ("", "empty host name"),
    ],
)
def test_bad_slurm_nodelist(text: str, message: str) -> None:
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST") as error:
        expand_slurm_nodelist(text)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), (" 8(x1) ", [8])],
)
def test_slurm_counts(text: str, counts: list[int]) -> None:
    assert expand_slurm_counts(text) == counts


@pytest.mark.parametrize("text", ["2(3)", "x", "0", "2(x0)", "2,", "-1"])
def test_bad_slurm_counts(text: str) -> None:
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_slurm_counts(text)


def test_slurm_allocation() -> None:
    env = {"SLURM_JOB_NODELIST": "node[01-03],gpu7", "SLURM_TASKS_PER_NODE": "2(x3),4"}
    assert hosts_of(env) == [("node01", 2), ("node02", 2), ("node03", 2), ("gpu7", 4)]
    env = {"SLURM_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "16(x2)"}
    assert hosts_of(env) == [("n1", 16), ("n2", 16)]


def test_slurm_tasks_per_node_wins_over_cpus() -> None:
    env = {
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_JOB_CPUS_PER_NODE": "32(x2)",
    }
    assert hosts_of(env) == [("n1", 1), ("n2", 1)]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_JOB_NODELIST": "n[1-2]"}, "neither SLURM_TASKS_PER_NODE nor"),
        (
            {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"},
            "SLURM_TASKS_PER_NODE='2(x2)' counts 2 nodes but SLURM_JOB_NODELIST='n[1-3]' "
            "lists 3",
        ),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_CPUS_PER_NODE": "x"}, "SLURM_JOB_CPUS_PER_NODE"),
    ],
)
def test_bad_slurm_allocation(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match="SLURM") as error:
        detect_allocation(env)
    assert message in str(error.value)


def test_pbs_nodefile(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1\ncn1\ncn2\n\ncn1\ncn3\n")
    assert hosts_of({"PBS_NODEFILE": str(nodefile)}) == [("cn1", 3), ("cn2", 1), ("cn3", 1)]


def test_bad_pbs_nodefile(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="cannot read PBS_NODEFILE="):
        detect_allocation({"PBS_NODEFILE": str(tmp_path / "missing")})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(LaunchError, match="PBS_NODEFILE lists no hosts"):
        detect_allocation({"PBS_NODEFILE": str(empty)})


def test_lsf_mcpu_hosts(tmp_path: Path) -> None:
    assert parse_lsf_mcpu_hosts("hostA 4 hostB 2") == (Host("hostA", 4), Host("hostB", 2))
    assert hosts_of({"LSB_MCPU_HOSTS": "a 1 b 3 a 1"}) == [("a", 2), ("b", 3)]
    hostfile = tmp_path / "djob"
    hostfile.write_text("a\na\nb\n")
    assert hosts_of({"LSB_DJOB_HOSTFILE": str(hostfile)}) == [("a", 2), ("b", 1)]
    both = {"LSB_MCPU_HOSTS": "c 8", "LSB_DJOB_HOSTFILE": str(hostfile)}
    assert hosts_of(both) == [("c", 8)]


@pytest.mark.parametrize("text", ["hostA", "hostA four", "hostA 0", "a 1 b"])
def test_bad_lsf_mcpu_hosts(text: str) -> None:
    with pytest.raises(LaunchError, match="LSB_MCPU_HOSTS="):
        detect_allocation({"LSB_MCPU_HOSTS": text})


@pytest.mark.parametrize(
    "variable",
    [
        "OMPI_MCA_orte_default_hostfile",
        "OMPI_MCA_prte_default_hostfile",
        "PRTE_MCA_prte_default_hostfile",
    ],
)
def test_mpi_default_hostfile(variable: str, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(
        "job-worker-0.job-worker.ns.svc slots=2\njob-worker-1.job-worker.ns.svc slots=2\n"
    )
    assert hosts_of({variable: str(hostfile)}) == [
        ("job-worker-0.job-worker.ns.svc", 2),
        ("job-worker-1.job-worker.ns.svc", 2),
    ]


def test_bad_mpi_default_hostfile(tmp_path: Path) -> None:
    variable = "OMPI_MCA_orte_default_hostfile"
    with pytest.raises(LaunchError, match=f"^{variable}: cannot read --hostfile"):
        detect_allocation({variable: str(tmp_path / "missing")})
    bad = tmp_path / "bad"
    bad.write_text("w0 slots=two\n")
    with pytest.raises(LaunchError, match=f"^{variable}: .*slots 'two' is not an integer"):
        detect_allocation({variable: str(bad)})


def test_no_allocation() -> None:
    assert detect_allocation({}) is None
    assert detect_allocation({"SLURM_JOB_NODELIST": "", "PBS_NODEFILE": ""}) is None


def test_mpi_hostfile_comes_before_slurm(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0 slots=1\n")
    env = {
        "OMPI_MCA_orte_default_hostfile": str(hostfile),
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_TASKS_PER_NODE": "4",
    }
    assert hosts_of(env) == [("w0", 1)]


SLURM = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def test_np_takes_hosts_from_the_allocation() -> None:
    command = build(["-np", "3", "python"], SLURM)
    assert option(command, "-H") == "node01:2,node02:2" and option(command, "-np") == "3"
    command = build(["python"], SLURM)
    assert option(command, "-np") == "4"


def test_explicit_hosts_win_over_the_allocation(tmp_path: Path) -> None:
    assert option(build(["-np", "2", "-H", "localhost:2", "python"], SLURM), "-H") == (
        "localhost:2"
    )
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h9 slots=2\n")
    assert option(build(["-np", "2", "--hostfile", str(hostfile), "python"], SLURM), "-H") == (
        "h9:2"
    )


def test_too_few_slots_in_the_allocation() -> None:
    with pytest.raises(LaunchError, match=r"needs 5 slots but the Slurm \(SLURM_JOB_NODELIST"):
        build(["-np", "5", "python"], SLURM)


def test_main_reports_a_bad_allocation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1")
    assert cli.main(["-np", "1", "python"]) == 2
    assert "SLURM_JOB_NODELIST='node[01-': '[' without ']'" in capsys.readouterr().err


def test_elastic_fixed_hosts_from_the_allocation() -> None:
    args = cli.parse_args(["--elastic", "-np", "2", "python"])
    settings = ElasticSettings.from_args(args, SLURM)
    assert settings.fixed_hosts == (Host("node01", 2), Host("node02", 2))
