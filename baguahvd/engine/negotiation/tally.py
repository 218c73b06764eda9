"""What rank 0 learns from the ranks' reports, merged: each request once, with the ranks
that sent it.

On a job of thousands of ranks nearly every rank sends the same requests, which differ only
in the submitter's rank. A :class:`Submissions` keeps one (process set, key)'s requests
compactly: each distinct request (every field but the rank) once, with the ranks that sent
it as ranges, so that merging the reports of a range of ranks costs the number of distinct
requests, not ranks × requests. A :class:`Tally` is what a range of ranks sent in one
cycle: their submissions by (process set, key), the ranks that joined and the notice that
ends the job, if any. Tallies merge in rank order (:meth:`Tally.add`): what comes out is
what rank 0 would have filed reading every rank's report in rank order, so its decisions
and messages are the same however the reports were merged
(:mod:`~baguahvd.engine.negotiation.tree`).

A rank has at most one request of a name in flight, so two merged tallies never hold a
request of the same rank under one (process set, key).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from baguahvd.engine.messages import OpType, RequestMeta, without_rank
from baguahvd.engine.notices import Notice, RankReport, first_notice

Ident = tuple[int, str]
"""(process set id, negotiation key)"""

Ranks = list[int]
"""Ranks as the bounds of sorted, disjoint, non-adjacent half-open ranges:
``[lo0, hi0, lo1, hi1, ...]`` holds ``lo0 .. hi0 - 1``, then ``lo1 .. hi1 - 1``."""


def union(a: Ranks, b: Ranks) -> Ranks:
    """The ranks of ``a`` and ``b`` (new list; the arguments are left as they are)."""
    if not a or not b:
        return [*a, *b]
    if a[-1] <= b[0]:  # merging in rank order: b follows a
        return [*a[:-1], *b[1:]] if a[-1] == b[0] else [*a, *b]
    spans = sorted([*zip(a[::2], a[1::2]), *zip(b[::2], b[1::2])])
    merged: Ranks = []
    for lo, hi in spans:
        if merged and lo <= merged[-1]:
            merged[-1] = max(merged[-1], hi)
        else:
            merged += [lo, hi]
    return merged


def holds(ranks: Ranks, rank: int) -> bool:
    """Whether ``rank`` is one of ``ranks``."""
    return bool(bisect.bisect_right(ranks, rank) & 1)


def count_among(ranks: Ranks, members: Sequence[int]) -> int:
    """How many of the sorted ``members`` are in ``ranks``."""
    count = 0
    for i in range(0, len(ranks), 2):
        count += bisect.bisect_left(members, ranks[i + 1]) - bisect.bisect_left(members, ranks[i])
    return count


def each(ranks: Ranks) -> Iterator[int]:
    """Every rank of ``ranks``, in order."""
    for i in range(0, len(ranks), 2):
        yield from range(ranks[i], ranks[i + 1])


class Submissions(Mapping[int, RequestMeta]):
    """One (process set, key)'s requests from some ranks, read as a mapping from rank to its
    request (see module docstring).

    Args:
        first: the request of the rank that submitted first (in the earliest cycle, the
            lowest rank): its name is the one stall reports and removed-set errors show.
        waited: the longest any of the requests had waited on its rank when sent.
        variants: each distinct request, as the request of the lowest rank that sent it,
            with the ranks that sent it.
    """

    __slots__ = ("first", "waited", "_variants")

    def __init__(
        self, first: RequestMeta, waited: float, variants: Iterable[Sequence[Any]]
    ) -> None:
        self.first = first
        self.waited = waited
        self._variants: dict[tuple[object, ...], list[Any]] = {
            without_rank(meta): [meta, ranks] for meta, ranks in variants
        }

    @classmethod
    def of(cls, meta: RequestMeta, waited: float) -> Submissions:
        """One rank's request."""
        return cls(meta, waited, [(meta, [meta.rank, meta.rank + 1])])

    def __reduce__(self) -> tuple[Any, ...]:
        return Submissions, (self.first, self.waited, list(self._variants.values()))

    def add(self, other: Submissions) -> None:
        """Adds ``other``'s requests, of ranks that came later: in a later cycle, or in this
        one from higher ranks (``first`` stays)."""
        if other.waited > self.waited:
            self.waited = other.waited
        variants = self._variants
        for key, (meta, ranks) in other._variants.items():
            mine = variants.get(key)
            if mine is None:
                variants[key] = [meta, ranks]
                continue
            if meta.rank < mine[0].rank:
                mine[0] = meta
            mine[1] = union(mine[1], ranks)

    def extend(self, meta: RequestMeta, waited: float) -> bool:
        """Adds the request of a rank above every rank here when it equals the only
        distinct request so far (the common case, without building a :class:`Submissions`
        for it); False, having added nothing, otherwise."""
        if len(self._variants) != 1:
            return False
        key, entry = next(iter(self._variants.items()))
        ranks: Ranks = entry[1]
        rank = meta.rank
        if rank < ranks[-1] or without_rank(meta) != key:
            return False
        entry[1] = [*ranks[:-1], rank + 1] if rank == ranks[-1] else [*ranks, rank, rank + 1]
        if waited > self.waited:
            self.waited = waited
        return True

    def agreed(self) -> RequestMeta | None:
        """The lowest rank's request when every rank sent the same one but for the rank,
        else None."""
        if len(self._variants) != 1:
            return None
        meta: RequestMeta = next(iter(self._variants.values()))[0]
        return meta

    def count_among(self, members: Sequence[int]) -> int:
        """How many of the sorted ``members`` submitted."""
        return sum(count_among(ranks, members) for _, ranks in self._variants.values())

    def requests(self) -> Iterator[RequestMeta]:
        """Every rank's request, one distinct request after the other."""
        for meta, ranks in self._variants.values():
            for rank in each(ranks):
                yield meta if rank == meta.rank else meta._replace(rank=rank)

    def __getitem__(self, rank: int) -> RequestMeta:
        for meta, ranks in self._variants.values():
            if holds(ranks, rank):
                return meta if rank == meta.rank else meta._replace(rank=rank)
        raise KeyError(rank)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and any(
            holds(ranks, rank) for _, ranks in self._variants.values()
        )

    def __iter__(self) -> Iterator[int]:
        """The first submitter, then the others by rank."""
        first = self.first.rank
        yield first
        others: list[int] = []
        for _, ranks in self._variants.values():
            others.extend(each(ranks))
        yield from sorted(rank for rank in others if rank != first)

    def __len__(self) -> int:
        return sum(
            ranks[i + 1] - ranks[i]
            for _, ranks in self._variants.values()
            for i in range(0, len(ranks), 2)
        )


class Tally:
    """What a range of ranks sent rank 0 in one cycle, merged (see module docstring).

    Args:
        requests: the submissions by (process set, key), in the order rank 0 files them: by
            the first rank that sent each, then its position in that rank's report.
        joined: the ranks whose report carries a join, in rank order.
        notice: the notice that ends the job, if some rank sent one: then nothing else
            counts, and the rest is dropped.
    """

    __slots__ = ("requests", "joined", "notice")

    def __init__(
        self,
        requests: dict[Ident, Submissions] | None = None,
        joined: list[int] | None = None,
        notice: Notice | None = None,
    ) -> None:
        self.requests: dict[Ident, Submissions] = {} if requests is None else requests
        self.joined: list[int] = [] if joined is None else joined
        self.notice = notice

    @classmethod
    def of_reports(cls, reports: Iterable[RankReport]) -> Tally:
        """The tally of ``reports``, given in rank order."""
        tally = cls()
        requests, joined = tally.requests, tally.joined
        for report in reports:
            if report.notice is not None:
                tally.notice = first_notice((tally.notice, report.notice))
            for meta, waited in zip(report.metas, report.waited):
                if meta.op == OpType.JOIN:
                    if meta.rank not in joined:
                        joined.append(meta.rank)
                    continue
                ident = (meta.process_set_id, meta.key)
                pending = requests.get(ident)
                if pending is None:
                    requests[ident] = Submissions.of(meta, waited)
                elif not pending.extend(meta, waited):
                    pending.add(Submissions.of(meta, waited))
        if tally.notice is not None:
            tally.drop()
        return tally

    def __reduce__(self) -> tuple[Any, ...]:
        return Tally, (self.requests, self.joined, self.notice)

    def add(self, other: Tally) -> None:
        """Adds the tally of the ranks that follow this one's."""
        if other.notice is not None or self.notice is not None:
            self.notice = first_notice((self.notice, other.notice))
            self.drop()
            return
        requests = self.requests
        for ident, submitted in other.requests.items():
            pending = requests.get(ident)
            if pending is None:
                requests[ident] = submitted
            else:
                pending.add(submitted)
        if other.joined:
            known = set(self.joined)
            self.joined.extend(rank for rank in other.joined if rank not in known)

    def drop(self) -> None:
        """Forgets the requests and joins: a cycle with a notice runs nothing."""
        self.requests = {}
        self.joined = []
