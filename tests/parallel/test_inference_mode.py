"""Collectives on tensors made under ``torch.inference_mode()`` (an evaluation loop's
metrics), called inside or outside it."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd


def _inference(value: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return value.clone()


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "outside"])
def test_every_collective_takes_inference_tensors(rank: int, size: int, inside: bool) -> None:
    mine = _inference(torch.full((size, 2), float(rank + 1)))
    total = float(sum(range(1, size + 1)))
    with torch.inference_mode(inside):
        assert torch.equal(hvd.allreduce(mine, op=hvd.Sum), torch.full((size, 2), total))
        averaged = _inference(mine)
        hvd.allreduce_(averaged, op=hvd.Average)
        assert torch.allclose(averaged, torch.full((size, 2), total / size))
        fused = [hvd.allreduce_async(_inference(mine[0]), name=f"inf.fused.{i}", op=hvd.Sum)
                 for i in range(4)]
        for handle in fused:
            assert torch.equal(hvd.synchronize(handle), torch.full((2,), total))
        gathered = hvd.allgather(mine)
        assert gathered.shape == (size * size, 2)
        assert torch.equal(gathered[::size, 0], torch.arange(1, size + 1, dtype=torch.float32))
        root = _inference(torch.full((3,), float(rank)))
        hvd.broadcast_(root, 0)
        assert torch.equal(root, torch.zeros(3))
        swapped = hvd.alltoall(mine)
        assert torch.equal(swapped[:, 0], torch.arange(1, size + 1, dtype=torch.float32))
        scattered = hvd.reducescatter(mine, op=hvd.Sum)
        assert torch.equal(scattered, torch.full((1, 2), total))
