"""``baguahvdrun`` across three emulated hosts: network namespaces on a bridge.

``benchmarks/emulated_cluster.sh --keep`` builds the hosts (namespaces ``lt0``..``lt2`` with
``eth0`` on a bridge in ``ltctl``, each with its own host name) and an rsh agent that runs
a command inside a host's namespace, in place of ssh. The launcher then runs on ``lt0``, as
a batch script runs on the first node of its allocation, with ``--network-interfaces eth0``
and ``--tcp``. One job reports the host each rank ran on and an allreduce of the ranks; an
elastic job loses host ``lt2`` in the middle of training (its host discovery stops listing
it), shrinks to two ranks at its next commit and finishes with every step trained once.
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

from tests.support import jobs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "emulated_cluster.sh"
PREFIX = "lt"
HOSTS = 3
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
        ["bash", str(SCRIPT), "--cleanup-only", "--prefix", PREFIX, "--hosts", str(HOSTS)],
        capture_output=True,
        check=False,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Sets up the emulated hosts; yields the rsh agent's path."""
    _skip_unless_namespaces_work()
    _cleanup()  # namespaces left by an interrupted earlier run
    setup = subprocess.run(
        ["bash", str(SCRIPT), "--keep", "--hosts", str(HOSTS), "--prefix", PREFIX,
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


def _env(agent: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        # Open MPI 5 reads the ssh agent from PRRTE's settings; Open MPI 4 from OMPI_MCA_.
        "PRTE_MCA_plm_ssh_agent": agent,
        "OMPI_MCA_plm_rsh_agent": agent,
        "OMP_NUM_THREADS": "1",
    }


def _on_first_host(*command: str) -> list[str]:
    return [
        "ip", "netns", "exec", f"{PREFIX}0", "unshare", "--uts", "sh", "-c",
        'hostname "$0"; exec "$@"', f"{PREFIX}0", *command,
    ]


def test_baguahvdrun_across_three_hosts(cluster: str) -> None:
    hosts = ",".join(f"{PREFIX}{i}:1" for i in range(HOSTS))
    launch = _on_first_host(
        sys.executable, "-m", "baguahvd.run", "--verbose", "-H", hosts,
        "--network-interfaces", "eth0", "--tcp", "--start-timeout", "60",
        sys.executable, "-c", RANK_PROGRAM,
    )
    result = subprocess.run(launch, env=_env(cluster), capture_output=True, text=True,
                            timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = sorted(
        line for line in jobs.untagged(result.stdout).splitlines() if line.startswith("rank ")
    )
    assert lines == [f"rank {i} of {HOSTS} on {PREFIX}{i} sum 6" for i in range(HOSTS)], output
    assert "btl_tcp_if_include eth0" in result.stderr  # the --verbose command line


# 12 steps, a commit after each. At step 5 the job's host list loses lt2 (as a discovery
# script reports a host that left): the next commit ends the launch with the resize status,
# and the launcher relaunches on lt0 and lt1, which resume from that commit.
_ELASTIC_TRAIN = """
import os, socket, sys, time
import torch
import baguahvd.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)


@hvd.elastic.run
def train(state):
    while state.step < 12:
        x = torch.full((2, 4), float(state.step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        state.step += 1
        if state.step == 5 and hvd.size() == 3 and hvd.rank() == 0:
            with open(os.environ["HOSTS_FILE"], "w") as hosts:
                hosts.write("lt0:1\\nlt1:1\\n")
        if state.step >= 5 and hvd.size() == 3:
            # Leave the launcher's discovery poll time to see the change before training
            # ends, however loaded the machine is.
            time.sleep(1.0)
        state.commit()


train(state)
weights = hvd.allgather_object([p.detach().tolist() for p in model.parameters()])
print(f"DONE rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()} step {state.step} "
      f"same={all(w == weights[0] for w in weights)}", flush=True)
"""


def test_an_elastic_job_loses_a_host_and_finishes(cluster: str, tmp_path: Path) -> None:
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("".join(f"{PREFIX}{i}:1\n" for i in range(HOSTS)))
    discovery = tmp_path / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discovery.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(_ELASTIC_TRAIN)
    launch = _on_first_host(
        sys.executable, "-m", "baguahvd.run", "--host-discovery-script", str(discovery),
        "--min-np", "2", "--max-np", str(HOSTS), "--checkpoint-dir", str(tmp_path / "job"),
        "--network-interfaces", "eth0", "--tcp", "--start-timeout", "60",
        sys.executable, str(script),
    )
    env = {**_env(cluster), "HOSTS_FILE": str(hosts_file), "BAGUAHVD_ELASTIC_POLL_SECONDS": "0.2"}
    result = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "launch 1 on lt0:1,lt1:1,lt2:1 (3 ranks)" in result.stderr, output
    assert "relaunching on the new hosts" in result.stderr, output
    done = sorted(
        line for line in jobs.untagged(result.stdout).splitlines() if line.startswith("DONE")
    )
    assert done == [
        f"DONE rank {i} of 2 on {PREFIX}{i} step 12 same=True" for i in range(2)
    ], output
