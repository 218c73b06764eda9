"""Bagua's system features for baguahvd jobs: a cached dataset shared by the ranks."""

from baguahvd.contrib.cached_dataset import (
    CachedDataset,
    CacheStore,
    CacheUnavailableError,
    LmdbStore,
    RedisStore,
)

__all__ = ["CacheStore", "CacheUnavailableError", "CachedDataset", "LmdbStore", "RedisStore"]
