"""The elastic folder: commit files, their cleanup, and the launcher's host notice."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from baguahvd.torch.elastic.base import CheckpointStore, HostUpdateResult


def test_newest_commit_wins_and_older_ones_of_the_host_go(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    assert store.newest() == -1
    store.write(1, {"w": torch.ones(2)})
    store.write(2, {"w": torch.full((2,), 2.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commit-2.node-a.pt"]
    assert torch.equal(store.read(2)["w"], torch.full((2,), 2.0))


def test_commits_of_other_hosts_are_seen_and_kept(tmp_path: pathlib.Path) -> None:
    CheckpointStore(str(tmp_path), host="node-b").write(5, "from b")
    mine = CheckpointStore(str(tmp_path), host="node-a")
    mine.write(4, "from a")
    mine.write(6, "from a, newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "commit-5.node-b.pt",
        "commit-6.node-a.pt",
    ]
    assert mine.newest() == 6 and mine.read(5) == "from b"


def test_a_write_cut_short_leaves_the_previous_commit(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(3, "complete")
    # What a rank killed inside torch.save leaves behind: a temporary file only.
    (tmp_path / ".commit-abc123").write_bytes(b"\x80\x02trunc")
    assert store.newest() == 3 and store.read(3) == "complete"


def test_unpicklable_payload_fails_cleanly(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, "kept")
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises
        store.write(2, lambda: None)
    assert [p.name for p in tmp_path.iterdir()] == ["commit-1.node-a.pt"]


def test_a_foreign_file_is_refused(tmp_path: pathlib.Path) -> None:
    torch.save({"something": "else"}, tmp_path / "commit-9.node-a.pt")
    with pytest.raises(ValueError, match="not a baguahvd elastic commit"):
        CheckpointStore(str(tmp_path), host="node-a").read(9)


def test_host_names_are_made_safe_for_file_names(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="gpu-1.cluster/x")
    store.write(1, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["commit-1.gpu-1_cluster_x.pt"]


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
