"""The response cache: lets steady-state training skip the metadata exchange.

Every rank holds the same entries in the same slots, because entries are only added, used
and evicted while processing responses that all ranks process in the same order. A rank
then announces a pending request by one bit (its slot); a bitwise AND over the ranks says
which cached collectives everybody has submitted, and a second vector of bits says which
entries some rank found stale (same name, different shape/dtype/...), so all ranks evict
them and negotiate those names in full again.

What may be cached is one rule (:func:`cache_key`): named data collectives, under their
name, and unnamed allreduces and broadcasts of the global set, under what they move (op,
dtype, shapes, device, reduce op, factors, root and fusion) and their position among the
unnamed collectives not yet agreed. Unnamed requests are paired by their order, so their own
keys mean nothing from one step to the next; their positions pair the n-th unnamed call of
every rank (see :mod:`~baguahvd.engine.negotiation`). Barriers, joins and process-set
changes are rare and carry no shape worth skipping. A response is cached only when it ran
(no error) with every member submitting (no joined rank), see :func:`response_cacheable`.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import cast

from baguahvd.engine.messages import (
    DATA_OPS,
    GLOBAL_PROCESS_SET_ID,
    UNNAMED_PREFIX,
    OpType,
    RequestMeta,
    Response,
    is_unnamed,
)
from baguahvd.engine.requests import Request

UNNAMED_CACHEABLE_OPS = frozenset({OpType.ALLREDUCE, OpType.BROADCAST})
"""Unnamed collectives whose response every rank can name from its own request: the same
shapes on every rank (an allgather's or alltoall's response holds the other ranks' sizes)."""


def may_cache(op: OpType, key: str) -> bool:
    """Whether a named collective of ``op`` negotiated under ``key`` may use the cache
    (unnamed ones: see :func:`cache_key`)."""
    return op in DATA_OPS and not is_unnamed(key)


def cache_key(item: RequestMeta, position: int = 0) -> Hashable | None:
    """The key a request (or the response it got, by its ``meta``) is cached under, None if
    never cached:
    the negotiation key of a named data collective; for an unnamed allreduce or broadcast of
    the global set, everything its response holds besides its name, the same on every
    rank, and its ``position`` among the unnamed collectives not yet agreed (see
    :mod:`~baguahvd.engine.negotiation`)."""
    op = item.op
    if op not in DATA_OPS:
        return None
    key = item.key
    if not is_unnamed(key):
        return key
    if op not in UNNAMED_CACHEABLE_OPS or item.process_set_id != GLOBAL_PROCESS_SET_ID:
        return None
    return (*unnamed_described(item), position)


def unnamed_described(item: RequestMeta) -> tuple[object, ...]:
    """The key of an unnamed allreduce or broadcast of the global set (:func:`cache_key`)
    without its position."""
    return (
        UNNAMED_PREFIX, item.op, item.dtype, item.shapes, item.device, item.reduce_op,
        item.prescale, item.postscale, item.root, item.fuse,
    )


def request_signature(meta: RequestMeta) -> tuple[object, ...]:
    """What a cached entry must match for ``meta`` to hit it: for an unnamed request, every
    field of the request but its key and name (:func:`unnamed_signature`)."""
    return unnamed_signature(meta) if is_unnamed(meta.key) else meta.signature()


def unnamed_signature(meta: RequestMeta) -> tuple[object, ...]:
    """:func:`request_signature` of an unnamed request: its fields but the key and the name,
    which change from one call to the next (a slice: ``_replace`` would cost more than the
    lookup it serves)."""
    return meta[2:]


def response_cacheable(response: Response) -> bool:
    """Whether every rank caches ``response`` once it has run."""
    return response.error is None and not response.joined and cache_key(response.meta) is not None


class Lookup(enum.Enum):
    HIT = 0
    STALE = 1
    MISS = 2


@dataclasses.dataclass
class CacheEntry:
    key: Hashable
    response: Response
    signature: tuple[object, ...] | None
    """This rank's own request signature; None where this rank had no request."""


class ResponseCache:
    """Fixed-capacity, least-recently-used map from (process set, key) to a response."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[int, CacheEntry] = {}
        self.entry_at: Callable[[int], CacheEntry | None] = self._entries.get
        """The entry in a slot, if any: the same object until it is evicted (entries are
        never changed), so a caller may keep it to see whether a slot still holds it."""
        self._slots: dict[tuple[int, Hashable], int] = {}
        self.slot_of: Callable[[tuple[int, Hashable]], int | None] = self._slots.get
        """The slot cached under (process set, key), if any (a named request's ``ident``)."""
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._taken: tuple[list[int], list[Response]] | None = None
        """The slots of the last :meth:`take` and their responses, while nothing has been
        put, touched or evicted since: the same slots taken again leave the order as it is
        (and a slot evicted since is refused as before, not answered from here)."""
        self._free = list(range(capacity))
        self.not_member = 0
        """Slots whose process set does not include this rank, bit ``s`` for slot ``s``:
        their bit is always set, so the AND over all ranks only depends on the members."""

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, process_set_id: int, key: Hashable, signature: tuple[object, ...] | None
    ) -> tuple[Lookup, int]:
        slot = self._slots.get((process_set_id, key))
        if slot is None:
            return Lookup.MISS, -1
        if self._entries[slot].signature == signature:
            return Lookup.HIT, slot
        return Lookup.STALE, slot

    def hits(self, requests: Sequence[Request]) -> list[int] | None:
        """The slots of ``requests`` when every one is a named hit, as a training loop's
        recurring burst is, found in a few passes over the whole list instead of a
        :meth:`lookup` each; None otherwise (then some request misses or is stale, or is
        not a named data collective).

        A request hits when the slot cached under its ``ident`` holds its own signature (the
        request's ``meta``, see :meth:`RequestMeta.signature`). Equal signatures also mean
        the same key and op: only named data collectives are cached under their name, so
        no unnamed request, nor any op kept out of the cache, passes.
        """
        slot_of = self.slot_of
        if not requests or slot_of(requests[0].ident) is None:  # unnamed or new: miss early
            return None
        found = list(map(slot_of, [request.ident for request in requests]))
        if None in found:
            return None
        slots = cast("list[int]", found)
        signatures = [self._entries[slot].signature for slot in slots]
        return slots if signatures == [request.meta for request in requests] else None

    def response(self, slot: int) -> Response:
        return self._entries[slot].response

    def put(
        self,
        response: Response,
        signature: tuple[object, ...] | None,
        member: bool,
        key: Hashable | None = None,
    ) -> list[int]:
        """Caches ``response`` (already executed by every rank) under ``key`` (default: its
        own), evicting the least recently used entry when full. Returns the slots it
        evicted."""
        if self.capacity == 0:
            return []
        evicted = []
        self._taken = None
        ident = (response.meta.process_set_id, response.meta.key if key is None else key)
        old = self._slots.get(ident)
        if old is not None:
            self.evict(old)
            evicted.append(old)
        if not self._free:
            oldest = next(iter(self._recent))
            self.evict(oldest)
            evicted.append(oldest)
        slot = heapq.heappop(self._free)
        self._entries[slot] = CacheEntry(ident[1], response, signature)
        self._slots[ident] = slot
        self._recent[slot] = None
        if member:
            self.not_member &= ~(1 << slot)
        else:
            self.not_member |= 1 << slot
        return evicted

    def touch(self, slot: int) -> None:
        self._taken = None
        self._recent.move_to_end(slot)

    def take(self, slots: list[int]) -> list[Response]:
        """The responses of ``slots``, each marked as used now (:meth:`response` and
        :meth:`touch` for a whole cycle's hits).

        A training loop's cycles take the same slots step after step: taken in the same
        order as by the last call, with nothing changed since, they are already the most
        recently used, in that order, and their responses are the last call's.
        """
        taken = self._taken
        if taken is not None and taken[0] == slots:
            return list(taken[1])
        entries = self._entries
        recent = self._recent.move_to_end
        responses = []
        for slot in slots:
            responses.append(entries[slot].response)
            recent(slot)
        self._taken = (list(slots), list(responses))
        return responses

    def evict(self, slot: int) -> None:
        self._taken = None
        entry = self._entries.pop(slot, None)
        if entry is None:
            return
        del self._slots[(entry.response.meta.process_set_id, entry.key)]
        del self._recent[slot]
        self.not_member &= ~(1 << slot)
        heapq.heappush(self._free, slot)

    def evict_process_set(self, process_set_id: int) -> None:
        for slot in [s for s, e in self._entries.items()
                     if e.response.meta.process_set_id == process_set_id]:
            self.evict(slot)

    def clear(self) -> None:
        for slot in list(self._entries):
            self.evict(slot)
