"""torchrun's elastic agent (``--max-restarts`` with a c10d rendezvous) restarting every
worker after one dies: with ``BAGUAHVD_ELASTIC_DIR`` set, the restarted workers resume from
the last commit and end with the weights of a run that nothing disturbed."""

from __future__ import annotations

import pathlib
import socket

import pytest
import torch

from tests.e2e.test_gloo_launch import assert_ok, torchrun
from tests.support import jobs

TIMEOUT_S = 240
JOB = "tests/e2e/torchrun_elastic_job.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(tmp_path: pathlib.Path, name: str, *args: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    scratch = tmp_path / f"{name}.tmp"
    scratch.mkdir()
    command = [
        *torchrun(), "--nnodes", "1:1", "--nproc-per-node", "2", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        JOB, str(out), *args,
    ]
    env = {"TMPDIR": str(scratch), "BAGUAHVD_ELASTIC_DIR": str(tmp_path / f"{name}.commits")}
    [result] = jobs.run_commands([command], jobs.ROOT, TIMEOUT_S, [env])
    assert_ok(result)
    return [torch.load(out / f"rank.{rank}.pt") for rank in range(2)]


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_restarted_workers_resume_from_the_last_commit(tmp_path: pathlib.Path) -> None:
    undisturbed = _run(tmp_path, "undisturbed")
    restarted = _run(tmp_path, "restarted", "--kill")
    for rank in range(2):
        assert undisturbed[rank]["attempt"] == 0 and undisturbed[rank]["starts"] == [0]
        # Rank 1 died after step 5, the last commit was step 4: the agent's second attempt
        # starts there on both ranks (or at step 2, should the agent have stopped rank 0
        # while it was still writing step 4's commit: that commit is then not on disk).
        assert restarted[rank]["attempt"] == 1
        assert restarted[rank]["starts"] == restarted[0]["starts"]
    assert restarted[0]["starts"] in ([4], [2])
    for rank in range(2):
        for key, weight in undisturbed[0]["weights"].items():
            assert torch.equal(restarted[rank]["weights"][key], weight), (rank, key)
