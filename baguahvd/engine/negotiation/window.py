"""One rank's unnamed requests of the global set that wait on the response cache, the
positions they are looked up and cached under, and the names they run under (the protocol
is in :mod:`baguahvd.engine.negotiation`).

The request ``noname.N`` is looked up at position ``N - base``, where ``base`` is the number
of the oldest unnamed collective of the global set not yet agreed. Every rank processes the
same responses, so ``base`` is the same on every rank between cycles, and a position names
the same collective everywhere.

A request that runs from the cache runs under the cached response, which bears the name of
the call it was agreed for (``noname.K`` of an earlier burst): nothing that runs it reads
names, and what shows names (the timeline, error messages, autotune's counts) takes them
from this rank's request. So a recurring burst hands out the same responses cycle after
cycle, and reuses its fusion plan (:class:`~baguahvd.engine.execution.fusion.FusionPlans`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from baguahvd.engine.messages import (
    GLOBAL_PROCESS_SET_ID,
    UNNAMED_PREFIX,
    RequestMeta,
    is_unnamed,
    unnamed_number,
)
from baguahvd.engine.negotiation.bits import slot_bits
from baguahvd.engine.negotiation.cache import (
    UNNAMED_CACHEABLE_OPS,
    CacheEntry,
    Lookup,
    ResponseCache,
    cache_key,
    unnamed_described,
    unnamed_signature,
)
from baguahvd.engine.requests import Request

LOOKUPS_MIN = 256
"""The most requests looked up in one cycle at first: a rank far ahead of its peers looks
its waiting requests up again every cycle, so a bound keeps what a cycle costs it near what
the job's runs need. Each time a run takes every request the bound let a cycle look up, the
bound doubles (up to the cache's capacity), so that a recurring burst longer than it soon
runs in one cycle."""


def counted(process_set_id: int, key: str) -> bool:
    """Whether a request or response is an unnamed one of the global set."""
    return process_set_id == GLOBAL_PROCESS_SET_ID and is_unnamed(key)


class _Found(NamedTuple):
    """What the last lookup found from position 0 on: the slot, entry and entry's signature
    of each position up to the first miss (see :meth:`UnnamedWindow.look_up`), and the
    bits of all its slots, once made."""

    slots: list[int]
    entries: list[CacheEntry]
    signatures: list[tuple[object, ...]]
    mask: int | None = None
    """The bits of :attr:`slots` (bit ``s`` for slot ``s``), once made."""


class UnnamedWindow:
    """The waiting requests, oldest first, and the cache slots this cycle found for them;
    ``capacity``: the response cache's."""

    def __init__(self, capacity: int) -> None:
        self.requests: list[Request] = []
        # Per request, what its lookup takes (a request may be looked up in several
        # cycles): its number, its signature and its description.
        self._numbers: list[int] = []
        self._signatures: list[tuple[object, ...]] = []
        self._metas: list[RequestMeta] = []
        self._hits: dict[int, tuple[int, CacheEntry]] = {}
        """The slot and entry each position last hit. A request whose signature is the
        entry's, while that entry still holds the slot, has the key the entry was found
        under (the key is made of fields of the signature), so it hits the same slot
        without a key being built and hashed: a recurring burst looks itself up at the cost
        of a signature comparison per request."""
        self._found = _Found([], [], [])
        """What the last lookup found (see :meth:`look_up`)."""
        self.slots: list[int] = []
        """The slot of each request from the oldest on, as far as they hit in this cycle's
        lookup (:meth:`look_up`)."""
        self._mask: int | None = None
        """The bits of :attr:`slots`, once :meth:`slot_mask` has made them."""
        self.base = 0
        """The number of the oldest unnamed collective of the global set not yet agreed."""
        self._cycle_base = 0
        """:attr:`base` when this cycle's lookup ran: the cycle's responses are cached under
        positions counted from it (:meth:`cache_key`)."""
        self.lookups_max = LOOKUPS_MIN
        """The most requests a cycle looks up (see :data:`LOOKUPS_MIN`)."""
        self._lookups_cap = max(capacity, LOOKUPS_MIN)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        """Queues a new unnamed allreduce or broadcast of the global set after the others."""
        self._append([request], [request.meta])

    def add_all(self, requests: list[Request], pending: int) -> bool:
        """Queues ``requests`` after the others when every one is an unnamed allreduce or
        broadcast of the global set and each of the ``pending`` unnamed requests before them
        waits here (then each would join the window in turn, see
        :meth:`~baguahvd.engine.negotiation.negotiator.Negotiator.admit_all`): one pass
        over a burst instead of a call each. Queues nothing and returns False otherwise."""
        if pending != len(self.requests):
            return False
        metas = [request.meta for request in requests]
        unnamed = UNNAMED_PREFIX
        for meta in metas:
            if (meta.process_set_id != GLOBAL_PROCESS_SET_ID
                    or meta.op not in UNNAMED_CACHEABLE_OPS or not meta.key.startswith(unnamed)):
                return False
        self._append(requests, metas)
        return True

    def _append(self, requests: list[Request], metas: list[RequestMeta]) -> None:
        self.requests += requests
        # unnamed_number() of each, without a call each.
        start = len(UNNAMED_PREFIX)
        self._numbers += [int(meta.key[start:]) for meta in metas]
        self._signatures += map(unnamed_signature, metas)
        self._metas += metas

    def look_up(self, cache: ResponseCache) -> int | None:
        """Starts a cycle (every rank, every cycle: the positions of the cycle's responses
        count from here) and finds the slots of the waiting requests from the oldest on, up
        to the first that misses. Returns the slot of an entry found stale there (to
        invalidate everywhere), else None.

        A recurring burst finds what the last lookup found: the same positions, holding
        requests of the same signatures, whose entries are still in their slots. That is
        checked for the whole burst in a few list comparisons; otherwise each request is
        looked up in turn."""
        self._cycle_base = base = self.base
        self._mask = None
        count = min(len(self.requests), self.lookups_max)
        found = self._found
        if count <= len(found.slots):
            slots = found.slots[:count]
            if (
                self._numbers[:count] == list(range(base, base + count))
                and self._signatures[:count] == found.signatures[:count]
                and list(map(cache.entry_at, slots)) == found.entries[:count]
            ):
                self.slots = slots
                if count == len(found.slots):
                    self._mask = found.mask
                return None
        return self._look_up_each(cache, base, count)

    def _look_up_each(self, cache: ResponseCache, base: int, count: int) -> int | None:
        """:meth:`look_up`, one request at a time; keeps what it found for the next."""
        slots: list[int] = []
        entries: list[CacheEntry] = []
        self.slots = slots
        lookup = cache.lookup
        entry_at = cache.entry_at
        hit = Lookup.HIT
        hits = self._hits
        for number, signature, meta in zip(
            self._numbers[:count], self._signatures[:count], self._metas[:count]
        ):
            position = number - base
            known = hits.get(position)
            if known is not None:
                slot, entry = known
                if entry_at(slot) is entry and entry.signature == signature:
                    slots.append(slot)
                    entries.append(entry)
                    continue
            found, slot = lookup(
                GLOBAL_PROCESS_SET_ID, (*unnamed_described(meta), position), signature
            )
            if found is not hit:
                self._keep_found(base, entries)
                return slot if found is Lookup.STALE else None
            slots.append(slot)
            if len(hits) >= self._lookups_cap:
                hits.clear()
            found_entry = entry_at(slot)
            assert found_entry is not None  # a hit's slot holds its entry
            entries.append(found_entry)
            hits[position] = (slot, found_entry)
        self._keep_found(base, entries)
        return None

    def _keep_found(self, base: int, entries: list[CacheEntry]) -> None:
        """Keeps the slots and entries just found for the next lookup, where they are those
        of positions 0, 1, 2... (:meth:`look_up`); else what it kept before stays."""
        slots = self.slots
        count = len(slots)
        # Not where some position in between is another collective's (sent in full).
        if count and self._numbers[:count] == list(range(base, base + count)):
            self._found = _Found(list(slots), entries, self._signatures[:count])

    def slot_mask(self, span: int) -> int:
        """The bits of :attr:`slots` (bit ``s`` for slot ``s``), made once per cycle."""
        if self._mask is None:
            self._mask = slot_bits(self.slots, span)
            found = self._found
            if found.mask is None and self.slots == found.slots:
                # All the last lookup found: the next burst like it takes the bits as well.
                self._found = found._replace(mask=self._mask)
        return self._mask

    def take_run(self, ready: int) -> tuple[int, dict[int, Request]]:
        """The requests that run from the cache in this cycle: the longest run from the
        oldest whose slots every rank announced. Every rank finds the same run, since a slot
        is in the AND only where every rank has the same collective at that position; later
        ready slots wait for the next cycle, so unnamed collectives keep their order.
        Returns ``ready`` without those later slots, and the run by slot."""
        slots = self.slots
        requests = self.requests
        mask = self._mask
        if mask is not None and ready & mask == mask:  # all of them: a recurring burst
            run = dict(zip(slots, requests))
        else:
            run = {}
            for index, slot in enumerate(slots):
                if not ready >> slot & 1:
                    for later in slots[index:]:
                        ready &= ~(1 << later)
                    break
                run[slot] = requests[index]
        if len(run) == self.lookups_max:
            self.lookups_max = min(2 * self.lookups_max, self._lookups_cap)
        taken = len(run)
        del requests[:taken], self._numbers[:taken], self._signatures[:taken]
        del self._metas[:taken]
        self.slots = []
        self._mask = None
        self.base += taken
        return ready, run

    def agreed(self, key: str) -> None:
        """Counts an unnamed collective of the global set agreed by rank 0."""
        self.base = max(self.base, unnamed_number(key) + 1)

    def cache_key(self, meta: RequestMeta) -> Hashable | None:
        """The key a response agreed in this cycle is cached under (:func:`cache_key`): an
        unnamed one of the global set's under its position counted from the cycle's base."""
        if counted(meta.process_set_id, meta.key):
            return cache_key(meta, unnamed_number(meta.key) - self._cycle_base)
        return cache_key(meta)

    def take_all(self) -> list[Request]:
        """Empties the window (its requests go to rank 0 in full, or the engine stops)."""
        requests, self.requests, self.slots = self.requests, [], []
        self._numbers, self._signatures, self._metas = [], [], []
        self._mask = None
        return requests
