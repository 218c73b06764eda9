"""Library tables the parallel and unit tests parametrize over, in a fixed order.

Tests take their dtypes, ops and modes from the library instead of listing them, so a
table that grows is tested at once. The tables here need more than an import: sets are
sorted by name (the parallel bodies run on every rank of a job, and each rank must collect
the same tests in the same order), private tables are read in this one place. Tables that
are public and ordered (``baguahvd.kernels.DTYPE_SUFFIXES``, ``kernels.cuda.KERNELS``) are
imported from the library directly.
"""

from __future__ import annotations

import torch

from baguahvd.common.ops import ReduceOp
from baguahvd.torch import mpi_ops
from baguahvd.torch.algorithms.decentralized import PEER_SELECTION_MODES

__all__ = ["MOVABLE", "PEER_SELECTION_MODES", "REDUCE_OPS", "REDUCIBLE"]


def _by_name(dtypes: frozenset[torch.dtype]) -> list[torch.dtype]:
    return sorted(dtypes, key=str)


REDUCIBLE: list[torch.dtype] = _by_name(mpi_ops._REDUCIBLE)
"""The dtypes allreduce and reducescatter take."""

MOVABLE: list[torch.dtype] = _by_name(mpi_ops._MOVABLE)
"""The dtypes allgather, broadcast and alltoall take."""

REDUCE_OPS: list[ReduceOp] = [op for op in ReduceOp if op is not ReduceOp.ADASUM]
"""Every elementwise reduction (Adasum, an algorithm rather than an op, has its own tests)."""

