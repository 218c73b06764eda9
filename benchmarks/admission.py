"""What one rank's negotiation costs a recurring burst of cache hits, named and unnamed, in
one process (no peers, no communication).

    python benchmarks/admission.py [--count 300] [--bursts 400]

A :class:`~baguahvd.engine.negotiation.negotiator.Negotiator` with a response cache that
holds the burst (``--count`` float32 allreduces, named ``b.I``, or unnamed and cached at
their positions) takes every burst as the engine thread does: ``admit_all`` on the new
requests, then announcement and ``cached_work`` until every request is handed out (the AND
of one rank is its own announcement). Bursts of the two kinds alternate; the first tenth
of each is left out. Prints the median microseconds per request of each kind.
"""

from __future__ import annotations

import argparse
import statistics
import time

from baguahvd.engine.messages import OpType, RequestMeta, build_response
from baguahvd.engine.negotiation.cache import cache_key, request_signature
from baguahvd.engine.negotiation.negotiator import Negotiator
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.requests import Request


class _Burst:
    """One kind of burst, its negotiator and the number of its next unnamed request."""

    def __init__(self, count: int, unnamed: bool) -> None:
        self.count, self.unnamed = count, unnamed
        self.negotiator = Negotiator(0, 1, None, {}, 1024, StallInspector(60.0, 0.0, False),
                                     None)  # type: ignore[arg-type]
        self.number = 0
        for index in range(count):
            meta = self._meta(index, index)
            key = cache_key(meta, index) if unnamed else None
            self.negotiator.cache.put(build_response([meta], (0,), ()),
                                      request_signature(meta), True, key)

    def _meta(self, index: int, number: int) -> RequestMeta:
        key = f"noname.{number}" if self.unnamed else f"allreduce.b.{index}"
        return RequestMeta(key, key, OpType.ALLREDUCE, 0, 0, "float32", ((1024,),), "CPU")

    def run(self) -> float:
        """One burst; returns its seconds."""
        requests = [Request(self._meta(i, self.number + i), [], None) for i in range(self.count)]
        self.number += self.count
        negotiator = self.negotiator
        start = time.perf_counter()
        negotiator.admit_all(requests)
        taken = 0
        while taken < self.count:
            taken += len(negotiator.cached_work(negotiator.announcement(None)))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--bursts", type=int, default=400)
    args = parser.parse_args()
    bursts = {"named": _Burst(args.count, False), "unnamed": _Burst(args.count, True)}
    samples: dict[str, list[float]] = {kind: [] for kind in bursts}
    for _ in range(args.bursts):
        for kind, burst in bursts.items():
            samples[kind].append(burst.run())
    skip = args.bursts // 10
    for kind, seconds in samples.items():
        per = 1e6 * statistics.median(seconds[skip:]) / args.count
        print(f"{kind:<8} {per:6.2f} us per request (admit, announcement, cached work)")


if __name__ == "__main__":
    main()
