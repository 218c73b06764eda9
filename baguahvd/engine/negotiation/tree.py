"""How the cycle's reports reach rank 0: up a binomial tree, merged on the way.

Rank ``r``'s children are ``r + 1``, ``r + 2``, ``r + 4``, ... below the lowest set bit of
``r`` (every power of two for rank 0) and below the job's size; its parent is ``r`` with
that bit cleared. The subtree of ``r`` is the ranks ``r .. r + lowbit(r) - 1``, and its
children's subtrees follow each other in rank order. Each rank turns its report into a
:class:`~baguahvd.engine.negotiation.tally.Tally`, adds its children's tallies in rank order
(each received from the control plane's :meth:`~baguahvd.backends.base.ControlPlane.recv`)
and sends the result to its parent. Rank 0 receives ``ceil(log2(size))`` messages instead
of ``size - 1``, and each holds every distinct request of its subtree once, so the work of
every rank grows with the distinct requests and the depth of the tree, not with
ranks × requests.

Small jobs gather the reports to rank 0 instead (:data:`TREE_FROM_RANKS`), which merges them
itself: one collective and no rank waiting for another's merge, cheaper while the ranks are
few. Either way rank 0 ends with the same tally.
"""

from __future__ import annotations

from baguahvd.backends.base import ControlPlane
from baguahvd.engine.negotiation.tally import Tally
from baguahvd.engine.notices import RankReport

TREE_FROM_RANKS = 16
"""Jobs of this many ranks or more send the reports up the tree; smaller ones gather them.
On a cycle of 64 misses per rank, the chain of work that ends rank 0's was shorter for the
gather up to 8 ranks (1.19 against 1.39 ms) and for the tree from 16 on (1.67 against 2.06
ms; ``benchmarks/results/negotiation_scale/NOTES.md``)."""


def children(rank: int, size: int) -> list[int]:
    """The ranks whose tallies ``rank`` adds to its own, in rank order."""
    found = []
    step = 1
    while not rank & step and rank + step < size:
        found.append(rank + step)
        step <<= 1
    return found


def parent(rank: int) -> int:
    """The rank that ``rank`` (not 0) sends its tally to."""
    return rank & (rank - 1)


def collect(control: ControlPlane, report: RankReport) -> Tally | None:
    """Brings every rank's ``report`` to rank 0 (every rank calls this in the same cycle);
    returns the tally of all of them there, None elsewhere."""
    if control.size < TREE_FROM_RANKS:
        reports = control.gather(report)
        return None if reports is None else Tally.of_reports(reports)
    return up_the_tree(control, report)


def up_the_tree(control: ControlPlane, report: RankReport) -> Tally | None:
    """:func:`collect` up the tree, whatever the job's size."""
    rank, size = control.rank, control.size
    tally = Tally.of_reports((report,))
    for child in children(rank, size):
        tally.add(control.recv(child))
    if rank == 0:
        return tally
    control.send(tally, parent(rank))
    return None
