"""One rank's side of negotiation: what it announces each cycle and what it learns (the
protocol is in :mod:`baguahvd.engine.negotiation`)."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from baguahvd.backends.base import ControlPlane
from baguahvd.engine.autotune import Settings
from baguahvd.engine.messages import (
    DATA_OPS,
    GLOBAL_PROCESS_SET_ID,
    UNNAMED_PREFIX,
    OpType,
    Response,
)
from baguahvd.engine.negotiation.bits import (
    FLAG_NO_SHUTDOWN,
    FLAG_NO_UNNAMED_IN_FULL,
    FLAG_NOTHING_TO_SEND,
    FLAG_UNNAMED_WAITS,
    set_bits,
    slot_bits,
    vector,
)
from baguahvd.engine.negotiation.cache import (
    UNNAMED_CACHEABLE_OPS,
    Lookup,
    ResponseCache,
    request_signature,
    response_cacheable,
)
from baguahvd.engine.negotiation.coordinator import Coordinator
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.negotiation.tree import collect
from baguahvd.engine.negotiation.window import UnnamedWindow, counted
from baguahvd.engine.notices import Decision, Notice, RankReport
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Entry, Request
from baguahvd.engine.timeline import Timeline

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
        self.unnamed_window = UnnamedWindow(cache_capacity)
        """This rank's unnamed requests of the global set that wait on the cache; empty
        while one of them is negotiated in full (see module docstring)."""
        self.exchanges = 0
        """Cycles that went through rank 0 (the cache answered the others)."""
        self.sent: dict[tuple[int, str], Request] = {}
        """Requests sent to rank 0 and not answered yet."""
        self.join_mode = False
        self.coordinator = Coordinator(inspector, timeline) if rank == 0 else None
        self.proposal: Settings | None = None
        """(Rank 0) Autotune settings to send every rank in the next decision."""
        self.agreed_settings: Settings | None = None
        """Autotune settings received in this cycle's decision, not yet applied."""
        self.idle_cycles = 0
        """Cycles in a row in which this rank had nothing pending."""
        self.announced_idle = False
        """Whether this rank had no request and no notice pending at its announcement."""

    def in_flight(self) -> bool:
        """Whether some request waits for the other ranks (the next cycle starts at once)."""
        pending = self.sent or self.waiting_on_cache or self.unnamed_window or self.to_send
        return bool(pending or self.proposal)

    def pause_s(self, cycle_time_ms: float) -> float:
        """How long the engine waits for a submission before its next cycle.

        Nothing while a request of this rank is in flight: the peers wait for its
        announcement. Otherwise the cycle time, doubled after every cycle in which this
        rank had nothing pending, up to :data:`IDLE_PAUSE_MAX_S`, also while other ranks
        wait for it: they wait for a request it has yet to submit, and its submission wakes
        the engine at once whatever the pause. An idle cycle is a round trip between all
        ranks whose wait costs a fraction of a millisecond of CPU: at one per millisecond
        an idle engine took 14-24% of a core, which the training threads on the same cores
        need (``benchmarks/idle_engine.py``). Jobs with process sets besides the global one
        keep the cycle time: a set's collective needs a cycle of the non-members too, which
        no submission of theirs wakes (after a pause of the whole job, the first one waited
        16.6 ms instead of 1.6 ms)."""
        if self.in_flight():
            return 0.0
        base = cycle_time_ms / 1000.0
        if not self.idle_cycles or len(self.process_sets) > 1:
            return base
        return min(base * 2.0 ** min(self.idle_cycles, 16), max(base, IDLE_PAUSE_MAX_S))

    # -- admitting new requests -----------------------------------------------------------

    def admit_all(self, requests: list[Request]) -> None:
        """Files a cycle's new requests: named ones as cache hits (looked up now); unnamed
        allreduces and broadcasts of the global set in the unnamed window (looked up at the
        cycle's announcement, by their position); anything else, and what misses, to be
        sent to rank 0 in full."""
        cached = not self.join_mode and self.cache.capacity > 0
        timeline = self.timeline
        traced = timeline is not None and timeline.active
        hits = self.cache.hits(requests) if cached else None
        if hits is not None:  # a burst of named hits, looked up in bulk
            self.waiting_on_cache.update(zip(hits, requests))
            if traced:
                assert timeline is not None
                for request in requests:
                    timeline.negotiation_started(request.meta.name, request.meta.op)
            return
        if cached and self.unnamed_window.add_all(requests, self.unnamed_pending):
            self.unnamed_pending += len(requests)  # a burst of unnamed ones, all in the window
            return
        lookup = self.cache.lookup
        for request in requests:
            meta = request.meta
            if meta.key.startswith(UNNAMED_PREFIX):
                if meta.process_set_id != GLOBAL_PROCESS_SET_ID:
                    self.to_send.append(request)
                    continue
                self.unnamed_pending += 1
                if (not cached or meta.op not in UNNAMED_CACHEABLE_OPS
                        or self.unnamed_pending > len(self.unnamed_window) + 1):
                    # In full as long as an older one is: rank 0 pairs them by name.
                    self.to_send.append(request)
                else:
                    self.unnamed_window.add(request)
                continue
            if not cached or meta.op not in DATA_OPS:
                self.to_send.append(request)
                continue
            found, slot = lookup(meta.process_set_id, meta.key, meta.signature())
            if found is Lookup.HIT:
                self.waiting_on_cache[slot] = request
                if traced:
                    assert timeline is not None
                    timeline.negotiation_started(meta.name, meta.op)
                continue
            if found is Lookup.STALE:
                self.stale_slots.add(slot)
            self.to_send.append(request)

    def _window_to_full(self) -> None:
        self.to_send.extend(self.unnamed_window.take_all())

    # -- the cycle --------------------------------------------------------------------------

    def announcement(self, notice: Notice | None) -> np.ndarray:
        """This rank's byte vector for the cycle's bitwise AND (see module docstring)."""
        span = self._span
        window = self.unnamed_window
        stale = window.look_up(self.cache)
        if stale is not None:
            self.stale_slots.add(stale)
        if window and not window.slots:
            # Its oldest misses the cache: rank 0 pairs them all, by name.
            self._window_to_full()
        hits = self.cache.not_member | slot_bits(self.waiting_on_cache.keys(), span)
        if window.slots:
            hits |= window.slot_mask(span)
        valid = self._all_valid
        if self.stale_slots:
            invalid = slot_bits(self.stale_slots, span)
            valid = (self._all_slots & ~invalid).to_bytes(span, "little")
            self.stale_slots.clear()
        flags = 0xFF
        self.announced_idle = notice is None and not self.in_flight()
        if self.to_send or notice is not None or self.proposal is not None:
            flags &= ~FLAG_NOTHING_TO_SEND
        if notice is not None:
            flags &= ~FLAG_NO_SHUTDOWN
        if self.unnamed_pending:
            waiting = len(self.unnamed_window)
            if self.unnamed_pending > waiting:
                flags &= ~FLAG_NO_UNNAMED_IN_FULL
            if not waiting:
                flags &= ~FLAG_UNNAMED_WAITS
        else:
            flags &= ~FLAG_UNNAMED_WAITS
        return vector(hits.to_bytes(span, "little") + valid + bytes((flags,)))

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
        self.idle_cycles = self.idle_cycles + 1 if self.announced_idle else 0
        ready = int.from_bytes(words[:span], "little")
        if words[span : 2 * span] != self._all_valid:
            invalid = self._all_slots & ~int.from_bytes(words[span : 2 * span], "little")
            ready &= ~invalid
            for slot in set_bits(invalid, span):
                self.cache.evict(slot)
                stale = self.waiting_on_cache.pop(slot, None)
                if stale is not None:
                    self.to_send.append(stale)
        window: dict[int, Request] = {}
        if self.unnamed_window.slots:
            ready, window = self.unnamed_window.take_run(ready)
        slots = set_bits(ready, span)
        waiting = self.waiting_on_cache.pop
        entries: list[Entry] = [
            (response, waiting(slot, None) or window.get(slot))
            for slot, response in zip(slots, self.cache.take(slots))
        ]
        # Their responses keep the names they were agreed under (see .window).
        self.unnamed_pending -= len(window)
        if self.unnamed_window and (
            not flags & FLAG_NO_UNNAMED_IN_FULL or (not window and flags & FLAG_UNNAMED_WAITS)
        ):
            # Some rank negotiates an unnamed request in full, or every rank's oldest waits
            # on the cache and none ran (their requests differ): rank 0 pairs them by name,
            # or names the mismatch.
            self._window_to_full()
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
            meta = response.meta
            request = sent((meta.process_set_id, meta.key), None)
            if counted(meta.process_set_id, meta.key):
                self.unnamed_window.agreed(meta.key)
                if request is not None:
                    self.unnamed_pending -= 1
            entries.append((response, request))
        return entries

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
            self._window_to_full()
        self.join_mode = join_mode
        return decision

    def exchange(self, report: RankReport) -> Decision:
        """Sends this rank's report to rank 0 and returns rank 0's decision."""
        self.exchanges += 1
        tally = collect(self.control, report)
        decision: Decision | None = None
        if self.coordinator is not None:
            assert tally is not None
            decision = self.coordinator.decide(
                tally, self.process_sets, self.size, time.monotonic()
            )
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
        self.control.bitwise_and(vector(bytes(self._span) + self._all_valid + bytes((flags,))))
        self.exchange(RankReport([], [], notice))

    def file_responses(self, negotiated: list[Entry]) -> dict[int, list[Request]]:
        """Files the cycle's negotiated responses in the cache before they run; every rank
        calls this with the same responses, so the caches stay identical.

        The entries of a set that the cycle removes go first, as its removal will evict
        them, and its responses are not cached. Returns, by removed set, the requests that
        waited on its entries: they can never run.
        """
        orphans = {
            response.meta.payload[0]: self._forget_process_set(response.meta.payload[0])
            for response, _ in negotiated
            if response.meta.op == OpType.REMOVE_PROCESS_SET and response.error is None
        }
        for response, request in negotiated:
            ident = response.meta.process_set_id
            state = self.process_sets.get(ident)
            if state is None or ident in orphans or not response_cacheable(response):
                continue
            signature = None if request is None else request_signature(request.meta)
            key = self.unnamed_window.cache_key(response.meta)
            for slot in self.cache.put(response, signature, state.includes(self.rank), key):
                # A request admitted as a hit on an entry that is now gone (ranks admit
                # requests in different cycles) must be negotiated in full, or it waits on a
                # slot that another name will reuse.
                waiting = self.waiting_on_cache.pop(slot, None)
                if waiting is not None:
                    self.to_send.append(waiting)
        return orphans

    # -- stalls, removed sets, the end ------------------------------------------------------

    def check_stalls(self, now: float) -> Notice | None:
        """Invalidates the cache entries this rank's requests have waited on too long (they
        are then negotiated in full, visible to rank 0); on rank 0, reports stalls and
        returns the notice that ends the job past the stall shutdown time."""
        self.stale_slots.update(self.inspector.stale_cache_waits(self.waiting_on_cache, now))
        window = self.unnamed_window.requests
        if window and now - window[0].submitted > self.inspector.warning_s:
            self._window_to_full()
        if self.coordinator is None:
            return None
        return self.coordinator.check_stalls(self.process_sets, now)

    def _forget_process_set(self, ident: int) -> list[Request]:
        """Evicts a removed set's entries; returns the requests that waited on them."""
        self.cache.evict_process_set(ident)
        orphans = []
        for slot, request in list(self.waiting_on_cache.items()):
            if request.meta.process_set_id == ident:
                del self.waiting_on_cache[slot]
                orphans.append(request)
        return orphans

    def drain(self) -> list[Request]:
        """Takes every request this rank still negotiates (the engine stops)."""
        pending = [
            *self.to_send, *self.sent.values(), *self.waiting_on_cache.values(),
            *self.unnamed_window.take_all(),
        ]
        self.to_send = []
        self.sent.clear()
        self.waiting_on_cache.clear()
        return pending
