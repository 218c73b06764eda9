"""The container commits are written in: tensors and plain values round-trip, tensors it
does not hold go through ``torch.save``, commits of the earlier ``torch.save`` format still
load, and a loaded container builds nothing but tensors and plain values."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import logging
import pathlib
import pickle
from typing import Any

import pytest
import torch

from baguahvd.torch.elastic.files import CONTAINER_MAGIC, pack, unpack
from baguahvd.torch.elastic.store import CheckpointStore, CommitError


def _same(expected: Any, loaded: Any) -> None:
    assert type(loaded) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
        assert loaded.stride() == expected.stride()
        assert loaded.requires_grad == expected.requires_grad
        assert torch.equal(loaded.detach(), expected.detach())
    elif isinstance(expected, dict):
        assert list(loaded) == list(expected)
        for key in expected:
            _same(expected[key], loaded[key])
    elif isinstance(expected, (list, tuple)):
        assert len(loaded) == len(expected)
        for item, other in zip(expected, loaded):
            _same(item, other)
    else:
        assert loaded == expected


def test_tensors_and_plain_values_round_trip_in_the_container(tmp_path: pathlib.Path) -> None:
    base = torch.arange(24.0)
    payload = {
        "w": base,
        "view": base[4:10].view(2, 3),  # shares base's storage
        "transposed": base.view(4, 6).t(),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "ints": torch.arange(5, dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "leaf": torch.ones(2, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.full((2,), 3.0)),
        "ordered": collections.OrderedDict(a=torch.zeros(1), b=2),
        "plain": [None, True, 3, 2.5, 1j, "s", b"b", (1, 2), {3}, torch.float16,
                  torch.Size([2]), torch.device("cuda", 1)],
    }
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, payload)
    data = (tmp_path / "commit-1.node-a.pt").read_bytes()
    assert data.startswith(CONTAINER_MAGIC)
    # The tensors' bytes follow their pickle raw, a storage shared by three tensors once.
    assert data.count(bytes(base.untyped_storage())) == 1
    loaded = store.read(1)
    _same(payload, loaded)
    assert loaded["view"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    loaded["w"][0] = 100.0  # writable, and the storage's own
    assert loaded["view"][0, 0] == 4.0 and loaded["transposed"][0, 0] == 100.0


def test_a_tensor_met_twice_loads_as_one_object(tmp_path: pathlib.Path) -> None:
    tied = torch.arange(6.0)
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, {"encoder": tied, "decoder": tied, "other": tied.clone()})
    loaded = store.read(1)
    assert loaded["encoder"] is loaded["decoder"] and loaded["other"] is not loaded["encoder"]
    assert torch.equal(loaded["decoder"], tied) and torch.equal(loaded["other"], tied)


def test_an_optimizer_state_resumes_from_the_container(tmp_path: pathlib.Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    loaded = store.load_newest()[1]
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(loaded["model"])
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    _same(optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"])
    assert torch.equal(fresh.weight, model.weight)


def test_a_tensor_the_container_does_not_hold_goes_through_torch_save(
    tmp_path: pathlib.Path,
) -> None:
    lazy = torch.tensor([1 + 2j, 3 - 1j]).conj()  # conjugated lazily: its bytes are not it
    sparse = torch.eye(3).to_sparse()
    for tensor in (lazy, sparse):
        assert pack({"t": tensor}) is None
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, {"lazy": lazy, "sparse": sparse})
    assert (tmp_path / "commit-1.node-a.pt").read_bytes()[:2] == b"PK"  # torch.save's zip
    loaded = store.read(1)
    assert torch.equal(loaded["lazy"], lazy)
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(3))


def _plant(folder: pathlib.Path, store: CheckpointStore, number: int, data: bytes) -> None:
    """Puts ``data`` in the folder as commit ``number`` with a manifest that vouches for it,
    as an earlier version (or someone who can write the folder) would."""
    (folder / f"commit-{number}.node-a.pt").write_bytes(data)
    (folder / f"commit-{number}.node-a.json").write_text(json.dumps({
        "format": 2, "job_id": store.job_id, "host": "node-a", "commit": number,
        "payload": f"commit-{number}.node-a.pt", "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }))


def test_commits_of_the_earlier_torch_save_format_still_load(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path), host="node-a")
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "step": 7}, buffer)
    _plant(tmp_path, store, 3, buffer.getvalue())
    number, payload = store.load_newest()
    assert number == 3 and payload["step"] == 7 and torch.equal(payload["w"], torch.arange(4.0))
    store.write(4, {"w": torch.ones(2)})  # the next commit, in the container, goes on from it
    assert store.load_newest()[0] == 4 and store.read(3)["step"] == 7


class _Trap:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def _container(head: bytes, tail: bytes = b"") -> bytes:
    return CONTAINER_MAGIC + len(head).to_bytes(8, "little") + head + tail


def _tensor_id(number: int, nbytes: int, shape: tuple, stride: tuple, offset: int) -> tuple:
    return ("tensor", number, nbytes, "float32", shape, stride, offset, False, False)


class _IdPickler(pickle.Pickler):
    """Pickles ``_Id`` values as the persistent ids they carry: crafted containers."""

    def persistent_id(self, value: Any) -> Any:
        return value.pid if isinstance(value, _Id) else None


class _Id:
    def __init__(self, pid: tuple) -> None:
        self.pid = pid


def _crafted(value: Any, tail: bytes) -> bytes:
    buffer = io.BytesIO()
    _IdPickler(buffer, protocol=4).dump(value)
    return _container(buffer.getvalue(), tail)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_container(pickle.dumps({"w": _Trap("/nonexistent/x")}, protocol=4)),
         r"open is not a plain value"),
        (_crafted({"w": _Id(_tensor_id(0, 8, (4,), (1,), 0))}, bytes(8)), "does not fit"),
        (_crafted({"w": _Id(_tensor_id(0, 8, (2,), (1,), 0))}, bytes(12)), "end at byte"),
        (_crafted({"w": _Id(_tensor_id(0, 64, (2,), (1,), 0))}, bytes(8)), "past the end"),
        (_crafted({"w": _Id(_tensor_id(1, 8, (2,), (1,), 0))}, bytes(8)), "out of order"),
        (_crafted({"w": _Id(("tensor", 0, 8, "Tensor", (2,), (1,), 0, False, False))},
                  bytes(8)), "unknown persistent id"),
        (_crafted({"w": _Id(("again", 0))}, b""), "unknown persistent id"),
        (_container(b"\x80\x04junk"), None),
    ],
    ids=["class", "too-small", "trailing-bytes", "storage-past-end", "out-of-order",
         "not-a-dtype", "again-before-first", "junk"],
)
def test_a_container_with_more_than_tensors_and_plain_values_is_refused(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, data: bytes, reason: str | None
) -> None:
    with pytest.raises(pickle.UnpicklingError if reason else Exception, match=reason):
        unpack(data)
    store = CheckpointStore(str(tmp_path), host="node-a")
    store.write(1, {"w": torch.zeros(2)})
    _plant(tmp_path, store, 2, data)  # a valid checksum: the reader is what refuses it
    with caplog.at_level(logging.WARNING):
        number, payload = store.load_newest()
    assert number == 1 and torch.equal(payload["w"], torch.zeros(2))
    assert "commit-2.node-a.pt holds more than tensors and plain values" in caplog.text
    with pytest.raises(CommitError, match="commit-2.node-a.pt"):
        store.read(2)
    assert not pathlib.Path("/nonexistent/x").exists()
