"""CachedDataset in one process: entries, damage, capacity, and both stores (LMDB always,
Redis against a real redis-server started here when one is installed)."""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import torch

from baguahvd.contrib import CachedDataset, CacheUnavailableError, LmdbStore, RedisStore
from baguahvd.contrib.cached_dataset import decode, encode


class Decoded(torch.utils.data.Dataset):
    """A dataset that counts its decodes."""

    def __init__(self, n: int = 20, width: int = 64) -> None:
        self.n, self.width, self.decodes = n, width, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.decodes += 1
        return torch.arange(self.width, dtype=torch.float32) * i, i % 3


def _same(a: tuple[torch.Tensor, int], b: tuple[torch.Tensor, int]) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def test_entries_round_trip_and_detect_damage() -> None:
    sample = (torch.randn(4, 3), {"label": 2, "name": "x"})
    intact, back = decode(encode(sample))
    assert intact and torch.equal(back[0], sample[0]) and back[1] == sample[1]
    entry = bytearray(encode(sample))
    entry[-10] ^= 0xFF
    assert decode(bytes(entry)) == (False, None)
    assert decode(b"garbage") == (False, None)


def test_samples_that_could_run_code_are_refused() -> None:
    with pytest.raises(TypeError, match="tensors and plain values"):
        encode(object())


def test_second_epoch_is_served_from_the_cache(tmp_path) -> None:
    inner = Decoded()
    cached = CachedDataset(inner, path=str(tmp_path / "cache"), dataset_name="t")
    first = [cached[i] for i in range(len(cached))]
    second = [cached[i] for i in range(len(cached))]
    assert inner.decodes == len(inner) and cached.hits == len(inner)
    assert all(_same(a, b) for a, b in zip(first, second))
    # Another process (here: another wrapper) on the same folder shares the entries.
    other = CachedDataset(Decoded(), path=str(tmp_path / "cache"), dataset_name="t")
    assert _same(other[5], first[5]) and other.hits == 1 and other.misses == 0


def test_a_damaged_or_planted_entry_is_decoded_again(tmp_path) -> None:
    inner = Decoded()
    store = LmdbStore(str(tmp_path / "cache"))
    cached = CachedDataset(inner, backend=store)
    expected = inner[3]
    inner.decodes = 0
    cached[3]
    entry = bytearray(store.get("3") or b"")
    entry[-1] ^= 0x01
    assert store.put("3", bytes(entry))
    assert _same(cached[3], expected) and cached.damaged == 1 and inner.decodes == 2

    class Boom:
        def __reduce__(self):  # noqa: ANN204 - the classic pickle payload
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    assert store.put("4", pickle.dumps(Boom()))
    assert _same(cached[4], inner[4])
    assert not (tmp_path / "ran").exists()


def test_past_the_capacity_samples_are_returned_uncached(tmp_path) -> None:
    inner = Decoded(n=64, width=4096)
    cached = CachedDataset(inner, path=str(tmp_path / "small"), capacity=256 * 1024)
    for _ in range(2):
        for i in range(len(inner)):
            assert _same(cached[i], Decoded(n=64, width=4096)[i])
    assert 0 < len(cached.store) < len(inner)
    assert inner.decodes > len(inner)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown cache backend 'memcached'"):
        CachedDataset(Decoded(), backend="memcached")
    with pytest.raises(ValueError, match="capacity"):
        CachedDataset(Decoded(), capacity=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_port(tmp_path) -> Iterator[int]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = _free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_redis_cache_is_shared_and_bounded(redis_port: int) -> None:
    inner = Decoded(n=30, width=1024)
    cached = CachedDataset(inner, backend="redis", dataset_name="digits", port=redis_port,
                           host="127.0.0.1", capacity=12 * 5000)
    samples = [cached[i] for i in range(len(inner))]
    stored = len(cached.store)
    assert 0 < stored < len(inner)  # about 4.3 KB per entry: the budget holds about 13
    other = CachedDataset(Decoded(n=30, width=1024), backend="redis", dataset_name="digits",
                          port=redis_port, host="127.0.0.1", capacity=12 * 5000)
    again = [other[i] for i in range(len(inner))]
    assert other.hits == stored
    assert all(_same(a, b) for a, b in zip(samples, again))
    store = cached.store
    assert isinstance(store, RedisStore)
    assert store.put("x", b"0" * 10) in (True, False)


def test_redis_damage_is_never_returned(redis_port: int) -> None:
    inner = Decoded()
    cached = CachedDataset(inner, backend="redis", dataset_name="d", port=redis_port,
                           host="127.0.0.1")
    expected = cached[7]
    store = cached.store
    assert isinstance(store, RedisStore)
    store.delete("7")
    assert store.put("7", b"BHVDC1" + b"\0" * 40)
    assert _same(cached[7], expected) and cached.damaged == 1


def test_unreachable_redis_is_a_clear_error() -> None:
    port = _free_port()
    with pytest.raises(CacheUnavailableError, match=f"127.0.0.1:{port}.*redis-server"):
        CachedDataset(Decoded(), backend="redis", host="127.0.0.1", port=port)


def test_dataloader_workers_share_the_cache(tmp_path) -> None:
    cached = CachedDataset(Decoded(), path=str(tmp_path / "cache"), dataset_name="w")
    loader = torch.utils.data.DataLoader(cached, batch_size=5, num_workers=2)
    first = [batch for batch in loader]
    assert len(cached.store) == len(cached)  # written by the workers, seen here
    second = [batch for batch in loader]
    for a, b in zip(first, second):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
