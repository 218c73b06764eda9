"""Hierarchical communication: inside each node first, then among one leader per node.

Ranks are grouped by host name. A hierarchical collective averages over the node's ranks,
runs the algorithm's body among the node leaders (the lowest rank of each node), then
broadcasts the leader's result inside the node. The mean of node means equals the global
mean only when every node runs the same number of ranks (as in Bagua).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch

from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.functions import allgather_object
from baguahvd.torch.mpi_ops import Average, allreduce_, broadcast_


class Hierarchy:
    """The node-local process set of this rank and the set of node leaders."""

    def __init__(self, process_set: ProcessSet) -> None:
        if process_set is not global_process_set:
            raise ValueError(
                "hierarchical communication needs the global process set; pass "
                "hierarchical=False to use another process set."
            )
        hosts = allgather_object(socket.gethostname(), name="bagua.hierarchy.hosts")
        nodes: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            nodes.setdefault(host, []).append(rank)
        ordered = sorted(nodes.values(), key=min)
        me = runtime.rank()
        self.node_sets = [runtime.internal_process_set(ranks) for ranks in ordered]
        self.leaders = [min(ranks) for ranks in ordered]
        self.leader_set = runtime.internal_process_set(self.leaders)
        index = next(i for i, ranks in enumerate(ordered) if me in ranks)
        self.node_set = self.node_sets[index]
        self.leader = self.leaders[index]
        self.is_leader = me == self.leader
        self.node_count = len(ordered)

    def run(
        self, flat: torch.Tensor, name: str, body: Callable[[torch.Tensor, ProcessSet], None]
    ) -> None:
        """Node average, ``body`` on the leaders, node broadcast."""
        allreduce_(flat, name=f"{name}.node_reduce", op=Average, process_set=self.node_set)
        if self.is_leader:
            body(flat, self.leader_set)
        broadcast_(flat, self.leader, name=f"{name}.node_bcast", process_set=self.node_set)


def optional_hierarchy(process_set: ProcessSet, hierarchical: bool) -> Hierarchy | None:
    """The hierarchy of ``process_set`` when ``hierarchical`` (collective), else None."""
    return Hierarchy(process_set) if hierarchical else None
