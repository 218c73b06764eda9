"""``baguahvdrun -H lt0:1,lt1:1`` across two emulated hosts: network namespaces on a bridge.

``benchmarks/emulated_cluster.sh --keep`` builds the hosts (namespaces ``lt0``/``lt1`` with
``eth0`` on a bridge in ``ltctl``, each with its own host name) and an rsh agent that runs
a command inside a host's namespace, in place of ssh. The launcher then runs on ``lt0``, as
a batch script runs on the first node of its allocation, with ``--network-interfaces eth0``
and ``--tcp``; the ranks report the host they ran on and an allreduce of their ranks.
Needs root, ``ip netns``, ``tc`` and ``unshare``; skipped otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "emulated_cluster.sh"
PREFIX = "lt"
SUBNET = "10.79.0"
RANK_PROGRAM = (
    "import socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
    "print('rank', c.rank, 'of', c.size, 'on', socket.gethostname(), "
    "'sum', c.allreduce(c.rank + 1), flush=True)"
)


def _skip_unless_namespaces_work() -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"ip netns does not work here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=False)


def _cleanup() -> None:
    subprocess.run(
        ["bash", str(SCRIPT), "--cleanup-only", "--prefix", PREFIX, "--hosts", "2"],
        capture_output=True,
        check=False,
    )


@pytest.fixture
def cluster() -> Iterator[str]:
    """Sets up the emulated hosts; yields the rsh agent's path."""
    _skip_unless_namespaces_work()
    _cleanup()  # namespaces left by an interrupted earlier run
    setup = subprocess.run(
        ["bash", str(SCRIPT), "--keep", "--hosts", "2", "--prefix", PREFIX,
         "--subnet", SUBNET, "--rate", "unshaped"],
        capture_output=True, text=True, timeout=120,
    )
    agent_match = re.search(r"rsh agent for manual mpirun runs: (\S+)", setup.stderr)
    agent = agent_match.group(1) if agent_match else None
    try:
        assert setup.returncode == 0 and agent is not None, setup.stdout + setup.stderr
        yield agent
    finally:
        _cleanup()
        if agent is not None:
            shutil.rmtree(os.path.dirname(agent), ignore_errors=True)


def test_baguahvdrun_across_two_hosts(cluster: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        # Open MPI 5 reads the ssh agent from PRRTE's settings; Open MPI 4 from OMPI_MCA_.
        "PRTE_MCA_plm_ssh_agent": cluster,
        "OMPI_MCA_plm_rsh_agent": cluster,
    }
    launch = [
        "ip", "netns", "exec", f"{PREFIX}0", "unshare", "--uts", "sh", "-c",
        'hostname "$0"; exec "$@"', f"{PREFIX}0",
        sys.executable, "-m", "baguahvd.run", "--verbose",
        "-H", f"{PREFIX}0:1,{PREFIX}1:1", "--network-interfaces", "eth0", "--tcp",
        "--start-timeout", "60",
        sys.executable, "-c", RANK_PROGRAM,
    ]
    result = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == [
        f"rank 0 of 2 on {PREFIX}0 sum 3",
        f"rank 1 of 2 on {PREFIX}1 sum 3",
    ], output
    assert "btl_tcp_if_include eth0" in result.stderr  # the --verbose command line
