"""CachedDataset shared by the ranks of one node: what one rank decodes, the others read."""

from __future__ import annotations

import tempfile

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.contrib import CachedDataset

pytest.importorskip("lmdb")


class Decoded(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.decodes = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.decodes += 1
        return torch.full((8,), float(i)), i % 10


def test_ranks_share_one_cache(rank: int, size: int) -> None:
    folder = hvd.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, 0,
                                  name="cache.folder")
    inner = Decoded(n=12 * size)
    cached = CachedDataset(inner, path=folder, dataset_name="shared")
    sampler = torch.utils.data.distributed.DistributedSampler(
        cached, num_replicas=size, rank=rank, shuffle=True, seed=3
    )
    sampler.set_epoch(0)
    first = {i: cached[i] for i in sampler}
    assert inner.decodes == len(first) == 12
    hvd.barrier()
    # The next epoch deals other samples to this rank; other ranks decoded them already.
    sampler.set_epoch(1)
    second = {i: cached[i] for i in sampler}
    assert inner.decodes == 12 and cached.hits == 12
    for i, (values, label) in second.items():
        assert torch.equal(values, torch.full((8,), float(i))) and label == i % 10
    seen = hvd.allgather_object(sorted(first))
    assert sorted(i for part in seen for i in part) == list(range(len(cached)))
