"""The stall inspector: collectives that some ranks submitted and others did not.

A collective runs only once every member of its process set has submitted it, so a rank
that skips one, submits another name, or sleeps leaves the others waiting. Rank 0 sees
every request that is negotiated in full and reports, every
``HOROVOD_STALL_CHECK_TIME_SECONDS``, which collectives have waited that long and which ranks
are missing, in Horovod's words. Past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` it ends the
job: the report becomes a :class:`~baguahvd.engine.notices.Notice` that reaches every rank
and fails their collectives with ``StallError``.

Requests answered from the response cache are announced by one bit and never reach rank 0.
Each rank therefore invalidates the cache entries its own requests have waited on for longer
than the warning time; the requests are then negotiated in full and show up in rank 0's
table with the time they have already waited (Horovod does the same).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from baguahvd.engine.messages import RequestMeta
from baguahvd.engine.notices import Notice, NoticeKind
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request

logger = logging.getLogger("baguahvd.engine")

Ident = tuple[int, str]
"""(process set id, negotiation key)"""

# How often the tables are looked at; reports still come at most once per warning time.
_CHECK_INTERVAL_S = 0.5
# Horovod lists at most this many names per rank.
_NAMES_PER_RANK = 6


class StallInspector:
    """Times the requests that wait for other ranks (see module docstring).

    Args:
        warning_s: HOROVOD_STALL_CHECK_TIME_SECONDS.
        shutdown_s: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; 0 never.
        disabled: HOROVOD_STALL_CHECK_DISABLE.
    """

    def __init__(self, warning_s: float, shutdown_s: float, disabled: bool) -> None:
        self.enabled = not disabled
        self.warning_s = warning_s
        if 0 < shutdown_s < warning_s:
            logger.warning(
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than "
                "HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown."
            )
            shutdown_s = 0.0
        self.shutdown_s = shutdown_s
        self._first_seen: dict[Ident, float] = {}
        self._next_check = 0.0
        self._next_report = 0.0

    # -- every rank: requests waiting on cached responses ---------------------------------

    def due(self, now: float) -> bool:
        """Whether it is time to look at the tables again (cheap; call every cycle)."""
        if not self.enabled or now < self._next_check:
            return False
        self._next_check = now + _CHECK_INTERVAL_S
        return True

    def stale_cache_waits(self, waiting: Mapping[int, Request], now: float) -> list[int]:
        """Cache slots whose request on this rank has waited longer than the warning time:
        invalidating them sends the requests to rank 0 in full, where the missing ranks show."""
        return [
            slot for slot, request in waiting.items()
            if now - request.submitted > self.warning_s
        ]

    # -- rank 0: requests negotiated in full ----------------------------------------------

    def seen(self, ident: Ident, since: float) -> None:
        """Records that a rank submitted ``ident`` at ``since`` (the earliest one counts)."""
        first = self._first_seen.get(ident)
        if first is None or since < first:
            self._first_seen[ident] = since

    def forget(self, ident: Ident) -> None:
        self._first_seen.pop(ident, None)

    def check(
        self,
        table: Mapping[Ident, Mapping[int, RequestMeta]],
        process_sets: Mapping[int, ProcessSetState],
        joined: Collection[int],
        now: float,
    ) -> Notice | None:
        """Logs the collectives that have waited longer than the warning time (at most once
        per warning time) and returns the notice that ends the job once one has waited
        longer than the shutdown time."""
        stalled: list[tuple[str, list[int], bool]] = []
        for ident, since in self._first_seen.items():
            lag = now - since
            submitted = table.get(ident)
            state = process_sets.get(ident[0])
            if lag <= self.warning_s or not submitted or state is None:
                continue
            missing = [r for r in state.ranks if r not in submitted and r not in joined]
            if not missing:
                continue
            name = next(iter(submitted.values())).name
            past_shutdown = 0 < self.shutdown_s < lag
            stalled.append((name, missing, past_shutdown))
        if not stalled:
            return None
        shut_down = any(past for _, _, past in stalled)
        if not shut_down and now < self._next_report:
            return None
        self._next_report = now + self.warning_s
        report = self._report(stalled, shut_down)
        if not shut_down:
            logger.warning("%s", report)
            return None
        logger.error("%s", report)
        named = tuple((name, tuple(ranks)) for name, ranks, past in sorted(stalled) if past)
        waits = "; ".join(f"{name} waits for ranks {list(ranks)}" for name, ranks in named)
        summary = (
            f"Stalled for more than {_seconds(self.shutdown_s)} seconds "
            f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS): {waits}. Some ranks submitted these "
            "collectives and the others did not (they submitted other names, or have not "
            "reached them)."
        )
        return Notice(NoticeKind.STALL, 0, summary, named)

    def _report(self, stalled: list[tuple[str, list[int], bool]], shut_down: bool) -> str:
        by_rank: dict[int, list[str]] = {}
        stopping: set[int] = set()
        for name, missing, past in sorted(stalled):
            for rank in missing:
                by_rank.setdefault(rank, []).append(name)
                if past:
                    stopping.add(rank)
        lines = [
            "One or more tensors were submitted to be reduced, gathered or broadcasted by "
            "subset of ranks and are waiting for remainder of ranks for more than "
            f"{_seconds(self.warning_s)} seconds. This may indicate that different ranks are "
            "trying to submit different tensors or that only subset of ranks is submitting "
            "tensors, which will cause deadlock. ",
            "Missing ranks:",
        ]
        for rank in sorted(by_rank):
            names = by_rank[rank]
            shown = ", ".join(names[:_NAMES_PER_RANK])
            more = " ..." if len(names) > _NAMES_PER_RANK else ""
            mark = "!" if rank in stopping else ""
            lines.append(f"{rank}{mark}: [{shown}{more}]")
        lines.append("Stalled tensors (name: [missing ranks]):")
        for name, missing, _ in sorted(stalled):
            lines.append(f"{name}: {missing}")
        if shut_down:
            lines.append(
                'One or more rank (marked by "!") is stalled for longer than '
                f"{_seconds(self.shutdown_s)} seconds. Will shutdown."
            )
        return "\n".join(lines)


def _seconds(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"

