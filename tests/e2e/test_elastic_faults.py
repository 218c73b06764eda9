"""Faults injected into elastic commits, each with the guarantee it must keep.

* kill -9 at random moments of commit writes, synchronous and in the background: the
  newest intact commit loads afterwards, no completed commit is lost, and what loads is
  exactly what was committed;
* truncated, altered (4 KB overwritten) and planted files: refused with the file named,
  the newest intact commit is used, and a planted pickle never runs;
* a full disk (``ENOSPC`` at each write of a commit): the write fails with the error, and
  the previous commit stays whole;
* SIGSTOP of a rank in an elastic job: the job ends with the peer/stall error instead of
  hanging, and its last commit stays intact;
* end to end under ``baguahvdrun --elastic``: a damaged newest commit is refused and the
  job resumes from the one before, and a rank killed while its commit is written in the
  background resumes from an intact commit; both end with exactly the weights of an
  undisturbed run;
* in-process recovery (``baguahvdrun --gloo --elastic``): rank 0, the source of the state,
  killed in the middle of the in-process reset that follows another rank's kill -9; the
  job recovers in place again and ends with exactly the weights of an undisturbed run. And
  the survivor that went on alone killed in the reset where the new rank joins it, before
  passing on the state: the new rank resumes from the newest intact commit in the folder,
  not from its own initial state, and the job ends with every sample trained once an epoch
  and the same weights on every rank.

Every test adds to :data:`FIGURES`, printed at the end of the module (``-s``); README's
elastic section quotes them.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import multiprocessing
import os
import pathlib
import pickle
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from baguahvd.torch.elastic.store import CheckpointStore, CommitError
from baguahvd.torch.elastic.writer import CommitWriter
from tests.support.elastic_job import launch_training, run_training_ok
from tests.support.failing_jobs import FAST_FAILURE, STARTUP_SLACK_S, joined_logs, run_script

FIGURES: Counter[str] = Counter()
KILLS = 40
BACKGROUND_KILLS = 15
TENSOR_ELEMENTS = 1 << 20  # 4 MB payloads: a write takes long enough to be hit


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    print(
        "\nelastic faults: "
        + ", ".join(f"{key} {value}" for key, value in sorted(FIGURES.items()))
    )


# Built before any fork: a forked child must not start torch's thread pool (it can hang).
_BASE = torch.arange(TENSOR_ELEMENTS, dtype=torch.float32)


def _payload(number: int) -> dict[str, Any]:
    return {"n": number, "tag": torch.tensor([float(number)]), "w": _BASE}


def _check_payload(number: int, payload: dict[str, Any]) -> None:
    assert payload["n"] == number and payload["tag"].item() == number
    assert torch.equal(payload["w"], _BASE)


def _writer(folder: str, start: int, done: Any) -> None:
    store = CheckpointStore(folder, host="node-a")
    number = start
    done.send(-1)  # ready
    while True:
        number += 1
        store.write(number, _payload(number))
        done.send(number)


def _kill_writer(
    context: Any, target: Any, folder: str, completed: int, chooser: random.Random
) -> tuple[int, int]:
    """Starts ``target`` writing commits after ``completed`` in a child, kills it with
    SIGKILL at a random moment and loads the newest commit: the newest commit the child
    reported durable must be there, or the one it was writing (the next one for
    synchronous writes; a newer one in the background, which skips superseded commits).
    Returns the newest commit the child reported and the one loaded."""
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=target, args=(folder, completed, sender), daemon=True)
    child.start()
    sender.close()
    assert receiver.poll(60) and receiver.recv() == -1
    time.sleep(chooser.uniform(0.0, 0.15))
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join()
    while receiver.poll():
        try:
            completed = max(completed, receiver.recv())
        except EOFError:
            break
    receiver.close()
    FIGURES["faults injected"] += 1
    number, payload = CheckpointStore(folder, host="reader").load_newest()
    if target is _writer:
        assert number in (completed, completed + 1), (number, completed)
    else:
        assert number >= completed, (number, completed)
    _check_payload(number, payload)
    FIGURES["resumed"] += 1
    return completed, number


def test_kill_9_at_random_moments_of_commit_writes(tmp_path: pathlib.Path) -> None:
    context = multiprocessing.get_context("fork")
    chooser = random.Random(13)
    folder = str(tmp_path)
    CheckpointStore(folder, host="node-a").write(0, _payload(0))
    completed = 0
    lost = 0
    for _ in range(KILLS):
        completed, number = _kill_writer(context, _writer, folder, completed, chooser)
        lost += completed - number if number < completed else 0
        completed = max(completed, number)
    assert lost == 0
    # One more commit clears what the killed writers left behind.
    store = CheckpointStore(folder, host="node-a")
    store.write(completed + 1, _payload(completed + 1))
    assert len(os.listdir(folder)) == 5, os.listdir(folder)  # job.json, two commits
    FIGURES["completed commits lost"] += lost
    FIGURES["wrong results"] += 0
    assert completed > 0  # the kills did let writes finish in between


def _background_writer(folder: str, start: int, done: Any) -> None:
    writer = CommitWriter(CheckpointStore(folder, host="node-a"))
    number = start
    reported = start
    done.send(-1)  # ready
    while True:
        number += 1
        writer.submit(number, _payload(number))  # never waits: superseded ones are skipped
        if writer.durable > reported:
            reported = writer.durable
            done.send(reported)
        time.sleep(0.002)  # a training step


def test_kill_9_during_background_writes(tmp_path: pathlib.Path) -> None:
    context = multiprocessing.get_context("fork")
    chooser = random.Random(17)
    folder = str(tmp_path)
    CheckpointStore(folder, host="node-a").write(0, _payload(0))
    completed = 0
    for _ in range(BACKGROUND_KILLS):
        _, completed = _kill_writer(context, _background_writer, folder, completed, chooser)
    assert completed > 0
    writer = CommitWriter(CheckpointStore(folder, host="node-a"))
    writer.submit(completed + 1, _payload(completed + 1))
    writer.wait()
    assert len(os.listdir(folder)) == 5, os.listdir(folder)  # job.json, two commits


def _two_commits(folder: pathlib.Path) -> CheckpointStore:
    store = CheckpointStore(str(folder), host="node-a")
    store.write(1, {"w": torch.zeros(4096)})
    store.write(2, {"w": torch.ones(4096)})
    return store


def _damage_truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damage_overwrite(path: pathlib.Path) -> None:
    """Overwrites 4 KB in the middle (all of a smaller file), as a bad disk block would."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - 2048)
    end = min(len(data), start + 4096)
    data[start:end] = random.Random(5).randbytes(end - start)
    path.write_bytes(bytes(data))


def _damage_manifest(path: pathlib.Path) -> None:
    manifest = path.with_suffix(".json")
    manifest.write_text(manifest.read_text()[:40])


def _damage_manifest_number(path: pathlib.Path) -> None:
    manifest = path.with_suffix(".json")
    record = json.loads(manifest.read_text())
    record["commit"] = 7
    manifest.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_damage_truncate, "bytes, its manifest says"),
        (_damage_overwrite, "SHA-256 differs"),
        (_damage_manifest, "not a commit manifest|unreadable"),
        (_damage_manifest_number, "does not match its name"),
    ],
    ids=["truncated", "4KB-overwritten", "manifest-cut", "manifest-renumbered"],
)
def test_a_damaged_commit_is_refused_and_the_previous_one_loads(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, damage: Any, reason: str
) -> None:
    store = _two_commits(tmp_path)
    newest = tmp_path / "commit-2.node-a.pt"
    damage(newest)
    FIGURES["faults injected"] += 1
    with pytest.raises(CommitError, match=reason) as refused:
        store.read(2)
    assert "commit-2.node-a" in str(refused.value)
    with caplog.at_level(logging.WARNING):
        number, payload = CheckpointStore(str(tmp_path), host="reader").load_newest()
    assert number == 1 and torch.equal(payload["w"], torch.zeros(4096))
    assert "commit-2.node-a" in caplog.text
    assert any(part in caplog.text for part in reason.split("|"))
    FIGURES["resumed"] += 1
    FIGURES["commits lost to damage"] += 1


class _Trap:
    """Unpickling this creates ``path``: what a planted commit could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("forged_manifest", [False, True], ids=["bare", "forged-manifest"])
def test_a_planted_pickle_never_runs(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, forged_manifest: bool
) -> None:
    folder = tmp_path / "commits"
    store = _two_commits(folder)
    sentinel = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"w": _Trap(str(sentinel))}, buffer)
    planted = buffer.getvalue()
    (folder / "commit-99.node-a.pt").write_bytes(planted)
    (folder / "evil.pt").write_bytes(planted)
    if forged_manifest:
        # Whoever can write the folder can also compute a checksum: the safe load is what
        # stops the payload.
        import hashlib

        (folder / "commit-99.node-a.json").write_text(json.dumps({
            "format": 2, "job_id": store.job_id, "host": "node-a", "commit": 99,
            "payload": "commit-99.node-a.pt", "bytes": len(planted),
            "sha256": hashlib.sha256(planted).hexdigest(),
        }))
    FIGURES["faults injected"] += 1
    with caplog.at_level(logging.WARNING):
        number, payload = CheckpointStore(str(folder), host="reader").load_newest()
    assert number == 2 and torch.equal(payload["w"], torch.ones(4096))
    assert not sentinel.exists()
    assert "evil.pt" in caplog.text
    if forged_manifest:
        assert "holds more than tensors and plain values" in caplog.text
        with pytest.raises(CommitError, match="commit-99.node-a.pt"):
            store.read(99)
    else:
        assert "commit-99.node-a.pt: no manifest" in caplog.text
    assert not sentinel.exists()
    FIGURES["resumed"] += 1
    # The planted file is a real threat: an unsafe load would have run it.
    pickle.loads(pickle.dumps(_Trap(str(sentinel))))
    assert sentinel.exists()


@pytest.mark.parametrize("failing_write", [1, 2, 3])
def test_a_full_disk_fails_the_commit_and_keeps_the_previous_one(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, failing_write: int
) -> None:
    store = _two_commits(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    real_write = os.write
    calls = [0]

    def full_disk(descriptor: int, data: Any) -> int:
        calls[0] += 1
        if calls[0] >= failing_write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        # Short writes, as a nearly full disk gives them.
        return real_write(descriptor, bytes(data)[: max(1, len(data) // 2)])

    monkeypatch.setattr(os, "write", full_disk)
    FIGURES["faults injected"] += 1
    with pytest.raises(OSError) as failed:
        store.write(3, {"w": torch.full((4096,), 3.0)})
    monkeypatch.setattr(os, "write", real_write)
    assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial file left
    number, payload = store.load_newest()
    assert number == 2 and torch.equal(payload["w"], torch.ones(4096))
    FIGURES["resumed"] += 1
    store.write(3, {"w": torch.full((4096,), 3.0)})  # space again: commits go on
    assert store.load_newest()[0] == 3


_STOPPED_RANK = """
import dataclasses
from baguahvd.runtime.runtime import runtime

folder = os.environ["FOLDER"]
runtime.config = dataclasses.replace(runtime.config, elastic_dir=folder)
model = torch.nn.Linear(4, 2)
state = hvd.elastic.TorchState(model, None, step=0)


@hvd.elastic.run
def train(state):
    while True:
        state.step += 1
        hvd.allreduce(torch.ones(2), name="work")
        state.commit()
        if state.step == 3 and rank == 1:
            print("STOPPING", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


try:
    train(state)
except (PeerFailureError, StallError) as exc:
    print(f"ENDED {type(exc).__name__}", flush=True)
    raise
"""


@pytest.mark.parallel
def test_a_stopped_rank_ends_the_job_with_an_error_not_a_hang(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "commits"
    env = {**FAST_FAILURE, "BAGUAHVD_PEER_TIMEOUT_SECONDS": "3", "FOLDER": str(folder)}
    code, logs, elapsed = run_script(tmp_path, _STOPPED_RANK, np=2, env=env)
    dump = joined_logs(logs)
    FIGURES["faults injected"] += 1
    assert code != 0, dump
    assert "STOPPING" in logs[1], dump
    assert "ENDED PeerFailureError" in logs[0] or "ENDED StallError" in logs[0], dump
    assert elapsed < 3 + STARTUP_SLACK_S, dump
    number, payload = CheckpointStore(str(folder), host="reader").load_newest()
    assert number >= 3 and payload["objects"]["step"] == number, dump
    FIGURES["resumed"] += 1


@pytest.mark.parallel
def test_a_job_resumes_past_a_damaged_commit_with_exact_weights(tmp_path: pathlib.Path) -> None:
    reference, _ = run_training_ok(["--elastic", "-np", "2"], tmp_path, tmp_path / "reference.pt")
    folder = tmp_path / "commits"
    args = ["--elastic", "-np", "2", "--checkpoint-dir", str(folder)]
    # Killed at step 9 with no restart left: commit 3 (step 8) is on disk, and before it
    # commit 2 (step 6) or, where commit 3 came while commit 1's write still ran and the
    # writer went on to the newest, commit 1 (step 4).
    steps = {1: 4, 2: 6, 3: 8}
    failed = launch_training(
        [*args, "--max-restarts", "0"],
        tmp_path,
        {"KILL_RANK": "1", "KILL_STEP": "9", "OUT": str(tmp_path / "never.pt")},
    )
    assert failed.returncode != 0
    newest = sorted(folder.glob("commit-3.*.pt"))
    assert len(newest) == 1, sorted(folder.iterdir())
    older = [n for n in (1, 2) if list(folder.glob(f"commit-{n}.*.pt"))]
    assert older, sorted(folder.iterdir())
    _damage_overwrite(newest[0])
    FIGURES["faults injected"] += 1
    resumed, output = run_training_ok(args, tmp_path, tmp_path / "resumed.pt")
    assert f"{newest[0]} is damaged" in output, output
    assert f"launch 0: rank 1 of 2 starts at step {steps[max(older)]}" in output, output
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    FIGURES["resumed"] += 1
    FIGURES["steps redone"] += steps[3] - steps[max(older)]


@pytest.mark.parallel
def test_a_rerun_on_a_finished_folder_trains_again(tmp_path: pathlib.Path) -> None:
    args = ["--elastic", "-np", "2", "--checkpoint-dir", str(tmp_path / "commits")]
    first, _ = run_training_ok(args, tmp_path, tmp_path / "first.pt")
    second, output = run_training_ok(args, tmp_path, tmp_path / "second.pt")
    assert "finished training at commit" in output and "starting afresh" in output, output
    assert "launch 0: rank 0 of 2 starts at step 0" in output, output
    assert first["steps"] == second["steps"] == 18
    for name, tensor in first["model"].items():
        assert torch.equal(tensor, second["model"][name]), name


@pytest.mark.parallel
def test_a_rank_killed_during_a_background_write_resumes_from_an_intact_commit(
    tmp_path: pathlib.Path,
) -> None:
    # The ballast, 16 MB of zeros that training leaves alone, makes a write take a while.
    reference, _ = run_training_ok(["--elastic", "-np", "2"], tmp_path, tmp_path / "reference.pt")
    folder = tmp_path / "commits"
    # Commit 3 is at step 8: rank 0, which writes the host's commits, dies while it is
    # being written; commit 2 (step 6) is durable.
    killed, output = run_training_ok(
        ["--elastic", "-np", "2", "--max-restarts", "1", "--checkpoint-dir", str(folder)],
        tmp_path,
        tmp_path / "killed.pt",
        env={"BALLAST": str(4 << 20), "KILL_IN_WRITE_STEP": "8"},
    )
    assert "killing rank 0 during the write of commit 3" in output, output
    assert (
        "launch 1: rank 1 of 2 starts at step 6" in output
        or "launch 1: rank 1 of 2 starts at step 8" in output  # the write won the race
    ), output
    assert "damaged" not in output and "falling back" not in output, output
    FIGURES["faults injected"] += 1
    assert killed["steps"] == 18
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, killed["model"][name]), name
    # The killed writer's leftovers are gone: the host's last two commits remain.
    assert len(list(folder.glob("commit-*.pt"))) == 2
    assert not list(folder.glob(".commit-*"))
    FIGURES["resumed"] += 1


@pytest.mark.parallel
def test_a_rank_killed_during_an_in_process_reset_recovers_in_place_again(
    tmp_path: pathlib.Path,
) -> None:
    args = ["--gloo", "--elastic", "-np", "3"]
    # Unfused, three ranks sum every gradient in the same order in every run.
    unfused = {"HOROVOD_FUSION_THRESHOLD": "0"}
    reference, _ = run_training_ok(args, tmp_path, tmp_path / "reference.pt", unfused)
    folder = tmp_path / "commits"
    # Rank 2 dies at step 9 (the last commit is at step 8); in the reset to round 1, rank 0
    # (kept, and the rank every other syncs from) dies in its reset callback, before the
    # sync: round 2 forms from the one survivor left and two new ranks.
    killed, output = run_training_ok(
        [*args, "--checkpoint-dir", str(folder)],
        tmp_path,
        tmp_path / "killed.pt",
        env={**unfused, "KILL_RANK": "2", "KILL_STEP": "9", "KILL_IN_RESET_RANK": "0"},
    )
    assert "killing rank 0 during the reset to round 1" in output, output
    assert "round 2: rank 0 (status 137) failed (restart 2 of 3); 2 ranks kept, 1 started" in (
        output
    ), output
    assert "launch 2" not in output, output
    FIGURES["faults injected"] += 2
    assert killed["steps"] == 12 and killed["sizes"] == [3] * 12
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, killed["model"][name]), name
    assert not list(folder.glob(".commit-*")) and not list(folder.glob("round-request.*"))
    FIGURES["resumed"] += 1
    FIGURES["steps redone"] += 9 - 8


@pytest.mark.parallel
def test_the_only_holder_of_the_state_killed_while_a_new_rank_joins_resumes_from_the_folder(
    tmp_path: pathlib.Path,
) -> None:
    # Rank 1 dies at step 9; rank 0 goes on alone from the commit at step 8 and waits at
    # its commit at step 12 for the new process to be ready; in the reset to round 2, where
    # it joins, rank 0 dies before the sync. The new process, holding no state, is alone.
    folder = tmp_path / "commits"
    out = tmp_path / "joined.pt"
    result = launch_training(
        ["--gloo", "--elastic", "-np", "2", "--min-np", "1", "--checkpoint-dir", str(folder)],
        tmp_path,
        {"KILL_RANK": "1", "KILL_STEP": "9", "JOIN_AT_COMMIT": "2", "KILL_IN_RESET_RANK": "0",
         "KILL_IN_RESET_ROUND": "2", "EVERY_RANK": "1", "OUT": str(out)},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "killing rank 0 during the reset to round 2" in output, output
    assert "no rank of this round holds the job's state" in output, output
    assert (
        "[1]<stdout>:launch 0: rank 0 of 1 starts at step 12" in output
        or "[1]<stdout>:launch 0: rank 0 of 1 starts at step 8" in output  # write unfinished
    ), output
    assert "launch 2" not in output, output
    FIGURES["faults injected"] += 2
    finals = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob("joined.pt.*"))]
    assert finals, output
    for final in finals:
        # Three epochs of 96 samples, 8 per rank a step: each sample once an epoch.
        assert 8 * sum(final["sizes"]) == 3 * 96, final["sizes"]
        for name, tensor in finals[0]["model"].items():
            assert torch.equal(tensor, final["model"][name]), name
    assert not list(folder.glob(".commit-*")) and not list(folder.glob("round-re*"))
    FIGURES["resumed"] += 1
