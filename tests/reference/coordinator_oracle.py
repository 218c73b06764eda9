"""Rank 0's matching as it reads every rank's report, one request at a time: the oracle the
merged tables of ``baguahvd.engine.negotiation`` (tally, tree, coordinator) are checked
against. Slow (ranks × requests per cycle) and plain: a table of every rank's request by
(process set, key), in the order they arrived."""

from __future__ import annotations

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


class OracleCoordinator:
    """Files each report's requests in rank order; answers what every member submitted."""

    def __init__(self, inspector: StallInspector) -> None:
        self.table: dict[tuple[int, str], dict[int, RequestMeta]] = {}
        self.joined: list[int] = []
        self.inspector = inspector

    def decide(
        self, reports: Sequence[RankReport], process_sets: Mapping[int, ProcessSetState],
        world_size: int, now: float,
    ) -> Decision:
        notice = first_notice(report.notice for report in reports)
        if notice is not None:
            return Decision([], (), notice)
        for report in reports:
            for meta, age in zip(report.metas, report.waited):
                ident = (meta.process_set_id, meta.key)
                if meta.op == OpType.JOIN:
                    if meta.rank not in self.joined:
                        self.joined.append(meta.rank)
                    continue
                self.table.setdefault(ident, {})[meta.rank] = meta
                self.inspector.seen(ident, now - age)
        return Decision(self._ready(process_sets, world_size), tuple(self.joined))

    def _ready(
        self, process_sets: Mapping[int, ProcessSetState], world_size: int
    ) -> list[Response]:
        responses = []
        for ident in list(self.table):
            submitted = self.table[ident]
            process_set = process_sets.get(ident[0])
            if process_set is None:
                first = next(iter(submitted.values()))
                removed = RequestMeta(first.key, first.name, first.op, ident[0], first.rank)
                responses.append(
                    Response(removed, error=f"{first.name}: process set {ident[0]} was removed.")
                )
                self._forget(ident)
                continue
            if any(r not in submitted and r not in self.joined for r in process_set.ranks):
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
        return responses

    def _forget(self, ident: tuple[int, str]) -> None:
        del self.table[ident]
        self.inspector.forget(ident)

    def check_stalls(
        self, process_sets: Mapping[int, ProcessSetState], now: float
    ) -> Notice | None:
        return self.inspector.check(self.table, process_sets, self.joined, now)
