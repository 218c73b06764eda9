"""Rank 0's side of negotiation: matching requests across ranks.

Every cycle rank 0 gathers each rank's :class:`~baguahvd.engine.notices.RankReport`. A
notice in any report ends the job (the first by precedence wins) and the cycle runs
nothing. Otherwise each request is filed under (process set, key); once every member of
its set has submitted it, or joined, :func:`~baguahvd.engine.messages.build_response` checks
that they agree and turns them into one response (or the mismatch error every member
raises). Once every rank has joined, a JOIN response completes the joins. Rank 0 also times
what waits here (:mod:`~baguahvd.engine.negotiation.stall`) and records negotiation in the timeline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from baguahvd.engine.messages import (
    GLOBAL_PROCESS_SET_ID,
    JOIN_KEY,
    OpType,
    RequestMeta,
    Response,
    build_response,
)
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.notices import Decision, Notice, RankReport, first_notice
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.timeline import Timeline


class Coordinator:
    """Rank 0's table of requests that not every member has submitted yet."""

    def __init__(self, inspector: StallInspector, timeline: Timeline | None) -> None:
        self.table: dict[tuple[int, str], dict[int, RequestMeta]] = {}
        self.joined: list[int] = []
        self.inspector = inspector
        self.timeline = timeline

    def decide(
        self,
        reports: Sequence[RankReport],
        process_sets: Mapping[int, ProcessSetState],
        world_size: int,
    ) -> Decision:
        """Rank 0's answer to the cycle's reports: the collectives every member has now
        submitted or, when a rank announced the end of the job, that end alone."""
        notice = first_notice(report.notice for report in reports)
        if notice is not None:
            return Decision([], (), notice)
        now = time.monotonic()
        for report in reports:
            self.add(report.metas, report.waited, now)
        return Decision(self.ready(process_sets, world_size), tuple(self.joined))

    def add(self, metas: Sequence[RequestMeta], waited: Sequence[float], now: float) -> None:
        timeline = self.timeline if self.timeline is not None and self.timeline.active else None
        for meta, age in zip(metas, waited):
            ident = (meta.process_set_id, meta.key)
            if meta.op == OpType.JOIN:
                if meta.rank not in self.joined:
                    self.joined.append(meta.rank)
                continue
            self.table.setdefault(ident, {})[meta.rank] = meta
            self.inspector.seen(ident, now - age)
            if timeline is not None:
                timeline.negotiation_started(meta.name, meta.op)
                timeline.rank_ready(meta.name, meta.rank)

    def ready(
        self, process_sets: Mapping[int, ProcessSetState], world_size: int
    ) -> list[Response]:
        responses = []
        joined = set(self.joined)
        for ident in list(self.table):
            submitted = self.table[ident]
            process_set = process_sets.get(ident[0])
            if process_set is None:
                first = next(iter(submitted.values()))
                removed = RequestMeta(first.key, first.name, first.op, ident[0], first.rank)
                error = f"{first.name}: process set {ident[0]} was removed."
                responses.append(Response(removed, error=error))
                self._forget(ident)
                continue
            missing = [r for r in process_set.ranks if r not in submitted and r not in joined]
            if missing:
                continue
            metas = [submitted[r] for r in process_set.ranks if r in submitted]
            absent = tuple(r for r in process_set.ranks if r not in submitted)
            responses.append(build_response(metas, process_set.ranks, absent))
            self._forget(ident)
        if len(self.joined) == world_size:
            last = self.joined[-1]
            join = RequestMeta(JOIN_KEY, "join", OpType.JOIN, GLOBAL_PROCESS_SET_ID, last)
            responses.append(Response(join, last_joined=last))
            self.joined = []
        if self.timeline is not None and self.timeline.active:
            for response in responses:
                self.timeline.negotiation_ended(response.meta.name, response.meta.op)
        return responses

    def _forget(self, ident: tuple[int, str]) -> None:
        del self.table[ident]
        self.inspector.forget(ident)

    def check_stalls(
        self, process_sets: Mapping[int, ProcessSetState], now: float
    ) -> Notice | None:
        """Reports stalled requests; returns the notice that ends the job past the stall
        shutdown time."""
        if not self.table:
            return None
        return self.inspector.check(self.table, process_sets, self.joined, now)
