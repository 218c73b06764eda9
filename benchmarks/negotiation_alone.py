"""Each rank's work on one cycle of misses, without the threads: the runs of
``negotiation_scale.py --alone`` (see its docstring), which also run at 1,024 and 4,096
ranks, as no other thread competes.

Every rank reports ``requests`` allreduces of one float. With the gather, rank 0 unpickles
the other ranks' reports, merges all of them, matches and pickles the decision. Up the tree
(:mod:`baguahvd.engine.negotiation.tree`), each rank builds its own table, adds each child's
(unpickled) and pickles the sum, or on rank 0 matches and pickles the decision; every
message is the one the tree would carry. Times are median thread CPU seconds.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from baguahvd.engine.messages import OpType, RequestMeta  # noqa: E402
from baguahvd.engine.negotiation import tree  # noqa: E402
from baguahvd.engine.negotiation.coordinator import Coordinator  # noqa: E402
from baguahvd.engine.negotiation.stall import StallInspector  # noqa: E402
from baguahvd.engine.negotiation.tally import Tally  # noqa: E402
from baguahvd.engine.notices import RankReport  # noqa: E402
from baguahvd.engine.process_sets import ProcessSetState  # noqa: E402


def _reports(size: int, requests: int) -> list[RankReport]:
    """Every rank's report on a cycle of misses: ``requests`` allreduces of one float."""
    return [
        RankReport(
            [RequestMeta(key=f"allreduce.grad.{i}", name=f"allreduce.grad.{i}",
                         op=OpType.ALLREDUCE, process_set_id=0, rank=rank, dtype="float32",
                         shapes=((1,),)) for i in range(requests)],
            [0.0] * requests,
        )
        for rank in range(size)
    ]


def _cpu(work: Callable[[], Any]) -> float:
    start = time.thread_time()
    work()
    return time.thread_time() - start


def _decide(size: int, tally: Tally) -> bytes:
    """Rank 0's matching of a cycle's tally and its pickled decision."""
    sets = {0: ProcessSetState(0, tuple(range(size)), comm=None)}
    coordinator = Coordinator(StallInspector(60.0, 0.0, False), None)
    return pickle.dumps(coordinator.decide(tally, sets, size, time.monotonic()))


def gather_alone(size: int, requests: int, repeats: int = 5) -> float:
    """Rank 0's work on a cycle of misses when the reports are gathered, without the
    threads: unpickling the other ranks' reports, merging all of them, matching and
    pickling the decision (median thread CPU seconds)."""
    reports = _reports(size, requests)
    pickled = [pickle.dumps(r, pickle.HIGHEST_PROTOCOL) for r in reports[1:]]

    def root() -> None:
        _decide(size, Tally.of_reports([reports[0], *(pickle.loads(m) for m in pickled)]))

    return statistics.median(_cpu(root) for _ in range(repeats))


def tree_alone(size: int, requests: int, repeats: int = 3) -> dict[str, float]:
    """The same cycle up the tree, each rank's work without the threads (median thread CPU
    seconds): rank 0's (its own tally, each child's unpickled and added, matching,
    pickling the decision), the busiest other rank's (its tally, its children's, pickling
    the sum), a leaf's (its tally, pickled), and the chain that ends rank 0's work: each
    rank builds its own tally at once, adds each child's once that child is done, then
    pickles (no time on the wire)."""
    reports = _reports(size, requests)
    messages: dict[int, bytes] = {}
    parts: list[list[list[float]]] = [[] for _ in range(size)]
    """Per rank, per repeat: its own tally, each child's merge, the pickling or matching."""
    for _ in range(repeats):
        for rank in reversed(range(size)):
            tally = Tally()

            def build(rank: int = rank) -> None:
                nonlocal tally
                tally = Tally.of_reports([reports[rank]])

            times = [_cpu(build)]
            for child in tree.children(rank, size):
                times.append(_cpu(lambda child=child: tally.add(pickle.loads(messages[child]))))
            if rank:
                times.append(_cpu(lambda rank=rank: messages.__setitem__(
                    rank, pickle.dumps(tally, pickle.HIGHEST_PROTOCOL))))
            else:
                times.append(_cpu(lambda: _decide(size, tally)))
            parts[rank].append(times)
    work = [[statistics.median(t) for t in zip(*runs)] for runs in parts]
    done = [0.0] * size
    for rank in reversed(range(size)):
        clock = work[rank][0]
        for child, merge in zip(tree.children(rank, size), work[rank][1:-1]):
            clock = max(clock, done[child]) + merge
        done[rank] = clock + work[rank][-1]
    totals = [sum(w) for w in work]
    leaves = [totals[r] for r in range(1, size) if not tree.children(r, size)]
    return {
        "root_s": totals[0],
        "interior_s": max(totals[1:], default=0.0),
        "leaf_s": statistics.median(leaves) if leaves else 0.0,
        "path_s": done[0],
        "message_bytes": max((len(m) for m in messages.values()), default=0),
    }


def gather_pickling_s(size: int, requests: int, repeats: int = 5) -> float:
    """A rank's work on a cycle of misses when the reports are gathered: pickling its
    report."""
    report = _reports(size, requests)[-1]
    return statistics.median(
        _cpu(lambda: pickle.dumps(report, pickle.HIGHEST_PROTOCOL)) for _ in range(repeats))
