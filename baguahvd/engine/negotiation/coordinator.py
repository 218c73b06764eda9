"""Rank 0's side of negotiation: matching requests across ranks.

Every cycle rank 0 receives the :class:`~baguahvd.engine.negotiation.tally.Tally` of every
rank's :class:`~baguahvd.engine.notices.RankReport` (:mod:`~baguahvd.engine.negotiation.tree`).
A notice in any report ends the job (the first by precedence wins) and the cycle runs
nothing. Otherwise each request is filed under (process set, key); once every member of
its set has submitted it, or joined, :func:`~baguahvd.engine.messages.build_response` checks
that they agree and turns them into one response (or the mismatch error every member
raises). Requests that every member sent alike but for the rank are answered from one of
them, so a cycle costs the distinct requests, not ranks × requests. Once every rank has
joined, a JOIN response completes the joins. Rank 0 also times what waits here
(:mod:`~baguahvd.engine.negotiation.stall`) and records negotiation in the timeline.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from baguahvd.engine.messages import (
    GLOBAL_PROCESS_SET_ID,
    JOIN_KEY,
    OpType,
    RequestMeta,
    Response,
    build_response,
    passes_alone,
)
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.negotiation.tally import Ident, Submissions, Tally
from baguahvd.engine.notices import Decision, Notice
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.timeline import Timeline


class Coordinator:
    """Rank 0's table of requests that not every member has submitted yet."""

    def __init__(self, inspector: StallInspector, timeline: Timeline | None) -> None:
        self.table: dict[Ident, Submissions] = {}
        self.joined: list[int] = []
        self.inspector = inspector
        self.timeline = timeline

    def decide(
        self,
        tally: Tally,
        process_sets: Mapping[int, ProcessSetState],
        world_size: int,
        now: float,
    ) -> Decision:
        """Rank 0's answer to the cycle's reports, received at ``now`` (``time.monotonic``):
        the collectives every member has now submitted or, when a rank announced the end of
        the job, that end alone."""
        if tally.notice is not None:
            return Decision([], (), tally.notice)
        self.add(tally, now)
        return Decision(self.ready(process_sets, world_size), tuple(self.joined))

    def add(self, tally: Tally, now: float) -> None:
        known = set(self.joined)
        self.joined.extend(rank for rank in tally.joined if rank not in known)
        timeline = self.timeline if self.timeline is not None and self.timeline.active else None
        table = self.table
        for ident, submitted in tally.requests.items():
            self.inspector.seen(ident, now - submitted.waited)
            if timeline is not None:
                for meta in submitted.requests():
                    timeline.negotiation_started(meta.name, meta.op)
                    timeline.rank_ready(meta.name, meta.rank)
            pending = table.get(ident)
            if pending is None:
                table[ident] = submitted
            else:
                pending.add(submitted)

    def ready(
        self, process_sets: Mapping[int, ProcessSetState], world_size: int
    ) -> list[Response]:
        responses = []
        joined = sorted(self.joined)
        for ident in list(self.table):
            submitted = self.table[ident]
            process_set = process_sets.get(ident[0])
            if process_set is None:
                first = submitted.first
                removed = RequestMeta(first.key, first.name, first.op, ident[0], first.rank)
                error = f"{first.name}: process set {ident[0]} was removed."
                responses.append(Response(removed, error=error))
                self._forget(ident)
                continue
            members = process_set.ranks
            absent = _absent(submitted, members, joined)
            if absent is None:
                continue
            agreed = submitted.agreed()
            if agreed is not None and passes_alone(agreed):
                responses.append(build_response([agreed], members, absent))
            else:
                metas = [submitted[r] for r in members if r in submitted]
                responses.append(build_response(metas, members, absent))
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

    def _forget(self, ident: Ident) -> None:
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


def _absent(
    submitted: Submissions, members: Sequence[int], joined: Sequence[int]
) -> tuple[int, ...] | None:
    """The members (sorted) that joined instead of submitting, once every member has done
    one or the other; None while some member has done neither. ``joined``: sorted."""
    present = submitted.count_among(members)
    if present == len(members):
        return ()
    absent = tuple(
        rank for rank in joined
        if _is_member(members, rank) and rank not in submitted
    )
    return absent if present + len(absent) == len(members) else None


def _is_member(members: Sequence[int], rank: int) -> bool:
    at = bisect.bisect_left(members, rank)
    return at < len(members) and members[at] == rank
