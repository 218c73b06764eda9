"""Where this process sits: its rank in the job, on its node, and across nodes.

local = ``Split_type(COMM_TYPE_SHARED)``, cross = ``Split(color=local_rank)``;
``is_homogeneous`` says whether every node runs the same number of ranks.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI


class Topology:
    """Ranks of this process in the job, on its node, and across nodes."""

    def __init__(self, comm: Any) -> None:
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        cross = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = cross.Get_rank()
        self.cross_size = cross.Get_size()
        local_sizes = comm.allgather(self.local_size)
        self.is_homogeneous = len(set(local_sizes)) == 1
        self.local_comm = local
        self.cross_comm = cross

    def free(self) -> None:
        self.local_comm.Free()
        self.cross_comm.Free()
