"""Bagua's system features: a generic fused optimizer and a load-balanced sampler."""

from baguahvd.contrib.fused_optimizer import (
    AlreadyFusedError,
    UnsupportedOptimizerError,
    fuse_optimizer,
    is_fused_optimizer,
)

__all__ = [
    "AlreadyFusedError",
    "UnsupportedOptimizerError",
    "fuse_optimizer",
    "is_fused_optimizer",
]
