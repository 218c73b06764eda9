"""BAGUAHVD_CHECK_CALL_SITES: unnamed collectives paired from different lines fail.

Needs the variable at ``init()``: ``tests/e2e/test_parallel.py`` runs this module with it
set; without it the module is skipped.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import baguahvd.torch as hvd

pytestmark = pytest.mark.skipif(
    os.environ.get("BAGUAHVD_CHECK_CALL_SITES") != "1",
    reason="runs with BAGUAHVD_CHECK_CALL_SITES=1",
)


def _next_line() -> int:
    """The line after the caller's."""
    return sys._getframe(1).f_lineno + 1


def test_the_same_line_on_every_rank_is_no_mismatch(rank: int, size: int) -> None:
    for step in range(3):
        result = hvd.allreduce(torch.tensor([float(rank + step)]), op=hvd.Sum)
        assert result.item() == sum(range(size)) + size * step


def test_unnamed_collectives_from_different_lines_fail_on_every_rank(
    rank: int, size: int
) -> None:
    tensor = torch.ones(2)
    lines = {}
    with pytest.raises(hvd.HorovodInternalError) as info:
        if rank == 1:
            lines[1] = _next_line()
            hvd.allreduce(tensor, op=hvd.Sum)
        else:
            lines[0] = _next_line()
            hvd.allreduce(tensor, op=hvd.Sum)
    message = str(info.value)
    assert "different call sites" in message
    # Every rank raises the same error, naming the two lines (this rank knows one of them).
    site = f"{__file__}:{lines[1 if rank == 1 else 0]}"
    assert f"rank {rank} called allreduce.noname." in message or rank > 1
    assert site in message
    assert "rank 0 called allreduce.noname." in message
    assert "but rank 1 called allreduce.noname." in message
    # The failed pair is behind every rank: the next unnamed collectives pair again.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size


def test_named_collectives_are_not_checked(rank: int, size: int) -> None:
    if rank == 0:
        result = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="sites.named")
    else:
        result = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="sites.named")
    assert result.item() == size
