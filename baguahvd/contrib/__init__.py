"""Bagua's system features: a generic fused optimizer and a load-balanced sampler."""

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
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "UnsupportedOptimizerError",
    "fuse_optimizer",
    "is_fused_optimizer",
]
