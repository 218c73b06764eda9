"""Autotune of the bucket size of gradient_allreduce and bytegrad (HOROVOD_AUTOTUNE).

Buckets are built from the optimizer's parameters, so a new bucket size must take effect
between the same two optimizer steps on every rank. The protocol:

1. While tuning, every ``steps_per_sample`` optimizer steps every rank of the process set
   takes part in one broadcast from its first rank of ``(bucket_bytes, frozen)``. Optimizer
   steps are counted alike on every rank, so every rank issues that broadcast after the
   same step and, when it carries a size, rebuilds its buckets before the next one.
2. The first rank decides. It waits until the engine's own autotune (fusion threshold and
   cycle time, :mod:`~baguahvd.engine.autotune`) has frozen, so that neither tuner
   measures the other's changes; then it discards ``warmup_samples`` samples, scores each
   bucket size by optimizer steps per second over a sample, and searches with
   :class:`~baguahvd.common.search.CoordinateSearch` (grid :data:`BUCKET_GRID_MIB`, then
   local refinement) for ``max_samples`` samples.
3. The best size is broadcast with ``frozen`` set; after it nothing more is exchanged.

Rank 0 logs each sample to ``HOROVOD_AUTOTUNE_LOG`` with ``.buckets.csv`` appended
(``bucket_size,score,train_iter``, the score in steps per second).

Bucket sizes regroup the same arithmetic for gradient_allreduce; for bytegrad they also
move the boundaries of the MinMaxUInt8 chunks, so its results depend on the size, as in
Bagua.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import IO

from baguahvd.common.config import Config
from baguahvd.common.search import CoordinateSearch, Point
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.torch.functions import broadcast_object

logger = logging.getLogger("baguahvd.algorithms")

MIB = 1024 * 1024
BUCKET_GRID_MIB = (1.0, 4.0, 10.0, 25.0, 64.0)
BUCKET_BOUNDS = (64 * 1024, 1024 * MIB)
LOG_HEADER = "bucket_size,score,train_iter"


def _normalize(point: Point) -> Point:
    low, high = BUCKET_BOUNDS
    return (float(int(round(min(max(point[0], low), high) / 1024)) * 1024),)


class BucketTuner:
    """One optimizer's bucket-size autotune (see the module docstring).

    Args:
        start_bytes: the bucket size the optimizer starts with.
        process_set: the optimizer's process set.
        config: the job's configuration (the HOROVOD_AUTOTUNE_* settings).
        engine_tuning: whether the engine's autotune is still searching (read on the
            deciding rank only).
        name: collective name prefix, unique to the optimizer.
    """

    def __init__(
        self,
        start_bytes: int,
        process_set: ProcessSet,
        config: Config,
        engine_tuning: Callable[[], bool],
        name: str,
    ) -> None:
        self.process_set = process_set
        self.steps_per_sample = config.autotune_steps_per_sample
        self.name = name
        self.done = False
        self.changes: list[tuple[int, int]] = []
        """(optimizer step, bucket bytes) of every change, the same on every rank."""
        ranks = process_set.ranks or [0]
        self._root = ranks[0]
        self._deciding = process_set.rank() == 0
        self._engine_tuning = engine_tuning
        self._search = CoordinateSearch(
            (float(start_bytes),), [[mib * MIB for mib in BUCKET_GRID_MIB]],
            config.autotune_max_samples, _normalize,
        )
        self._current = self._search.start
        self._warmup_left = config.autotune_warmup_samples
        self._mark: float | None = None
        self._log: IO[str] | None = None
        if self._deciding and config.autotune_log:
            path = config.autotune_log + ".buckets.csv"
            try:
                self._log = open(path, "w", encoding="utf-8")  # noqa: SIM115
                self._log.write(LOG_HEADER + "\n")
                self._log.flush()
            except OSError as exc:
                logger.error("HOROVOD_AUTOTUNE_LOG: cannot write %s: %s", path, exc)

    def after_step(self, step: int) -> int | None:
        """Called by every rank after optimizer step ``step`` (counted from 1): the bucket
        size to rebuild with now, or None."""
        if self.done or step % self.steps_per_sample:
            return None
        proposal = self._propose(step) if self._deciding else None
        bucket_bytes, frozen = broadcast_object(
            proposal, root_rank=self._root, name=f"{self.name}.autotune",
            process_set=self.process_set,
        )
        if frozen:
            self.done = True
            self.close()
        if bucket_bytes is not None:
            self.changes.append((step, bucket_bytes))
        return bucket_bytes  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _propose(self, step: int) -> tuple[int | None, bool]:
        now = time.perf_counter()
        mark, self._mark = self._mark, now
        if mark is None or self._engine_tuning():
            return None, False
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return None, False
        score = self.steps_per_sample / max(now - mark, 1e-9)
        self._search.tell(self._current, score)
        if self._log is not None:
            self._log.write(f"{int(self._current[0])},{score:.6g},{step}\n")
            self._log.flush()
        proposal = self._search.ask()
        frozen = proposal is None
        if proposal is None:
            proposal = self._search.best
            logger.info(
                "autotune: froze the bucket size at %d bytes after %d samples",
                int(proposal[0]), len(self._search.scores),
            )
        self._current = proposal
        return int(proposal[0]), frozen
