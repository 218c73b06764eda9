"""A dataset wrapper that keeps decoded samples in a cache shared by the ranks.

Decoding (reading, parsing, augmenting a fixed crop...) often costs more than training on a
sample. :class:`CachedDataset` decodes a sample the first time any rank asks for it and
serves it from the cache afterwards. Two stores:

* ``backend="lmdb"`` (default, no server): an LMDB environment in a folder, which every
  process on the node opens, so the ranks of a node share one cache (LMDB is a
  memory-mapped B-tree that several processes may read and write at once). Its size is the
  capacity.
* ``backend="redis"``: a Redis server (``redis-server``), shared by every node that can reach
  it. The cache counts the bytes it stored in one Redis key, so the capacity holds across
  ranks and nodes.

Every entry is ``magic | SHA-256 of the body | body``, where the body is ``torch.save`` of the
sample, read back with ``torch.load(weights_only=True)``: tensors and plain values only, so a
cache entry never runs code, and an entry whose digest does not match (a damaged or foreign
value) is dropped and the sample decoded again: a corrupted sample is never returned. Once
the capacity is reached, new samples are returned without being cached (one warning).
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import io
import logging
import os
import tempfile
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

_MAGIC = b"BHVDC1"
_DIGEST = 32
DEFAULT_CAPACITY = 16 * 1024**3
"""Bytes a cache may hold unless told otherwise (16 GiB)."""


class CacheUnavailableError(RuntimeError):
    """The cache's store cannot be opened or reached."""


def encode(sample: Any) -> bytes:
    """``sample`` as a cache entry (see the module docstring).

    Raises:
        TypeError: the sample holds something other than tensors and plain values.
    """
    buffer = io.BytesIO()
    torch.save(sample, buffer)
    body = buffer.getvalue()
    try:
        torch.load(io.BytesIO(body), weights_only=True)
    except Exception as exc:
        raise TypeError(
            "CachedDataset caches tensors and plain values (numbers, strings, lists, tuples, "
            f"dicts) only; this sample cannot be loaded safely: {exc}"
        ) from None
    return _MAGIC + hashlib.sha256(body).digest() + body


def decode(entry: bytes) -> tuple[bool, Any]:
    """``(True, sample)`` for an intact entry, ``(False, None)`` for a damaged one."""
    head = len(_MAGIC)
    if len(entry) < head + _DIGEST or entry[:head] != _MAGIC:
        return False, None
    digest, body = entry[head : head + _DIGEST], entry[head + _DIGEST :]
    if hashlib.sha256(body).digest() != digest:
        return False, None
    try:
        return True, torch.load(io.BytesIO(body), weights_only=True)
    except Exception:
        return False, None


class CacheStore(abc.ABC):
    """Where entries live: bytes by key, with a byte budget."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The entry stored under ``key``, or None."""

    @abc.abstractmethod
    def put(self, key: str, entry: bytes) -> bool:
        """Stores ``entry`` unless the capacity would be exceeded; whether it was stored."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Forgets ``key`` (a damaged entry)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many entries the store holds."""


class LmdbStore(CacheStore):
    """An LMDB environment in ``path``, shared by the processes that open it.

    LMDB allows one open environment per folder and process, and an environment must not
    be used across ``fork``: stores on the same folder in one process share it, and a
    process (a DataLoader worker, say) opens its own on first use.

    Args:
        path: the folder of the environment (created if missing).
        capacity: bytes the environment may grow to.
    """

    def __init__(self, path: str, capacity: int = DEFAULT_CAPACITY) -> None:
        self.path = os.path.realpath(path)
        self.capacity = capacity
        self._lmdb = _optional("lmdb")
        self._env()  # fail now, not at the first sample

    def _env(self) -> Any:
        pid = os.getpid()
        key = (pid, self.path)
        with _OPEN_LOCK:
            env = _OPEN_ENVIRONMENTS.get(key)
            if env is None:
                # An environment inherited through fork belongs to the parent: the child
                # drops it (py-lmdb would take the folder for open) and opens its own.
                for (owner, path), inherited in list(_OPEN_ENVIRONMENTS.items()):
                    if owner != pid and path == self.path:
                        inherited.close()
                        del _OPEN_ENVIRONMENTS[(owner, path)]
                lmdb = self._lmdb
                try:
                    os.makedirs(self.path, exist_ok=True)
                    # No fsync per write: a crash loses only recent entries, which cost a
                    # decode again, and the digest refuses any entry it damaged.
                    env = lmdb.open(
                        self.path, map_size=self.capacity, max_readers=1024, sync=False
                    )
                except (OSError, lmdb.Error) as exc:
                    raise CacheUnavailableError(
                        f"cannot open the LMDB cache in {self.path!r}: {exc}; pass path= a "
                        "writable folder"
                    ) from None
                _OPEN_ENVIRONMENTS[key] = env
        return env

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.capacity = state["path"], state["capacity"]
        self._lmdb = _optional("lmdb")

    def get(self, key: str) -> bytes | None:
        with self._env().begin() as txn:
            value = txn.get(key.encode())
        return None if value is None else bytes(value)

    def put(self, key: str, entry: bytes) -> bool:
        try:
            with self._env().begin(write=True) as txn:
                txn.put(key.encode(), entry)
        except self._lmdb.MapFullError:
            return False
        return True

    def delete(self, key: str) -> None:
        with self._env().begin(write=True) as txn:
            txn.delete(key.encode())

    def __len__(self) -> int:
        return int(self._env().stat()["entries"])


# LMDB's rule (one environment per folder and process) needs a process-wide table of open
# environments, keyed by process id so that a forked child opens its own.
_OPEN_ENVIRONMENTS: dict[tuple[int, str], Any] = {}
_OPEN_LOCK = threading.Lock()


class RedisStore(CacheStore):
    """A Redis server; the capacity is counted across every client in one key.

    Args:
        host: the server's host.
        port: its port.
        namespace: prefix of this cache's keys.
        capacity: bytes of entries the cache may hold in the server.
        **kwargs: more ``redis.Redis`` arguments (``password``, ``db``...).
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 6379,
        namespace: str = "",
        capacity: int = DEFAULT_CAPACITY,
        **kwargs: Any,
    ) -> None:
        self._settings: dict[str, Any] = dict(kwargs, host=host, port=port)
        self._namespace = namespace
        self._bytes_key = f"{namespace}#bytes"
        self.capacity = capacity
        self._connect()

    def _connect(self) -> None:
        redis = _optional("redis")
        self._client = redis.Redis(socket_timeout=10, **self._settings)
        try:
            self._client.ping()
        except redis.RedisError as exc:
            where = f"{self._settings['host']}:{self._settings['port']}"
            raise CacheUnavailableError(
                f"cannot reach the Redis server at {where}: {exc}; start redis-server there, "
                "or use backend='lmdb' for a cache without a server"
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        # A client holds sockets and locks: a DataLoader worker connects on its own.
        return {k: v for k, v in self.__dict__.items() if k != "_client"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._connect()

    def _key(self, key: str) -> str:
        return f"{self._namespace}_{key}"

    def get(self, key: str) -> bytes | None:
        value = self._client.get(self._key(key))
        return None if value is None else bytes(value)

    def put(self, key: str, entry: bytes) -> bool:
        size = len(entry)
        if int(self._client.incrby(self._bytes_key, size)) > self.capacity:
            self._client.decrby(self._bytes_key, size)
            return False
        if not self._client.set(self._key(key), entry, nx=True):
            self._client.decrby(self._bytes_key, size)  # another rank stored it first
        return True

    def delete(self, key: str) -> None:
        entry = self._client.getdel(self._key(key))
        if entry is not None:
            self._client.decrby(self._bytes_key, len(entry))

    def __len__(self) -> int:
        return sum(1 for _ in self._client.scan_iter(match=f"{self._namespace}_*", count=1000))


class CachedDataset(torch.utils.data.Dataset):
    """Serves ``dataset[i]`` from a cache shared by the ranks, decoding it on a miss.

    Args:
        dataset: a map-style dataset whose samples are tensors and plain values.
        backend: ``"lmdb"`` (default; one cache per node, no server), ``"redis"`` (a
            server shared across nodes), or a :class:`CacheStore`.
        dataset_name: names the cache; datasets with the same name share entries.
        capacity: bytes the cache may hold (default 16 GiB); past it, samples are returned
            uncached.
        path: the LMDB folder (default: ``<tmp>/baguahvd-cache-<dataset_name>``).
        **kwargs: for ``"redis"``: ``host``, ``port`` and ``redis.Redis`` arguments.

    Raises:
        CacheUnavailableError: the store cannot be opened or reached.
        ValueError: an unknown backend.
    """

    def __init__(
        self,
        dataset: Any,
        backend: str | CacheStore = "lmdb",
        dataset_name: str = "",
        capacity: int = DEFAULT_CAPACITY,
        path: str | None = None,
        **kwargs: Any,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes, got {capacity}")
        self.dataset = dataset
        self.dataset_name = dataset_name
        self.store = _open_store(backend, dataset_name, capacity, path, kwargs)
        self.hits = 0
        self.misses = 0
        self.damaged = 0
        self._warned_full = False

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        key = str(int(index))
        entry = self.store.get(key)
        if entry is not None:
            intact, sample = decode(entry)
            if intact:
                self.hits += 1
                return sample
            self.damaged += 1
            logger.warning("cache entry %r of %r is damaged; decoding the sample again",
                           key, self.dataset_name)
            self.store.delete(key)
        self.misses += 1
        sample = self.dataset[index]
        if not self.store.put(key, encode(sample)) and not self._warned_full:
            self._warned_full = True
            logger.warning("the cache of %r is full; further samples are not cached",
                           self.dataset_name)
        return sample


def _optional(module: str) -> Any:
    """Imports a store's client library, an optional dependency (``baguahvd[cache]``)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CacheUnavailableError(
            f"this cache backend needs the {module!r} package: pip install 'baguahvd[cache]'"
        ) from None


def _open_store(
    backend: str | CacheStore, name: str, capacity: int, path: str | None, kwargs: dict
) -> CacheStore:
    if isinstance(backend, CacheStore):
        return backend
    if backend == "lmdb":
        folder = path or os.path.join(tempfile.gettempdir(), f"baguahvd-cache-{name or 'data'}")
        return LmdbStore(folder, capacity)
    if backend == "redis":
        return RedisStore(namespace=name, capacity=capacity, **kwargs)
    raise ValueError(f"unknown cache backend {backend!r}; use 'lmdb', 'redis' or a CacheStore")
