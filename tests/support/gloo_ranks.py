"""Ranks of one gloo job as threads of this process, over an in-memory store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from baguahvd.backends.gloo import GlooControlPlane, GlooWorld


def run_ranks(size: int, body: Callable[[GlooControlPlane], Any]) -> list[Any]:
    """Runs ``body(control plane)`` on ``size`` ranks (threads); returns each result."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            world = GlooWorld(store, rank, size, group_timeout_s=30)
            results[rank] = body(GlooControlPlane(world))
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results
