"""The elastic folder: commit files, their cleanup, and the launcher's host notice."""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib

import pytest
import torch

from baguahvd.common.config import Config
from baguahvd.torch.elastic.store import CheckpointStore, CommitError, HostUpdateResult


def _names(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "job.json")


def test_a_host_keeps_its_two_newest_commits(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    assert store.newest() == -1 and store.load_newest() == (-1, None)
    for number in (1, 2, 3):
        store.write(number, {"w": torch.full((2,), float(number))})
    assert _names(tmp_path) == [
        "commit-2.node-a.json", "commit-2.node-a.pt", "commit-3.node-a.json", "commit-3.node-a.pt"
    ]
    assert torch.equal(store.read(3)["w"], torch.full((2,), 3.0))
    number, payload = store.load_newest()
    assert number == 3 and torch.equal(payload["w"], torch.full((2,), 3.0))


def test_the_manifest_names_job_host_number_and_digest(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(4, {"step": 4})
    manifest = json.loads((tmp_path / "commit-4.node-a.json").read_text())
    data = (tmp_path / "commit-4.node-a.pt").read_bytes()
    job = json.loads((tmp_path / "job.json").read_text())
    assert manifest == {
        "format": 2,
        "job_id": job["job_id"],
        "host": "node-a",
        "commit": 4,
        "payload": "commit-4.node-a.pt",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_every_store_of_a_folder_shares_one_job_id(tmp_path: pathlib.Path) -> None:
    ids = {CheckpointStore(str(tmp_path), host=f"h{i}").job_id for i in range(5)}
    assert len(ids) == 1


def test_commits_of_other_hosts_are_seen_and_kept(tmp_path: pathlib.Path) -> None:
    CheckpointStore(str(tmp_path), host="node-b").write(5, "from b")
    mine = CheckpointStore(str(tmp_path), host="node-a")
    for number in (2, 3, 4, 6):
        mine.write(number, f"from a, {number}")
    assert _names(tmp_path) == [
        "commit-4.node-a.json", "commit-4.node-a.pt", "commit-5.node-b.json",
        "commit-5.node-b.pt", "commit-6.node-a.json", "commit-6.node-a.pt",
    ]
    assert mine.newest() == 6 and mine.read(5) == "from b"


def test_a_write_cut_short_leaves_the_previous_commit(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(3, "complete")
    # What a rank killed while writing leaves behind: temporary files, or a payload whose
    # manifest was never written.
    (tmp_path / ".commit-abc123").write_bytes(b"\x80\x02trunc")
    (tmp_path / "commit-4.node-a.pt").write_bytes(b"\x80\x02trunc")
    assert store.newest() == 3 and store.load_newest() == (3, "complete")


def test_values_a_safe_load_would_refuse_are_refused_when_written(
    tmp_path: pathlib.Path,
) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, "kept")
    with pytest.raises(TypeError, match=r"commit\['objects'\]\['f'\] is a builtins.function"):
        store.write(2, {"objects": {"f": lambda: None}})
    assert _names(tmp_path) == ["commit-1.node-a.json", "commit-1.node-a.pt"]


def test_plain_values_and_optimizer_state_round_trip(tmp_path: pathlib.Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    payload = {
        "optimizer": optimizer.state_dict(),
        "plain": [None, True, 3, 2.5, 1j, "s", b"b", (1, 2), {3}, torch.float16, torch.Size([2])],
    }
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, payload)
    loaded = store.read(1)
    assert loaded["plain"] == payload["plain"]
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(loaded["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_damaged_commit_is_refused_naming_the_file_and_the_previous_one_is_used(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, {"w": torch.zeros(2000)})
    store.write(2, {"w": torch.ones(2000)})
    payload = tmp_path / "commit-2.node-a.pt"
    data = bytearray(payload.read_bytes())
    data[100:110] = b"\0" * 10
    payload.write_bytes(bytes(data))
    with pytest.raises(CommitError, match=f"{payload}.*SHA-256"):
        store.read(2)
    with caplog.at_level(logging.WARNING):
        number, loaded = store.load_newest()
    assert number == 1 and torch.equal(loaded["w"], torch.zeros(2000))
    assert str(payload) in caplog.text


def test_files_of_other_jobs_and_unknown_names_are_ignored_with_a_warning(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    CheckpointStore(str(tmp_path / "other"), host="node-a").write(9, "other job")
    for name in ("commit-9.node-a.pt", "commit-9.node-a.json"):
        (tmp_path / name).write_bytes((tmp_path / "other" / name).read_bytes())
    (tmp_path / "notes.txt").write_text("hello")
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(2, "mine")
    with caplog.at_level(logging.WARNING):
        assert store.load_newest() == (2, "mine")
    assert "commit-9.node-a.json: written by job" in caplog.text
    assert "notes.txt: not a file of this job" in caplog.text
    assert "other: not a file of this job" in caplog.text


def test_host_names_are_made_safe_for_file_names(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="gpu-1.cluster/x")
    store.write(1, 0)
    assert _names(tmp_path) == ["commit-1.gpu-1_cluster_x.json", "commit-1.gpu-1_cluster_x.pt"]


def test_finished_mark_and_a_fresh_start(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, "a")
    assert store.finished() is None
    store.mark_finished(1)
    assert CheckpointStore(str(tmp_path), host="node-b").finished() == 1
    old = store.job_id
    store.start_fresh()
    assert store.job_id != old and store.finished() is None and store.newest() == -1
    assert _names(tmp_path) == []
    assert CheckpointStore(str(tmp_path)).job_id == store.job_id


def test_the_training_mark_is_created_once(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.mark_training()
    assert (tmp_path / "training.started").read_bytes() == b""
    (tmp_path / "training.started").unlink()
    store.mark_training()
    assert not (tmp_path / "training.started").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, (0, HostUpdateResult.no_update)),
        ('{"version": 2, "hosts": [["a", 2]], "result": "added"}', (2, HostUpdateResult.added)),
        ('{"version": 3, "hosts": [], "result": "removed"}', (3, HostUpdateResult.removed)),
        ('{"version": 4, "hosts": [], "result": "odd"}', (4, HostUpdateResult.mixed)),
        ("not json", (0, HostUpdateResult.no_update)),
    ],
)
def test_hosts_notice(tmp_path: pathlib.Path, text: str | None, expected: tuple) -> None:
    if text is not None:
        (tmp_path / "hosts.json").write_text(text)
    assert CheckpointStore(str(tmp_path), host="a").hosts_notice() == expected


def test_notice_written_by_the_launcher_format(tmp_path: pathlib.Path) -> None:
    notice = {"version": 1, "hosts": [["localhost", 3]], "result": "added"}
    (tmp_path / "hosts.json").write_text(json.dumps(notice))
    assert CheckpointStore(str(tmp_path)).hosts_notice() == (1, HostUpdateResult.added)


@pytest.mark.parametrize(
    ("value", "expected"), [(None, "fresh"), ("resume", "resume"), (" Refuse ", "refuse")]
)
def test_the_finished_job_setting(value: str | None, expected: str) -> None:
    env = {} if value is None else {"BAGUAHVD_ELASTIC_FINISHED": value}
    assert Config.from_env(env).elastic_finished == expected


def test_an_unknown_finished_job_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="BAGUAHVD_ELASTIC_FINISHED='skip'"):
        Config.from_env({"BAGUAHVD_ELASTIC_FINISHED": "skip"})


def test_a_damaged_job_file_is_refused_naming_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("baguahvd.torch.elastic.store._JOB_FILE_WAIT_S", 0.1)
    (tmp_path / "job.json").write_text("{not json")
    with pytest.raises(CommitError, match=f"{tmp_path / 'job.json'} does not name a baguahvd job"):
        CheckpointStore(str(tmp_path)).newest()
