"""LoadBalancingDistributedSampler on every rank: one plan, the whole epoch, elastic state."""

from __future__ import annotations

import torch

import baguahvd.torch as hvd
from baguahvd.contrib import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)
from baguahvd.torch.elastic.state import SamplerStateHandler

N = 301


def lengths() -> list[int]:
    g = torch.Generator().manual_seed(3)
    return (torch.exp(torch.randn(N, generator=g) + 3).long() + 1).tolist()


def test_every_rank_computes_the_same_plan(rank: int, size: int) -> None:
    costs = lengths()
    sampler = LoadBalancingDistributedSampler(range(N), None, complexities=costs)
    assert (sampler.num_replicas, sampler.rank) == (size, rank)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        mine = torch.tensor(list(sampler))
        gathered = hvd.allgather(mine.unsqueeze(0))
        for r in range(size):
            assert gathered[r].tolist() == sampler.rank_indices(r)
        assert set(gathered.reshape(-1).tolist()) == set(range(N))
        assert gathered.numel() == sampler.total_size


def test_batch_sampler_same_number_of_batches(rank: int, size: int) -> None:
    costs = lengths()
    sampler = LoadBalancingDistributedSampler(range(N), None, complexities=costs, seed=4)

    def batch_fn(indices: list[int]) -> list[list[int]]:
        return [indices[i : i + 1 + i % 3] for i in range(0, len(indices), 3)]

    batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn)
    count = hvd.allgather(torch.tensor([len(list(batches))]))
    assert len(set(count.tolist())) == 1


def test_torch_state_saves_and_restores_progress(rank: int, size: int) -> None:
    sampler = LoadBalancingDistributedSampler(range(N), None, complexities=lengths())
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    assert isinstance(state._handlers["sampler"], SamplerStateHandler)
    sampler.record_batch(0, 4)
    state.commit()
    sampler.record_batch(1, 4)
    state.restore()
    assert sampler.processed_num == 4 * size
    state.sync()
    rest = hvd.allgather(torch.tensor(list(sampler)).unsqueeze(0)).reshape(-1).tolist()
    assert len(set(rest)) == N - 4 * size
