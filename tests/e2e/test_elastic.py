"""Elastic training end to end: ``baguahvdrun --elastic`` with a rank killed by SIGKILL in
the middle of an epoch, and with a host added while the job runs.

The killed job must finish with exactly the weights of an uninterrupted run with the same
seed: it resumes from its last commit, so no step is lost and none is applied twice.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.support.elastic_job import launch_training, run_training_ok


@pytest.mark.parallel
def test_killed_rank_resumes_from_last_commit_with_identical_weights(
    tmp_path: pathlib.Path,
) -> None:
    reference, _ = run_training_ok(["--elastic", "-np", "2"], tmp_path, tmp_path / "reference.pt")
    # Step 9 is in the middle of the second epoch; the last commit before it is step 8.
    killed, output = run_training_ok(
        [
            "--elastic",
            "-np",
            "2",
            "--max-restarts",
            "2",
            "--checkpoint-dir",
            str(tmp_path / "commits"),
        ],
        tmp_path,
        tmp_path / "killed.pt",
        env={"KILL_RANK": "1", "KILL_STEP": "9"},
    )
    assert "killing rank 1 at step 9" in output
    assert "launch 1: rank 1 of 2 starts at step 8" in output, output
    assert "restart 1 of 2" in output, output
    assert reference["steps"] == killed["steps"] == 18
    assert killed["sizes"] == [2] * 18
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, killed["model"][name]), name
    # The commits stay in the folder the user named: the host's last two, with manifests.
    assert len(list((tmp_path / "commits").glob("commit-*.pt"))) == 2
    assert len(list((tmp_path / "commits").glob("commit-*.json"))) == 2
    assert (tmp_path / "commits" / "finished.json").exists()


@pytest.mark.parallel
def test_killed_rank_without_restarts_left_fails_the_job(tmp_path: pathlib.Path) -> None:
    result = launch_training(
        ["--elastic", "-np", "2", "--max-restarts", "0"],
        tmp_path,
        env={"KILL_RANK": "0", "KILL_STEP": "3", "OUT": str(tmp_path / "never.pt")},
    )
    assert result.returncode != 0
    assert not (tmp_path / "never.pt").exists()
    # The launcher keeps the job's elastic state for a resume, and says where.
    [kept] = (tmp_path / "tmp").glob("baguahvd-elastic-*")
    assert f"--checkpoint-dir {kept}" in result.stdout + result.stderr


@pytest.mark.parallel
def test_added_host_resizes_the_job_at_the_next_commit(tmp_path: pathlib.Path) -> None:
    discovered = tmp_path / "discovered.txt"
    discovered.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {discovered}\n")
    discover.chmod(0o755)
    # Growing at step 5: the next commit (step 6, end of epoch 0) stops the job, and the
    # relaunch runs the remaining 12 steps' worth of samples on three ranks.
    grown, output = run_training_ok(
        ["--host-discovery-script", str(discover), "-np", "2", "--max-np", "3"],
        tmp_path,
        tmp_path / "grown.pt",
        env={
            "GROW_AT_STEP": "5",
            "DISCOVERED": str(discovered),
            "BAGUAHVD_ELASTIC_POLL_SECONDS": "0.1",
        },
    )
    assert "launch 1: rank 2 of 3 starts at step 6" in output, output
    # 96 samples an epoch: 6 steps of 16 on two ranks, then 4 steps of 24 on three.
    assert grown["sizes"] == [2] * 6 + [3] * 8, grown["sizes"]
    assert grown["lr"] == pytest.approx(0.03)  # the reset callback saw the new size
