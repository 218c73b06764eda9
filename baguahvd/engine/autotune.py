"""Online tuning of the fusion threshold and the cycle time (HOROVOD_AUTOTUNE).

The protocol:

1. Only rank 0 measures and decides. After every cycle its engine hands the
   :class:`Autotuner` the names and bytes of the allreduces the cycle ran. A *step* is
   counted each time a collective name comes round again (the name seen most often sets
   the count), so a training loop's steps are found without knowing its optimizer. A
   *sample* is ``steps_per_sample`` steps under one setting; its score is the bytes
   allreduced per second of wall time from the moment the setting took effect.
2. The first ``warmup_samples`` samples run the initial settings and are discarded (the
   first steps pay for allocations and cache misses).
3. When a sample ends, rank 0 logs it and proposes the next candidate of the
   :class:`GridSearch` (:mod:`~baguahvd.common.search` says how it searches and why).
   The proposal rides in the next cycle's :class:`~baguahvd.engine.notices.Decision`:
   rank 0 asks for a full negotiation (its "I have something to send" bit), every rank
   receives the same decision in the same cycle, and every rank applies the settings
   when that cycle ends. Every rank therefore changes settings between the same two
   cycles, and no collective is ever fused under settings that differ between ranks
   (fused buffers are matched by position, so the fusion plans must agree).
4. After ``max_samples`` candidates the best-scoring settings are proposed once more, the
   same way, and stay.

Settings only decide how requests are grouped and when cycles start, never the arithmetic,
so a tuned job computes what an untuned one computes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import IO, NamedTuple

from baguahvd.common.search import CoordinateSearch, Point

logger = logging.getLogger("baguahvd.engine")

MIB = 1024 * 1024
# The first pass of the search: fusion thresholds (MiB) at the initial cycle time, then
# cycle times (ms) at the best threshold; later passes refine around the best.
FUSION_GRID_MIB = (1.0, 4.0, 16.0, 64.0, 128.0)
CYCLE_GRID_MS = (0.5, 1.0, 2.5, 5.0)
FUSION_BOUNDS = (64 * 1024, 512 * MIB)
CYCLE_BOUNDS_MS = (0.1, 50.0)

LOG_HEADER = (
    "hierarchical_allreduce,hierarchical_allgather,cache_enabled,cycle_time_ms,"
    "tensor_fusion_threshold,score"
)


class Settings(NamedTuple):
    """What autotune changes: the engine's fusion threshold and cycle time."""

    fusion_threshold: int
    """Bytes of the fusion buffer."""
    cycle_time_ms: float


class GridSearch:
    """The search over :class:`Settings`: a
    :class:`~baguahvd.common.search.CoordinateSearch` whose first pass measures
    :data:`FUSION_GRID_MIB` at the initial cycle time and whose second measures
    :data:`CYCLE_GRID_MS` at the best threshold, before refining around the best.

    Args:
        start: the initial settings (measured first).
        budget: how many settings to measure.
    """

    def __init__(self, start: Settings, budget: int) -> None:
        self._search = CoordinateSearch(
            start,
            ([mib * MIB for mib in FUSION_GRID_MIB], CYCLE_GRID_MS),
            budget,
            _normalize,
        )

    @property
    def scores(self) -> dict[Settings, float]:
        return {_as_settings(point): score for point, score in self._search.scores.items()}

    @property
    def best(self) -> Settings:
        return _as_settings(self._search.best)

    def ask(self) -> Settings | None:
        point = self._search.ask()
        return None if point is None else _as_settings(point)

    def tell(self, settings: Settings, score: float) -> None:
        self._search.tell(settings, score)


def _as_settings(point: Point) -> Settings:
    return Settings(int(point[0]), float(point[1]))


def _normalize(point: Point) -> Point:
    """Settings clamped to sane bounds and rounded (threshold to KiB, cycle to 0.01 ms)."""
    low, high = FUSION_BOUNDS
    threshold = int(round(min(max(point[0], low), high) / 1024)) * 1024
    cycle_low, cycle_high = CYCLE_BOUNDS_MS
    cycle = round(min(max(point[1], cycle_low), cycle_high), 2)
    return Settings(threshold, cycle)


class Autotuner:
    """Rank 0's measurements and proposals (see the module docstring).

    Args:
        start: the settings the job starts with.
        warmup_samples: samples discarded at the start.
        steps_per_sample: steps per sample.
        max_samples: settings measured before the best freezes.
        log_path: CSV file for the samples (HOROVOD_AUTOTUNE_LOG), or None.
        flags: the values of Horovod's other logged columns (hierarchical allreduce,
            hierarchical allgather, cache enabled), which baguahvd does not tune.
    """

    def __init__(
        self,
        start: Settings,
        warmup_samples: int,
        steps_per_sample: int,
        max_samples: int,
        log_path: str | None = None,
        flags: tuple[bool, bool, bool] = (False, False, True),
    ) -> None:
        if steps_per_sample < 1:
            raise ValueError(f"steps_per_sample must be at least 1, got {steps_per_sample}.")
        self.search = GridSearch(start, max_samples)
        self.steps_per_sample = steps_per_sample
        self.warmup_left = max(0, warmup_samples)
        self.current = start
        self.frozen = False
        self._flags = flags
        self._measuring = True
        self._started: float | None = None
        self._bytes = 0
        self._counts: dict[str, int] = {}
        self._log: IO[str] | None = None
        if log_path:
            try:
                self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
                self._log.write(LOG_HEADER + "\n")
                self._log.flush()
            except OSError as exc:
                logger.error("HOROVOD_AUTOTUNE_LOG: cannot write %s: %s", log_path, exc)
                self._log = None

    def record(self, reduced: Iterable[tuple[str, int]], now: float | None = None) -> (
        Settings | None
    ):
        """Counts one cycle's allreduces (name, bytes); returns settings to propose to every
        rank when a sample ends (None otherwise)."""
        if self.frozen or not self._measuring:
            return None
        now = time.monotonic() if now is None else now
        steps = 0
        for name, nbytes in reduced:
            if self._started is None:
                self._started = now
            self._bytes += nbytes
            count = self._counts.get(name, 0) + 1
            self._counts[name] = count
            steps = max(steps, count)
        if steps < self.steps_per_sample or self._started is None:
            return None
        elapsed = max(now - self._started, 1e-9)
        return self._sample_done(self._bytes / elapsed)

    def applied(self, settings: Settings, now: float | None = None) -> None:
        """Every rank switched to ``settings`` (the cycle carrying them ended): the next
        sample starts now."""
        self.current = settings
        self._restart(time.monotonic() if now is None else now)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _restart(self, now: float | None) -> None:
        self._measuring = True
        self._started = now
        self._bytes = 0
        self._counts = {}

    def _sample_done(self, score: float) -> Settings | None:
        if self.warmup_left > 0:
            self.warmup_left -= 1
            self._restart(None)
            return None
        self.search.tell(self.current, score)
        self._write(self.current, score)
        proposal = self.search.ask()
        if proposal is None:
            proposal = self.search.best
            self.frozen = True
            logger.info(
                "autotune: froze fusion threshold %d bytes, cycle time %g ms after %d samples",
                proposal.fusion_threshold, proposal.cycle_time_ms, len(self.search.scores),
            )
            self.close()
        self._measuring = False
        return proposal

    def _write(self, settings: Settings, score: float) -> None:
        logger.debug(
            "autotune: fusion threshold %d bytes, cycle time %g ms: %.4g bytes/s",
            settings.fusion_threshold, settings.cycle_time_ms, score,
        )
        if self._log is None:
            return
        hierarchical_allreduce, hierarchical_allgather, cache = self._flags
        self._log.write(
            f"{int(hierarchical_allreduce)},{int(hierarchical_allgather)},{int(cache)},"
            f"{settings.cycle_time_ms:g},{settings.fusion_threshold / MIB:g},{score:.6g}\n"
        )
        self._log.flush()
