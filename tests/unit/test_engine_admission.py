"""How the negotiator files a cycle's new requests (``Negotiator.admit_all``): a burst of
named cache hits in bulk, anything else one request at a time, with the same outcome."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from baguahvd.engine.messages import OpType, RequestMeta, build_response
from baguahvd.engine.negotiation.cache import request_signature
from baguahvd.engine.negotiation.negotiator import Negotiator
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.requests import Request

CACHED = 6


def _meta(index: int, **fields: object) -> RequestMeta:
    key = fields.pop("key", f"allreduce.g.{index}")
    described: dict[str, object] = {"dtype": "float32", "shapes": ((4,),), **fields}
    return RequestMeta(key=key, name=str(key), op=described.pop("op", OpType.ALLREDUCE),
                       process_set_id=0, rank=0, **described)


def _negotiator(bulk: bool) -> Negotiator:
    """A one-rank negotiator whose cache holds ``allreduce.g.0`` to ``.5`` (slots 0-5);
    without ``bulk``, it files every request one at a time."""
    negotiator = Negotiator(0, 1, None, {}, 16, StallInspector(60.0, 0.0, False),
                            None)  # type: ignore[arg-type]
    for index in range(CACHED):
        meta = _meta(index)
        negotiator.cache.put(build_response([meta], (0,), ()), request_signature(meta), True)
    if not bulk:
        negotiator.cache.hits = lambda requests: None  # type: ignore[method-assign]
        negotiator.unnamed_window.add_all = (  # type: ignore[method-assign]
            lambda requests, pending: False
        )
    return negotiator


def _filed(negotiator: Negotiator) -> tuple[object, ...]:
    return (
        {slot: request.meta for slot, request in negotiator.waiting_on_cache.items()},
        [request.meta for request in negotiator.to_send],
        sorted(negotiator.stale_slots),
        negotiator.unnamed_pending,
        list(zip(negotiator.unnamed_window._numbers, negotiator.unnamed_window._metas)),
        [request.meta for request in negotiator.unnamed_window.take_all()],
    )


def _unnamed(number: int, **fields: object) -> RequestMeta:
    return _meta(0, key=f"noname.{number}", **fields)


BATCHES: dict[str, Callable[[], list[list[RequestMeta]]]] = {
    "every request hits": lambda: [[_meta(i) for i in (3, 0, 5, 1)]],
    "the last one is new": lambda: [[_meta(0), _meta(1), _meta(9)]],
    "the first one is new": lambda: [[_meta(9), _meta(0)]],
    "one is stale": lambda: [[_meta(0), _meta(1, shapes=((5,),)), _meta(2)]],
    "one is a placeholder": lambda: [[_meta(0), _meta(1, failure="ValueError: bad")]],
    "one has another op": lambda: [[_meta(0), _meta(1, op=OpType.BROADCAST, root=0)]],
    "one is unnamed": lambda: [[_meta(0), _unnamed(0)]],
    "unnamed first": lambda: [[_unnamed(0), _meta(0)]],
    "another process set": lambda: [[_meta(0), _meta(1)._replace(process_set_id=1)]],
    "every request unnamed, in two bursts": lambda: [
        [_unnamed(n) for n in range(4)], [_unnamed(n) for n in range(4, 7)],
    ],
    "unnamed, one of another set": lambda: [
        [_unnamed(0), _unnamed(0)._replace(process_set_id=1), _unnamed(1)],
    ],
    "unnamed, one an allgather": lambda: [[_unnamed(0), _unnamed(1, op=OpType.ALLGATHER)]],
    "unnamed after one sent in full": lambda: [
        [_unnamed(0, op=OpType.ALLGATHER)], [_unnamed(1), _unnamed(2)],
    ],
}


@pytest.mark.parametrize("batch", BATCHES)
def test_a_batch_is_filed_as_one_request_at_a_time_would_file_it(batch: str) -> None:
    filed = []
    for bulk in (True, False):
        negotiator = _negotiator(bulk)
        for metas in BATCHES[batch]():
            negotiator.admit_all([Request(meta, [], None) for meta in metas])
        filed.append(_filed(negotiator))
    assert filed[0] == filed[1]


def test_a_burst_of_hits_waits_on_its_slots_and_sends_nothing() -> None:
    negotiator = _negotiator(bulk=True)
    requests = [Request(_meta(i), [], None) for i in (3, 0, 5)]
    negotiator.admit_all(requests)
    assert negotiator.waiting_on_cache == {3: requests[0], 0: requests[1], 5: requests[2]}
    assert negotiator.to_send == [] and not negotiator.stale_slots
    entries = negotiator.cached_work(negotiator.announcement(None))
    assert [(response.meta.key, own) for response, own in entries] == [
        ("allreduce.g.0", requests[1]), ("allreduce.g.3", requests[0]),
        ("allreduce.g.5", requests[2]),
    ]


def test_a_burst_that_misses_on_its_last_request_is_filed_one_at_a_time() -> None:
    negotiator = _negotiator(bulk=True)
    taken: list[list[Request]] = []
    bulk = negotiator.cache.hits

    def hits(requests: list[Request]) -> list[int] | None:
        taken.append(requests)
        return bulk(requests)

    negotiator.cache.hits = hits  # type: ignore[method-assign]
    requests = [Request(_meta(0), [], None), Request(_meta(1, shapes=((2, 2),)), [], None)]
    negotiator.admit_all(requests)
    assert taken == [requests]  # tried in bulk first ...
    # ... and filed one at a time: the stale entry is invalidated, its request sent in full.
    assert negotiator.waiting_on_cache == {0: requests[0]}
    assert negotiator.to_send == [requests[1]] and negotiator.stale_slots == {1}
