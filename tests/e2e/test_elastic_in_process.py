"""In-process recovery end to end: ``baguahvdrun --gloo --elastic`` with a rank killed by
SIGKILL (the store's host, rank 0, included) and with a host added while the job runs.

The survivors keep their processes: they restore the last in-memory commit, meet the rank
started for the lost slot in a new round, and sync from rank 0. The job must finish with
exactly the weights of an uninterrupted run with the same seed. With ``--min-np 1`` the
survivor goes on alone instead, and the new rank joins at a later commit with the state as
committed.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from tests.support.elastic_job import launch_training, run_training_ok

# Three ranks sum in an order that depends on which gradients one cycle fuses; unfused,
# every run sums alike, and the weights can be compared bit for bit.
UNFUSED = {"HOROVOD_FUSION_THRESHOLD": "0"}


def _reference(tmp_path_factory: pytest.TempPathFactory, np: int) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp(f"reference{np}")
    result, _ = run_training_ok(
        ["--gloo", "--elastic", "-np", str(np)], folder, folder / "reference.pt", UNFUSED
    )
    return result


@pytest.fixture(scope="module")
def reference2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _reference(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def reference3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _reference(tmp_path_factory, 3)


def assert_same_weights(reference: dict[str, Any], result: dict[str, Any]) -> None:
    assert reference["steps"] == result["steps"]
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, result["model"][name]), name


@pytest.mark.parallel
def test_a_killed_rank_is_replaced_while_the_survivor_keeps_running(
    tmp_path: pathlib.Path, reference2: dict[str, Any]
) -> None:
    killed, output = run_training_ok(
        ["--gloo", "--elastic", "-np", "2", "--checkpoint-dir", str(tmp_path / "commits")],
        tmp_path,
        tmp_path / "killed.pt",
        env={"KILL_RANK": "1", "KILL_STEP": "9"},
    )
    assert "killing rank 1 at step 9" in output
    assert "round 1: rank 1 (status 137) failed (restart 1 of 3); 1 ranks kept, 1 started" in (
        output
    ), output
    # The process tagged [0] trains again from the commit at step 8: it was not restarted.
    assert "[0]<stdout>:launch 0: rank 0 of 2 starts at step 8" in output, output
    assert "launch 2" not in output
    assert killed["sizes"] == [2] * 18
    assert_same_weights(reference2, killed)


@pytest.mark.parallel
def test_the_survivor_goes_on_alone_and_the_replacement_joins_at_a_commit(
    tmp_path: pathlib.Path,
) -> None:
    out = tmp_path / "alone.pt"
    result = launch_training(
        ["--gloo", "--elastic", "-np", "2", "--min-np", "1"],
        tmp_path,
        {"KILL_RANK": "1", "KILL_STEP": "9", "JOIN_AT_COMMIT": "2", "EVERY_RANK": "1",
         "OUT": str(out)},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert (
        "round 1: rank 1 (status 137) failed (restart 1 of 3); 1 ranks kept, 0 started, "
        "1 to join when ready" in output
    ), output
    # Rank 0 goes on alone from the commit at step 8 without waiting for the new process,
    # which joins at the first commit after it is ready (the script waits for it at step
    # 12), with the lost process's local rank (tagged [1]) and the state as committed.
    assert "[0]<stdout>:launch 0: rank 0 of 1 starts at step 8" in output, output
    assert "round 2: 1 ranks ready to join; 1 ranks kept, 1 joined, 0 started" in output, output
    assert "[1]<stdout>:launch 0: rank 1 of 2 starts at step 12" in output, output
    assert "launch 2" not in output
    ranks = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]
    # Every sample of the three epochs once: 96 / 16 a step at two ranks, 96 / 8 alone.
    assert ranks[0]["sizes"] == [2] * 8 + [1] * 4 + [2] * 8, ranks[0]["sizes"]
    assert ranks[1]["sizes"] == ranks[0]["sizes"] and ranks[1]["steps"] == 20
    assert ranks[0]["lr"] == ranks[1]["lr"] == pytest.approx(0.02)
    for name, tensor in ranks[0]["model"].items():
        assert torch.equal(tensor, ranks[1]["model"][name]), name


@pytest.mark.parallel
def test_the_store_host_rank_0_killed_recovers_in_place(
    tmp_path: pathlib.Path, reference3: dict[str, Any]
) -> None:
    killed, output = run_training_ok(
        ["--gloo", "--elastic", "-np", "3"],
        tmp_path,
        tmp_path / "killed.pt",
        env={**UNFUSED, "KILL_RANK": "0", "KILL_STEP": "9"},
    )
    assert "round 1: rank 0 (status 137) failed (restart 1 of 3); 2 ranks kept, 1 started" in (
        output
    ), output
    # The former rank 1 is rank 0 of round 1 and the state's source; the new process is
    # rank 2 with local rank 0 (tagged [0]), the lost process's local rank (its GPU).
    assert "[1]<stdout>:launch 0: rank 0 of 3 starts at step 8" in output, output
    assert "[0]<stdout>:launch 0: rank 2 of 3 starts at step 8" in output, output
    assert_same_weights(reference3, killed)


@pytest.mark.parallel
def test_an_added_host_joins_the_running_job(tmp_path: pathlib.Path) -> None:
    discovered = tmp_path / "discovered.txt"
    discovered.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {discovered}\n")
    discover.chmod(0o755)
    grown, output = run_training_ok(
        ["--gloo", "--host-discovery-script", str(discover), "-np", "2", "--max-np", "3"],
        tmp_path,
        tmp_path / "grown.pt",
        env={
            "GROW_AT_STEP": "5",
            "DISCOVERED": str(discovered),
            "BAGUAHVD_ELASTIC_POLL_SECONDS": "0.1",
        },
    )
    assert "round 1: the hosts changed; 2 ranks kept, 1 started" in output, output
    assert "[0]<stdout>:launch 0: rank 0 of 3 starts at step 6" in output, output
    assert "launch 2" not in output
    assert grown["sizes"] == [2] * 6 + [3] * 8, grown["sizes"]
    assert grown["lr"] == pytest.approx(0.03)  # the reset callback saw the new size


# Both ranks may share one GPU. NCCL refuses two ranks of a communicator on one device of
# one host, so each process names a host of its own (the script appends its worker id to
# NCCL_HOSTID) and NCCL talks over sockets on loopback; a rank started in a new round gets
# a new id. "gloo-staged" runs the GPU collectives on gloo through host memory.
_GPU_PATHS = {
    "nccl": {
        "NCCL_HOSTID": "elastic",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
    },
    "gloo-staged": {"HOROVOD_GPU_OPERATIONS": "gloo"},
}


@pytest.mark.cuda
@pytest.mark.parallel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", sorted(_GPU_PATHS))
def test_a_killed_rank_on_gpus_is_replaced_in_place(tmp_path: pathlib.Path, path: str) -> None:
    env = {**_GPU_PATHS[path], "DEVICE": "cuda"}
    args = ["--gloo", "--elastic", "-np", "2"]
    reference, _ = run_training_ok(args, tmp_path, tmp_path / "reference.pt", env)
    killed, output = run_training_ok(
        args, tmp_path, tmp_path / "killed.pt", {**env, "KILL_RANK": "1", "KILL_STEP": "9"}
    )
    assert "1 ranks kept, 1 started" in output, output
    assert "[0]<stdout>:launch 0: rank 0 of 2 starts at step 8" in output, output
    assert_same_weights(reference, killed)
