"""The response cache (``baguahvd.engine.negotiation.cache``): its slots, its order of
eviction, and the one rule for what may be cached."""

from __future__ import annotations

import random

import pytest

from baguahvd.engine.messages import OpType, RequestMeta, Response
from baguahvd.engine.negotiation.cache import (
    Lookup,
    ResponseCache,
    cache_key,
    may_cache,
    request_signature,
    response_cacheable,
)
from baguahvd.engine.negotiation.window import LOOKUPS_MIN, UnnamedWindow
from baguahvd.engine.requests import Request
from tests.fakes.responses import agreed


def _meta(rank: int, op: OpType = OpType.ALLREDUCE, name: str = "allreduce.w", **fields):
    fields.setdefault("dtype", "float32")
    fields.setdefault("shapes", ((4, 2),))
    return RequestMeta(key=name, name=name, op=op, process_set_id=0, rank=rank, **fields)


def _response(key: str, process_set_id: int = 0) -> Response:
    return agreed(key=key, name=key, op=OpType.ALLREDUCE, process_set_id=process_set_id,
                    dtype="float32", shapes=((4,),))


def test_cache_hit_stale_miss() -> None:
    cache = ResponseCache(4)
    signature = _meta(0).signature()
    cache.put(_response("a"), signature, member=True)
    found, slot = cache.lookup(0, "a", signature)
    assert found is Lookup.HIT and slot == 0
    assert cache.response(slot).meta.key == "a"
    other = _meta(0, shapes=((5,),)).signature()
    assert cache.lookup(0, "a", other) == (Lookup.STALE, 0)
    assert cache.lookup(0, "b", signature) == (Lookup.MISS, -1)
    # Keys are per process set.
    assert cache.lookup(1, "a", signature) == (Lookup.MISS, -1)
    assert len(cache) == 1


def test_cache_lru_eviction_is_deterministic() -> None:
    def run() -> list[tuple[str, int]]:
        cache = ResponseCache(3)
        for key in "abc":
            cache.put(_response(key), None, member=True)
        cache.touch(cache.lookup(0, "a", None)[1])
        cache.put(_response("d"), None, member=True)  # evicts b, the least recently used
        cache.touch(cache.lookup(0, "c", None)[1])
        cache.put(_response("e"), None, member=True)  # evicts a
        return sorted(
            (key, cache.lookup(0, key, None)[1]) for key in "abcde"
            if cache.lookup(0, key, None)[0] is Lookup.HIT
        )

    first = run()
    assert [key for key, _ in first] == ["c", "d", "e"]
    # The freed slots are reused lowest first, so every rank ends with the same layout.
    assert dict(first) == {"c": 2, "d": 1, "e": 0}
    assert run() == first


def test_cache_put_same_key_replaces() -> None:
    cache = ResponseCache(2)
    cache.put(_response("a"), ("old",), member=True)
    cache.put(_response("a"), ("new",), member=True)
    assert len(cache) == 1
    assert cache.lookup(0, "a", ("new",))[0] is Lookup.HIT


def test_cache_evict_and_not_member_bits() -> None:
    cache = ResponseCache(4)
    cache.put(_response("a", process_set_id=0), None, member=True)
    cache.put(_response("b", process_set_id=7), None, member=False)
    cache.put(_response("c", process_set_id=7), None, member=False)
    assert cache.not_member == 0b0110
    cache.evict_process_set(7)
    assert len(cache) == 1
    assert cache.not_member == 0
    assert cache.lookup(7, "b", None)[0] is Lookup.MISS
    assert cache.lookup(0, "a", None)[0] is Lookup.HIT
    cache.evict(0)
    cache.evict(0)  # evicting an empty slot is harmless
    assert len(cache) == 0


def test_cache_of_capacity_zero_stores_nothing() -> None:
    cache = ResponseCache(0)
    cache.put(_response("a"), None, member=True)
    assert len(cache) == 0
    assert cache.lookup(0, "a", None)[0] is Lookup.MISS


def test_cache_clear() -> None:
    cache = ResponseCache(3)
    for key in "abc":
        cache.put(_response(key), None, member=True)
    cache.clear()
    assert len(cache) == 0
    cache.put(_response("z"), None, member=True)
    assert cache.lookup(0, "z", None) == (Lookup.HIT, 0)


def _allreduce(name: str, count: int, **fields: object) -> tuple[Response, str]:
    settings: dict[str, object] = {"dtype": "float32", "shapes": ((count,),), **fields}
    response = agreed(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0,
                        **settings)  # type: ignore[arg-type]
    return response, name


@pytest.mark.parametrize(
    ("op", "key", "expected"),
    [
        (OpType.ALLREDUCE, "allreduce.w", True),
        (OpType.ALLGATHER, "allgather.w", True),
        (OpType.BROADCAST, "broadcast.w", True),
        (OpType.ALLTOALL, "alltoall.w", True),
        (OpType.REDUCESCATTER, "reducescatter.w", True),
        (OpType.ALLREDUCE, "noname.3", False),
        (OpType.BARRIER, "barrier", False),
        (OpType.JOIN, "join", False),
        (OpType.ADD_PROCESS_SET, "add_process_set.x", False),
        (OpType.REMOVE_PROCESS_SET, "remove_process_set.x", False),
    ],
)
def test_may_cache(op: OpType, key: str, expected: bool) -> None:
    assert may_cache(op, key) is expected


def test_only_responses_that_ran_with_every_member_are_cached() -> None:
    response, _ = _allreduce("allreduce.w", 1)
    assert response_cacheable(response)
    assert not response_cacheable(response._replace(error="mismatch"))
    assert not response_cacheable(response._replace(joined=(2,)))


def test_unnamed_allreduces_and_broadcasts_of_the_global_set_are_cached_under_what_they_move(
) -> None:
    response, _ = _allreduce("allreduce.w", 1)
    meta = response.meta
    first = meta._replace(key="noname.0", name="allreduce.noname.0")
    later = meta._replace(key="noname.7", name="allreduce.noname.7")
    assert response_cacheable(response._replace(meta=first))
    assert cache_key(first) == cache_key(later) != cache_key(meta)
    # Under its position among the unnamed collectives not yet agreed.
    assert cache_key(first, 3) == cache_key(later, 3) != cache_key(first)
    assert cache_key(first) != cache_key(first._replace(shapes=((2,),)))
    assert cache_key(first) != cache_key(first._replace(postscale=0.5))
    assert cache_key(first) != cache_key(first._replace(fuse=False))
    assert cache_key(first._replace(process_set_id=1)) is None
    assert cache_key(first._replace(op=OpType.ALLGATHER)) is None
    broadcast = first._replace(op=OpType.BROADCAST, root=0)
    assert cache_key(broadcast) not in (None, cache_key(first))
    assert cache_key(broadcast) != cache_key(broadcast._replace(root=1))
    assert cache_key(meta._replace(op=OpType.BARRIER)) is None


_UNNAMED = _meta(0, name="noname.0")


def _unnamed_cache(positions: int) -> ResponseCache:
    """A cache of 1,024 slots with an unnamed allreduce of one shape at each of the first
    ``positions`` positions."""
    cache = ResponseCache(1024)
    signature = request_signature(_UNNAMED)
    for position in range(positions):
        cache.put(_response(f"noname.{position}"), signature, member=True,
                  key=cache_key(_UNNAMED, position))
    return cache


def _wait_unnamed(window: UnnamedWindow, first: int, count: int) -> None:
    """Queues the unnamed requests ``noname.first`` and the ``count - 1`` after it."""
    for number in range(first, first + count):
        key = f"noname.{number}"
        window.add(Request(_UNNAMED._replace(key=key, name=f"allreduce.{key}"), [], None))


def test_a_recurring_unnamed_burst_longer_than_the_lookup_bound_soon_runs_in_one_cycle(
) -> None:
    # 600 unnamed allreduces of one shape, cached at positions 0..599: the first cycle looks
    # up the first 256 only; each run that takes all it looked up doubles the bound (up to
    # the cache's capacity), so a burst that recurs runs in one cycle from its third time.
    cache = _unnamed_cache(600)
    window = UnnamedWindow(1024)

    def burst(first: int) -> list[int]:
        _wait_unnamed(window, first, 600)
        runs = []
        while window.requests:
            assert window.look_up(cache) is None
            everyone = (1 << 1024) - 1
            _, run = window.take_run(everyone)
            runs.append(len(run))
        return runs

    assert burst(0) == [256, 344]
    assert window.lookups_max == 512
    assert burst(600) == [512, 88]
    assert window.lookups_max == 1024
    assert burst(1200) == [600]
    assert burst(1800) == [600]
    assert window.lookups_max == 1024  # never past the cache's capacity


def test_a_rank_far_ahead_looks_up_no_more_than_its_runs_need() -> None:
    # Runs of 100 never reach the bound: it stays at its minimum however many wait.
    cache = _unnamed_cache(1000)
    window = UnnamedWindow(1024)
    _wait_unnamed(window, 0, 1000)
    for _ in range(5):
        window.look_up(cache)
        assert len(window.slots) == LOOKUPS_MIN
        first_hundred = sum(1 << slot for slot in window.slots[:100])
        window.take_run(first_hundred)
    assert window.lookups_max == LOOKUPS_MIN


def _looked_up(window: UnnamedWindow, cache: ResponseCache) -> tuple[int | None, list[int]]:
    stale = window.look_up(cache)
    return stale, list(window.slots)


def test_a_position_that_hit_before_hits_the_same_slot_as_a_full_lookup() -> None:
    cache = _unnamed_cache(8)
    window = UnnamedWindow(1024)
    slots = []
    for first in (0, 8, 16):  # the same burst three times: full lookups, then remembered
        _wait_unnamed(window, first, 8)
        stale, found = _looked_up(window, cache)
        assert stale is None
        slots.append(found)
        window.take_run((1 << 1024) - 1)
    fresh = UnnamedWindow(1024)  # nothing remembered: every position looked up by its key
    _wait_unnamed(fresh, 0, 8)
    assert _looked_up(fresh, cache) == (None, slots[0])
    assert slots[1] == slots[2] == slots[0]


def test_a_remembered_slot_is_not_trusted_once_another_entry_holds_it() -> None:
    cache = _unnamed_cache(2)
    window = UnnamedWindow(1024)
    _wait_unnamed(window, 0, 2)
    assert _looked_up(window, cache) == (None, [0, 1])
    window.take_run((1 << 1024) - 1)
    # Position 1's entry goes, and a named response takes its slot: the next request at
    # position 1 misses, as a full lookup of its key would.
    cache.evict(1)
    cache.put(_response("allreduce.named"), request_signature(_UNNAMED), member=True)
    assert cache.lookup(0, "allreduce.named", request_signature(_UNNAMED))[1] == 1
    _wait_unnamed(window, 2, 2)
    assert _looked_up(window, cache) == (None, [0])


def test_a_remembered_position_with_another_signature_is_looked_up_by_its_key() -> None:
    cache = _unnamed_cache(1)
    window = UnnamedWindow(1024)
    _wait_unnamed(window, 0, 1)
    assert _looked_up(window, cache) == (None, [0])
    window.take_run((1 << 1024) - 1)
    # Same position, another scale: not the remembered entry's signature. Its key differs
    # too, so it misses (a different field of the signature, the call site, would find the
    # entry stale instead).
    scaled = _UNNAMED._replace(key="noname.1", name="allreduce.noname.1", prescale=0.5)
    window.add(Request(scaled, [], None))
    assert _looked_up(window, cache) == (None, [])
    window.take_all()
    sited = _UNNAMED._replace(key="noname.1", name="allreduce.noname.1", site="train.py:7")
    window.add(Request(sited, [], None))
    assert _looked_up(window, cache) == (0, [])


def test_taking_the_same_slots_again_keeps_the_order_every_other_operation_sees() -> None:
    """take() skips the marking of slots taken again in the last call's order with nothing
    changed since; a cache that always marks them evicts the same entries, whatever the
    puts, touches, takes and evictions in between."""
    rng = random.Random(7)

    def run(skips: bool) -> list[object]:
        cache = ResponseCache(6)
        seen: list[object] = []
        for key in "abcdef":
            cache.put(_response(key), None, member=True)
        names = iter(f"k{index}" for index in range(10_000))
        last: list[int] = []
        for _ in range(3_000):
            if not skips:
                cache._taken = None
            held = sorted(cache._entries)
            if last and set(last) <= set(held) and rng.random() < 0.6:
                slots = last  # the same slots again, as a training loop's cycles take them
            else:
                slots = sorted(rng.sample(held, rng.randint(1, min(3, len(held)))))
            choice = rng.random()
            if choice < 0.5:
                seen.append([r.meta.key for r in cache.take(slots)])
                last = slots
            elif choice < 0.7:
                cache.touch(rng.choice(held))
            elif choice < 0.95:
                seen.append(("evicted", cache.put(_response(next(names)), None, member=True)))
            elif len(held) > 1:
                cache.evict(rng.choice(held))
        return seen

    state = rng.getstate()
    skipping = run(skips=True)
    rng.setstate(state)
    assert run(skips=False) == skipping
    assert any(item[0] == "evicted" and item[1] for item in skipping if isinstance(item, tuple))


def test_a_slot_evicted_since_the_last_take_is_not_taken_again() -> None:
    cache = ResponseCache(3)
    for key in "abc":
        cache.put(_response(key), None, member=True)
    assert [r.meta.key for r in cache.take([0, 1])] == ["a", "b"]
    cache.evict(0)
    with pytest.raises(KeyError):
        cache.take([0, 1])


class _LookedUpEach(UnnamedWindow):
    """A window that looks every request up in turn, never from what it found last, and
    takes its runs one slot at a time."""

    def look_up(self, cache: ResponseCache) -> int | None:
        self._found = self._found._replace(slots=[])
        return super().look_up(cache)


@pytest.mark.parametrize("seed", range(4))
def test_a_window_finds_and_runs_what_looking_each_request_up_would(seed: int) -> None:
    # Bursts of unnamed requests, two shapes, while entries come and go and some ranks
    # lag: the window that checks a whole recurring burst at once must find the same slots,
    # report the same stale slot and run the same requests as one that checks each.
    rng = random.Random(seed)
    cache = ResponseCache(48)
    fast, each = UnnamedWindow(48), _LookedUpEach(48)
    number = 0
    signatures = {shape: request_signature(_UNNAMED._replace(shapes=(shape,)))
                  for shape in ((4,), (8,))}
    burst = [(4,)] * 6 + [(8,)] * 3
    quick = 0
    for _ in range(3000):
        choice = rng.random()
        if choice < 0.3:
            if rng.random() < 0.1:  # an unnamed request of another kind, sent in full
                number += 1
            if rng.random() < 0.2:
                burst = [rng.choice([(4,), (8,)]) for _ in range(rng.randint(1, 12))]
            for shape in burst:
                key = f"noname.{number}"
                request = Request(_UNNAMED._replace(key=key, name=f"allreduce.{key}",
                                                    shapes=(shape,)), [], None)
                fast.add(request)
                each.add(request)
                number += 1
        elif choice < 0.4:
            shape = rng.choice([(4,), (8,)])
            meta = _UNNAMED._replace(shapes=(shape,))
            key = cache_key(meta, rng.randrange(16))
            cache.put(_response(f"noname.{rng.randrange(99)}"), signatures[shape],
                      member=True, key=key)
        elif choice < 0.45 and len(cache):
            cache.evict(rng.choice(sorted(cache._entries)))
        elif choice < 0.47:
            assert fast.take_all() == each.take_all()
        else:
            first = int(fast.requests[0].meta.key.split(".")[1]) if fast.requests else 0
            if first > fast.base and rng.random() < 0.5:  # those sent in full before it agreed
                fast.agreed(f"noname.{first - 1}")
                each.agreed(f"noname.{first - 1}")
            if rng.random() < 0.3:  # the waiting requests' responses were cached meanwhile
                for request in fast.requests:
                    position = int(request.meta.key.split(".")[1]) - fast.base
                    if 0 <= position < 16:
                        cache.put(_response(request.meta.key), request_signature(request.meta),
                                  member=True, key=cache_key(request.meta, position))
            found = fast._found
            stale = fast.look_up(cache)
            quick += fast._found is found and bool(fast.slots)  # not looked up again
            assert (stale, fast.slots) == (each.look_up(cache), each.slots)
            span = 48
            fast.slot_mask(span)
            if rng.random() < 0.7:
                ready = (1 << span) - 1
            else:
                ready = sum(1 << slot for slot in fast.slots[: rng.randint(0, len(fast.slots))])
                ready |= rng.getrandbits(span)
            assert fast.take_run(ready) == each.take_run(ready)
            assert (fast.base, fast.lookups_max) == (each.base, each.lookups_max)
    assert quick > 30  # the recurring bursts did take the shortcut


def test_a_recurring_burst_is_found_again_across_empty_cycles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A training loop's cycles alternate between its burst and cycles with nothing
    # unnamed waiting (a named request, an idle tick): the burst is still found from what
    # the last lookup of it found, without looking its requests up one by one.
    cache = _unnamed_cache(8)
    window = UnnamedWindow(1024)
    _wait_unnamed(window, 0, 8)
    assert _looked_up(window, cache) == (None, list(range(8)))
    window.take_run((1 << 1024) - 1)

    def each(*args: object) -> None:
        raise AssertionError("looked up one request at a time")

    monkeypatch.setattr(window, "_look_up_each", each)
    for first in (8, 16):
        assert _looked_up(window, cache) == (None, [])
        _wait_unnamed(window, first, 8)
        assert _looked_up(window, cache) == (None, list(range(8)))
        window.take_run((1 << 1024) - 1)


def test_a_recurring_burst_runs_only_the_slots_every_rank_announced() -> None:
    # The bits of a burst's slots are kept with what its lookup found, for the next burst
    # like it: never the bits of another lookup's slots (here one that found positions 1-4,
    # after an unnamed request sent in full took position 0).
    cache = _unnamed_cache(8)
    window = UnnamedWindow(1024)
    span = 128
    _wait_unnamed(window, 0, 4)
    assert _looked_up(window, cache) == (None, [0, 1, 2, 3])
    window.take_run((1 << 1024) - 1)  # (no bits made for it yet)
    _wait_unnamed(window, 5, 4)  # noname.4 went in full: positions 1 to 4
    assert _looked_up(window, cache) == (None, [1, 2, 3, 4])
    window.slot_mask(span)
    assert window.take_run(0) == (0, {})
    window.take_all()
    window.agreed("noname.8")
    _wait_unnamed(window, 9, 4)  # the first burst again, at positions 0 to 3
    assert _looked_up(window, cache) == (None, [0, 1, 2, 3])
    window.slot_mask(span)
    ready = sum(1 << slot for slot in (1, 2, 3, 4))  # slot 0 not announced by every rank
    assert window.take_run(ready) == (1 << 4, {})  # the later slots wait; 4 is not ours
