"""One rank's side of negotiation: what it announces each cycle and what it learns.

Each cycle every rank runs the same exchange on the control plane:

1. One bitwise AND over a byte vector: bit ``s`` of the first part says "my request for
   cache slot ``s`` is pending" (or "I am not a member of its set"); the second part says
   "slot ``s`` is still valid for me"; the last byte holds two flags whose cleared bit means
   yes: "I have something to send rank 0" and "I announce the end of the job", and one
   that stays set while "I have nothing pending" (see :meth:`Negotiator.pause_s`). A slot that
   every rank marked pending runs from the cache without rank 0; one that some rank marked
   invalid is evicted everywhere and its requests are negotiated in full.
2. Only when some rank has something to send: a gather of
   :class:`~baguahvd.engine.notices.RankReport` to rank 0, whose
   :class:`~baguahvd.engine.coordinator.Coordinator` answers every rank with one
   :class:`~baguahvd.engine.notices.Decision`.

Rank 0 also uses the second step to hand every rank new autotune settings
(:mod:`~baguahvd.engine.autotune`): while it holds a proposal it announces something to
send, so the exchange happens, and the decision carries the settings to every rank in the
same cycle.

Unnamed allreduces and broadcasts of the global set are cached under what they move (see
:mod:`~baguahvd.engine.cache`), which is safe only while the bits pair the n-th unnamed
call of every rank. So a rank lets only its oldest unnamed request, with no other unnamed
request of the set pending, wait on the cache (every rank has run the same unnamed
collectives, so the oldest is the same n everywhere), and two more flag bits say whether
it has an unnamed request in the full negotiation (then ranks whose oldest waits on the
cache send it in full too: rank 0 pairs it there) and whether its oldest waits on the
cache (if every rank's does and no slot is ready, their shapes differ: all send it in full,
and rank 0 answers with the mismatch error).

The cycle's agreed work is the cached hits (in slot order) followed by rank 0's responses.
Every rank then caches the same responses in the same order (:meth:`Negotiator.remember`),
which keeps the caches identical. While a rank has joined, nothing is answered from the
cache: cached announcements cannot count ranks that joined.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping

import numpy as np

from baguahvd.backends.base import ControlPlane
from baguahvd.engine.autotune import Settings
from baguahvd.engine.cache import (
    Lookup,
    ResponseCache,
    cache_key,
    is_unnamed,
    may_cache,
    response_cacheable,
)
from baguahvd.engine.coordinator import Coordinator
from baguahvd.engine.messages import GLOBAL_PROCESS_SET_ID, RequestMeta, Response
from baguahvd.engine.notices import Decision, Notice, RankReport
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Entry, Request
from baguahvd.engine.stall import StallInspector
from baguahvd.engine.timeline import Timeline

# Flag bits of the last byte of the negotiation vector; a cleared bit means "yes", except
# for FLAG_UNNAMED_WAITS, whose AND is set when every rank's is.
FLAG_NOTHING_TO_SEND = 1
FLAG_NO_SHUTDOWN = 2
FLAG_NO_UNNAMED_IN_FULL = 4
FLAG_UNNAMED_WAITS = 8
FLAG_IDLE = 16

IDLE_PAUSE_MAX_S = 0.016
"""The longest pause between the cycles of an engine whose job has nothing pending."""



class Negotiator:
    """The engine thread's negotiation state (see module docstring).

    Args:
        rank: this process's rank (rank 0 coordinates).
        size: number of ranks.
        control: the control plane the exchange runs on.
        process_sets: the registered process sets, by id (read, never changed here).
        cache_capacity: HOROVOD_CACHE_CAPACITY.
        inspector: the stall inspector.
        timeline: rank 0's timeline, if any.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        control: ControlPlane,
        process_sets: Mapping[int, ProcessSetState],
        cache_capacity: int,
        inspector: StallInspector,
        timeline: Timeline | None,
    ) -> None:
        self.rank, self.size, self.control = rank, size, control
        self.process_sets = process_sets
        self.timeline = timeline
        self.inspector = inspector
        self.cache = ResponseCache(cache_capacity)
        self._span = (cache_capacity + 7) // 8
        """Bytes of each bit vector in the announcement: bit ``s % 8`` of byte ``s // 8``
        stands for slot ``s``."""
        self._all_slots = (1 << cache_capacity) - 1
        self._all_valid = self._all_slots.to_bytes(self._span, "little")
        self.waiting_on_cache: dict[int, Request] = {}
        """Requests admitted as cache hits, by slot."""
        self.stale_slots: set[int] = set()
        """Slots this rank reports invalid in the next cycle."""
        self.to_send: list[Request] = []
        """Requests to send rank 0 in full in the next cycle."""
        self.unnamed_pending = 0
        """Unnamed requests of the global set admitted and not yet run (see module
        docstring)."""
        self.exchanges = 0
        """Cycles that went through rank 0 (the cache answered the others)."""
        self.unnamed_head: tuple[int, Request] | None = None
        """The unnamed request waiting on the cache, with its slot (at most one)."""
        self.sent: dict[tuple[int, str], Request] = {}
        """Requests sent to rank 0 and not answered yet."""
        self.join_mode = False
        self.coordinator = Coordinator(inspector, timeline) if rank == 0 else None
        self.proposal: Settings | None = None
        """(Rank 0) Autotune settings to send every rank in the next decision."""
        self.agreed_settings: Settings | None = None
        """Autotune settings received in this cycle's decision, not yet applied."""
        self.idle_cycles = 0
        """Cycles in a row in which no rank had anything pending."""

    def in_flight(self) -> bool:
        """Whether some request waits for the other ranks (the next cycle starts at once)."""
        return bool(self.sent or self.waiting_on_cache or self.to_send or self.proposal)

    def pause_s(self, cycle_time_ms: float) -> float:
        """How long the engine waits for a submission before its next cycle.

        Nothing while a request of this rank is in flight: the peers wait for its
        announcement. Otherwise the cycle time, doubled after every cycle in which no rank
        had anything pending, up to :data:`IDLE_PAUSE_MAX_S`. An idle cycle is a round trip
        between all ranks whose wait costs a fraction of a millisecond of CPU: at one per
        millisecond an idle engine took 14-24% of a core, which the training threads on the
        same cores need (``benchmarks/idle_engine.py``). A submission wakes its engine at
        once whatever the pause. Jobs with process sets besides the global one keep the
        cycle time: a set's collective needs a cycle of the non-members too, which no
        submission of theirs wakes (after a pause of the whole job, the first one waited
        16.6 ms instead of 1.6 ms).
        """
        if self.in_flight():
            return 0.0
        base = cycle_time_ms / 1000.0
        if not self.idle_cycles or len(self.process_sets) > 1:
            return base
        return min(base * 2.0 ** min(self.idle_cycles, 16), max(base, IDLE_PAUSE_MAX_S))

    # -- admitting new requests -----------------------------------------------------------

    def admit_all(self, requests: list[Request]) -> None:
        """:meth:`admit` for a cycle's new requests, with the common case (a named cache
        hit) inline."""
        cache = self.cache
        if self.join_mode or cache.capacity == 0:
            for request in requests:
                self.admit(request)
            return
        lookup = cache.lookup
        waiting = self.waiting_on_cache
        timeline = self.timeline
        traced = timeline is not None and timeline.active
        for request in requests:
            meta = request.meta
            if may_cache(meta.op, meta.key):
                found, slot = lookup(meta.process_set_id, meta.key, meta.signature())
                if found is Lookup.HIT:
                    waiting[slot] = request
                    if traced:
                        assert timeline is not None
                        timeline.negotiation_started(meta.name, meta.op)
                    continue
            self.admit(request)

    def admit(self, request: Request) -> None:
        """Files a new request: as a cache hit, or to be sent to rank 0."""
        meta = request.meta
        unnamed = _counted(meta)
        if unnamed:
            self.unnamed_pending += 1
        key = None if self.join_mode or self.cache.capacity == 0 else cache_key(meta)
        if key is None or (unnamed and self.unnamed_pending > 1):
            self.to_send.append(request)
            return
        found, slot = self.cache.lookup(meta.process_set_id, key, _signature(meta))
        if found is Lookup.HIT:
            self.waiting_on_cache[slot] = request
            if unnamed:
                self.unnamed_head = (slot, request)
            if self.timeline is not None and self.timeline.active:
                self.timeline.negotiation_started(meta.name, meta.op)
            return
        if found is Lookup.STALE:
            self.stale_slots.add(slot)
        self.to_send.append(request)

    def _head_waits(self) -> bool:
        """Whether this rank's oldest unnamed request still waits on the cache."""
        head = self.unnamed_head
        if head is not None and self.waiting_on_cache.get(head[0]) is head[1]:
            return True
        self.unnamed_head = None
        return False

    # -- the cycle --------------------------------------------------------------------------

    def announcement(self, notice: Notice | None, busy: bool = False) -> np.ndarray:
        """This rank's byte vector for the cycle's bitwise AND (see module docstring);
        ``busy``: this rank has collectives running that the engine waits for."""
        span = self._span
        hits = self.cache.not_member | _bits(self.waiting_on_cache.keys(), span)
        valid = self._all_valid
        if self.stale_slots:
            invalid = _bits(self.stale_slots, span)
            valid = (self._all_slots & ~invalid).to_bytes(span, "little")
            self.stale_slots.clear()
        flags = 0xFF
        if busy or notice is not None or self.in_flight():
            flags &= ~FLAG_IDLE
        if self.to_send or notice is not None or self.proposal is not None:
            flags &= ~FLAG_NOTHING_TO_SEND
        if notice is not None:
            flags &= ~FLAG_NO_SHUTDOWN
        if self.unnamed_pending:
            head_waits = self._head_waits()
            if self.unnamed_pending > head_waits:
                flags &= ~FLAG_NO_UNNAMED_IN_FULL
            if not head_waits:
                flags &= ~FLAG_UNNAMED_WAITS
        else:
            flags &= ~FLAG_UNNAMED_WAITS
        return _vector(hits.to_bytes(span, "little") + valid + bytes((flags,)))

    @staticmethod
    def end_agreed(agreed: np.ndarray) -> bool:
        """Whether some rank announced the end of the job in this cycle."""
        return not int(agreed[-1]) & FLAG_NO_SHUTDOWN

    def cached_work(self, agreed: np.ndarray) -> list[Entry]:
        """The cycle's cached hits that every rank announced, from the AND of every rank's
        vector, in slot order; evicts the slots some rank found stale (their requests are
        sent in full)."""
        span = self._span
        words = agreed.tobytes()
        flags = words[-1]
        self.idle_cycles = self.idle_cycles + 1 if flags & FLAG_IDLE else 0
        ready = int.from_bytes(words[:span], "little")
        if words[span : 2 * span] != self._all_valid:
            invalid = self._all_slots & ~int.from_bytes(words[span : 2 * span], "little")
            ready &= ~invalid
            for slot in _set_bits(invalid, span):
                self.cache.evict(slot)
                stale = self.waiting_on_cache.pop(slot, None)
                if stale is not None:
                    self.to_send.append(stale)
        slots = _set_bits(ready, span)
        waiting = self.waiting_on_cache.pop
        entries: list[Entry] = [
            (response, waiting(slot, None))
            for slot, response in zip(slots, self.cache.take(slots))
        ]
        if self.unnamed_pending:
            self._settle_unnamed(entries, flags)
        return entries

    @staticmethod
    def exchange_agreed(agreed: np.ndarray) -> bool:
        """Whether some rank has something to send rank 0 in this cycle: then every rank
        takes part in :meth:`negotiate`."""
        return not int(agreed[-1]) & FLAG_NOTHING_TO_SEND

    def answered(self, responses: list[Response]) -> list[Entry]:
        """Rank 0's responses of this cycle, each with this rank's request for it."""
        sent = self.sent.pop
        entries: list[Entry] = []
        for response in responses:
            request = sent((response.process_set_id, response.key), None)
            if request is not None and self.unnamed_pending and _counted(request.meta):
                self.unnamed_pending -= 1
            entries.append((response, request))
        return entries

    def _settle_unnamed(self, entries: list[Entry], flags: int) -> None:
        """The cached hits' part of a cycle for unnamed requests: a hit runs under its own
        name; an oldest unnamed request that stays waiting goes to rank 0 in full when some
        rank has one there or when every rank's waits (see module docstring)."""
        for index, (response, request) in enumerate(entries):
            if request is not None and _counted(request.meta):
                meta = request.meta
                entries[index] = (response._replace(key=meta.key, name=meta.name), request)
                self.unnamed_pending -= 1
        if not self._head_waits():
            return
        if not flags & FLAG_NO_UNNAMED_IN_FULL or flags & FLAG_UNNAMED_WAITS:
            assert self.unnamed_head is not None
            slot, request = self.unnamed_head
            del self.waiting_on_cache[slot]
            self.unnamed_head = None
            self.to_send.append(request)

    def negotiate(self, notice: Notice | None) -> Decision:
        """Sends the requests to send (and ``notice``) to rank 0; returns its decision."""
        now = time.monotonic()
        metas = [request.meta for request in self.to_send]
        waited = [now - request.submitted for request in self.to_send]
        for request in self.to_send:
            self.sent[(request.meta.process_set_id, request.meta.key)] = request
        self.to_send = []
        decision = self.exchange(RankReport(metas, waited, notice))
        join_mode = bool(decision.joined)
        if join_mode and not self.join_mode:
            # Cached announcements cannot count ranks that joined: renegotiate in full.
            self.to_send.extend(self.waiting_on_cache.values())
            self.waiting_on_cache.clear()
        self.join_mode = join_mode
        return decision

    def exchange(self, report: RankReport) -> Decision:
        """Sends this rank's report to rank 0 and returns rank 0's decision."""
        self.exchanges += 1
        gathered = self.control.gather(report)
        decision: Decision | None = None
        if self.coordinator is not None:
            assert gathered is not None
            decision = self.coordinator.decide(gathered, self.process_sets, self.size)
            if self.proposal is not None and decision.notice is None:
                decision = decision._replace(settings=self.proposal)
                self.proposal = None
        result: Decision = self.control.broadcast(decision)
        if result.settings is not None:
            self.agreed_settings = result.settings
        return result

    def propose(self, settings: Settings) -> None:
        """(Rank 0) Hands ``settings`` to every rank in the next cycle's decision."""
        self.proposal = settings

    def take_agreed_settings(self) -> Settings | None:
        """Settings this cycle's decision carried (once), to apply when the cycle ends."""
        agreed, self.agreed_settings = self.agreed_settings, None
        return agreed

    def announce_end(self, notice: Notice) -> None:
        """Runs the announcing half of a cycle with nothing but ``notice`` in it."""
        flags = 0xFF & ~FLAG_NOTHING_TO_SEND & ~FLAG_NO_SHUTDOWN
        self.control.bitwise_and(_vector(bytes(self._span) + self._all_valid + bytes((flags,))))
        self.exchange(RankReport([], [], notice))

    def remember(self, response: Response, request: Request | None) -> None:
        """Caches a negotiated response; every rank calls this for the same responses in the
        same order, so the caches stay identical."""
        if not response_cacheable(response):
            return
        state = self.process_sets.get(response.process_set_id)
        if state is None:
            return
        key = cache_key(response)
        signature = None if request is None else _signature(request.meta)
        for slot in self.cache.put(response, signature, state.includes(self.rank), key):
            # A request admitted as a hit on an entry that is now gone (ranks admit requests
            # in different cycles) must be negotiated in full, or it waits on a slot that
            # another name will reuse.
            waiting = self.waiting_on_cache.pop(slot, None)
            if waiting is not None:
                self.to_send.append(waiting)

    # -- stalls, removed sets, the end ------------------------------------------------------

    def check_stalls(self, now: float) -> Notice | None:
        """Invalidates the cache entries this rank's requests have waited on too long (they
        are then negotiated in full, visible to rank 0); on rank 0, reports stalls and
        returns the notice that ends the job past the stall shutdown time."""
        self.stale_slots.update(self.inspector.stale_cache_waits(self.waiting_on_cache, now))
        if self.coordinator is None:
            return None
        return self.coordinator.check_stalls(self.process_sets, now)

    def forget_process_set(self, ident: int) -> list[Request]:
        """Evicts a removed set's entries; returns the requests that waited on them (they
        can never run)."""
        self.cache.evict_process_set(ident)
        orphans = []
        for slot, request in list(self.waiting_on_cache.items()):
            if request.meta.process_set_id == ident:
                del self.waiting_on_cache[slot]
                orphans.append(request)
        return orphans

    def drain(self) -> list[Request]:
        """Takes every request this rank still negotiates (the engine stops)."""
        pending = [*self.to_send, *self.sent.values(), *self.waiting_on_cache.values()]
        self.to_send = []
        self.sent.clear()
        self.waiting_on_cache.clear()
        return pending


_FEW_BITS = 16
"""Up to this many slots, bits are set and found one by one in Python integers; beyond,
numpy does it in bulk (a burst of hundreds of cache hits)."""


def _vector(words: bytes) -> np.ndarray:
    """The control plane's writable ``uint8`` vector holding ``words``."""
    return np.frombuffer(bytearray(words), dtype=np.uint8)


def _bits(slots: Collection[int], span: int) -> int:
    """An integer with bit ``s`` set for each slot ``s`` of ``slots``."""
    if len(slots) <= _FEW_BITS:
        bits = 0
        for slot in slots:
            bits |= 1 << slot
        return bits
    marked = np.zeros(span * 8, dtype=bool)
    marked[list(slots)] = True
    return int.from_bytes(np.packbits(marked, bitorder="little").tobytes(), "little")


def _set_bits(bits: int, span: int) -> list[int]:
    """The positions of the set bits of ``bits`` (below ``span`` bytes), lowest first."""
    positions: list[int] = []
    for _ in range(_FEW_BITS):
        if not bits:
            return positions
        lowest = bits & -bits
        positions.append(lowest.bit_length() - 1)
        bits ^= lowest
    if bits:
        rest = np.frombuffer(bits.to_bytes(span, "little"), dtype=np.uint8)
        positions += np.flatnonzero(np.unpackbits(rest, bitorder="little")).tolist()
    return positions


def _counted(meta: RequestMeta) -> bool:
    """Whether ``meta`` is an unnamed request of the global set (counted in
    :attr:`Negotiator.unnamed_pending`)."""
    return meta.process_set_id == GLOBAL_PROCESS_SET_ID and is_unnamed(meta.key)


def _signature(meta: RequestMeta) -> tuple[object, ...]:
    """What a cached entry must match for ``meta`` to hit it: for an unnamed request, the
    request without its key and name, which change from one call to the next."""
    return meta._replace(key="", name="") if is_unnamed(meta.key) else meta.signature()
