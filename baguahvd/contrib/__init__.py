"""Bagua's system features: a generic fused optimizer, a load-balanced sampler and a cached
dataset shared by the ranks."""

from baguahvd.contrib.cached_dataset import (
    CachedDataset,
    CacheStore,
    CacheUnavailableError,
    LmdbStore,
    RedisStore,
)
from baguahvd.contrib.fused_optimizer import (
    AlreadyFusedError,
    UnsupportedOptimizerError,
    fuse_optimizer,
    is_fused_optimizer,
)
from baguahvd.contrib.load_balancing import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)

__all__ = [
    "AlreadyFusedError",
    "CacheStore",
    "CacheUnavailableError",
    "CachedDataset",
    "LmdbStore",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "RedisStore",
    "UnsupportedOptimizerError",
    "fuse_optimizer",
    "is_fused_optimizer",
]
