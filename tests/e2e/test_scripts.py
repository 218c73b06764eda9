"""Whole scripts under ``mpirun -np 2``: behaviour that spans a rank's lifetime.

Each script prints a marker when it reaches its end; the test checks the markers in the
per-rank logs that ``launch`` collects.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from tests.support.jobs import launch

TIMEOUT_S = 60

_PEER_LEAVES = """
import sys
import time

import pytest
import torch

import baguahvd.torch as hvd

hvd.init()
assert hvd.size() == 2
warm = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="warmup")
assert warm.tolist() == [2.0, 2.0]
if hvd.rank() == 1:
    if "{how}" == "shutdown":
        hvd.shutdown()
        assert not hvd.is_initialized()
    print("RANK1_LEAVING", flush=True)
    sys.exit(0)

start = time.monotonic()
# Submitted while (or after) the peer shuts down: fails instead of waiting forever.
with pytest.raises(hvd.HorovodInternalError, match="has been shut down"):
    hvd.allreduce(torch.ones(2), name="pending_when_peer_left")
# Anything submitted later fails at once.
with pytest.raises(hvd.HorovodInternalError, match="has been shut down"):
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="after_peer_left"))
with pytest.raises(hvd.HorovodInternalError, match="has been shut down"):
    hvd.barrier()
elapsed = time.monotonic() - start
assert elapsed < 10, elapsed
print(f"SHUTDOWN_DETECTED after {{elapsed:.2f}} s", flush=True)
"""

_NAMED_OUT_OF_ORDER = """
import time

import torch

import baguahvd.torch as hvd

hvd.init()
rank = hvd.rank()
# Each rank first submits the name the other one submits last, then waits: both requests
# stall until the second submission, and are matched by name, not by order.
first, second = ("a", "b") if rank == 0 else ("b", "a")
handles = {{first: hvd.allreduce_async(torch.full((3,), float(rank + 1)), op=hvd.Sum,
                                       name=first)}}
time.sleep(2.5)
handles[second] = hvd.allreduce_async(torch.full((3,), float(rank + 1)), op=hvd.Sum,
                                      name=second)
for name in ("a", "b"):
    assert hvd.synchronize(handles[name]).tolist() == [3.0, 3.0, 3.0], name
print("NAMED_OUT_OF_ORDER_OK", flush=True)
"""

_SUB_WORLDS = """
import pytest
import torch
from mpi4py import MPI

import baguahvd.torch as hvd

world_rank = MPI.COMM_WORLD.Get_rank()
members = [0, 2] if world_rank != 1 else [1]
if "{how}" == "list":
    if world_rank == 1:
        with pytest.raises(ValueError, match="not in the list"):
            hvd.init(comm=[0, 2])
        assert not hvd.is_initialized()
    hvd.init(comm=members)
else:
    sub = MPI.COMM_WORLD.Split(0 if world_rank != 1 else 1, world_rank)
    hvd.init(comm=sub)
    assert hvd.global_process_set.mpi_comm is sub
# Ranks 0 and 2 form one baguahvd world, rank 1 another.
assert hvd.size() == len(members)
assert hvd.rank() == members.index(world_rank)
assert hvd.global_process_set.ranks == list(range(len(members)))
summed = hvd.allreduce(torch.full((2,), float(world_rank)), op=hvd.Sum, name="sub")
assert summed.tolist() == [float(sum(members))] * 2
gathered = hvd.allgather(torch.full((1,), float(world_rank)), name="sub")
assert gathered.tolist() == [float(r) for r in members]
print("SUB_WORLD_OK", flush=True)
"""


def _script(tmp_path: pathlib.Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parallel
@pytest.mark.parametrize("how", ["shutdown", "exit"])
def test_peer_leaving_makes_collectives_fail_fast(tmp_path: pathlib.Path, how: str) -> None:
    script = _script(tmp_path, "peer_leaves.py", _PEER_LEAVES.format(how=how))
    result = launch([script], 2, tmp_path, TIMEOUT_S)
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr}\n{output}"
    assert "RANK1_LEAVING" in output, output
    assert "SHUTDOWN_DETECTED" in output, output


@pytest.mark.parallel
@pytest.mark.parametrize("stall_check", ["on", "disabled"])
def test_stall_warning_then_named_requests_match(
    tmp_path: pathlib.Path, stall_check: str
) -> None:
    script = _script(tmp_path, "named_out_of_order.py", _NAMED_OUT_OF_ORDER.format())
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}
    if stall_check == "disabled":
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    result = launch([script], 2, tmp_path, TIMEOUT_S, extra_env=env)
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr}\n{output}"
    assert output.count("NAMED_OUT_OF_ORDER_OK") == 2, output
    rank0 = output.split("===== rank 1 =====")[0]
    if stall_check == "on":
        # Rank 0 coordinates, so it reports which ranks have not submitted which name.
        assert "Missing ranks" in rank0, output
        assert "allreduce.a: [1]" in rank0 and "allreduce.b: [0]" in rank0, output
    else:
        assert "Missing ranks" not in output, output


@pytest.mark.parallel
@pytest.mark.parametrize("how", ["list", "comm"])
def test_init_on_part_of_the_job(tmp_path: pathlib.Path, how: str) -> None:
    script = _script(tmp_path, "sub_worlds.py", _SUB_WORLDS.format(how=how))
    result = launch([script], 3, tmp_path, TIMEOUT_S)
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr}\n{output}"
    assert output.count("SUB_WORLD_OK") == 3, output
