"""LoadBalancingDistributedSampler and its batch sampler, every rank simulated in-process."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler

from baguahvd.contrib import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)


class Lengths(torch.utils.data.Dataset[list[int]]):
    """Sequences whose cost is their length: a heavy-tailed (log-normal) distribution."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.exp(torch.randn(n, generator=g) * 1.0 + 3.0).long() + 1
        self.lengths = lengths.tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> list[int]:
        return [0] * self.lengths[i]


def samplers(
    dataset: Lengths, replicas: int, **kwargs: object
) -> list[LoadBalancingDistributedSampler]:
    return [
        LoadBalancingDistributedSampler(
            dataset, None, num_replicas=replicas, rank=r,
            complexities=dataset.lengths, **kwargs,  # type: ignore[arg-type]
        )
        for r in range(replicas)
    ]


def step_ratios(lists: list[list[int]], cost: list[int], batch: int) -> list[float]:
    """max/min over ranks of each step's total cost."""
    steps = len(lists[0]) // batch
    ratios = []
    for s in range(steps):
        totals = [sum(cost[i] for i in rank[s * batch : (s + 1) * batch]) for rank in lists]
        ratios.append(max(totals) / min(totals))
    return ratios


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_steps_are_balanced_far_better_than_distributed_sampler(replicas: int) -> None:
    dataset = Lengths(1200)
    balanced = [list(s) for s in samplers(dataset, replicas)]
    plain = [
        list(DistributedSampler(dataset, num_replicas=replicas, rank=r, seed=0))
        for r in range(replicas)
    ]
    ours = step_ratios(balanced, dataset.lengths, 8)
    torchs = step_ratios(plain, dataset.lengths, 8)
    assert sum(ours) / len(ours) < 1.1
    # The heavy tail makes neighbours in the sorted order far apart in a few chunks.
    assert sorted(ours)[int(0.9 * len(ours))] < 1.2
    assert max(ours) < max(torchs)
    assert sum(torchs) / len(torchs) > 1.5


@pytest.mark.parametrize("n, replicas", [(100, 4), (101, 4), (7, 3), (2, 3)])
def test_every_sample_once_per_epoch_padding_aside(n: int, replicas: int) -> None:
    dataset = Lengths(n)
    for epoch in range(3):
        ranks = samplers(dataset, replicas)
        for s in ranks:
            s.set_epoch(epoch)
        lists = [list(s) for s in ranks]
        assert len({len(x) for x in lists}) == 1 and len(lists[0]) == len(ranks[0])
        seen = Counter(i for x in lists for i in x)
        assert set(seen) == set(range(n))
        assert sum(seen.values()) == ranks[0].total_size
        assert sum(seen.values()) - n < replicas * max(1, -(-replicas // n))


def test_drop_last_drops_different_samples_each_epoch() -> None:
    dataset = Lengths(103)
    dropped = []
    for epoch in range(4):
        ranks = samplers(dataset, 4, drop_last=True)
        for s in ranks:
            s.set_epoch(epoch)
        seen = Counter(i for s in ranks for i in s)
        assert len(ranks[0]) == 25 and sum(seen.values()) == 100 and max(seen.values()) == 1
        dropped.append(frozenset(set(range(103)) - set(seen)))
    assert len(set(dropped)) > 1


def test_deterministic_per_seed_and_epoch() -> None:
    dataset = Lengths(300)
    a, b = samplers(dataset, 3)[1], samplers(dataset, 3)[1]
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    a.set_epoch(1)
    assert list(a) == list(b)
    c = samplers(dataset, 3, seed=5)[1]
    c.set_epoch(1)
    assert list(c) != list(a)
    unshuffled = samplers(dataset, 3, shuffle=False)
    assert list(unshuffled[0]) == list(samplers(dataset, 3, shuffle=False)[0])


def test_complexity_fn_and_precomputed_agree() -> None:
    dataset = Lengths(50)
    by_fn = LoadBalancingDistributedSampler(dataset, len, num_replicas=2, rank=1)
    assert list(by_fn) == list(samplers(dataset, 2)[1])


def test_rotation_removes_the_per_rank_skew() -> None:
    # Without rotation (Bagua's), rank r takes the r-th cheapest member of every chunk, so
    # over an epoch rank 0 always gets the least work and rank R-1 the most.
    dataset = Lengths(4000)
    g = torch.Generator().manual_seed(0)
    dataset.lengths = torch.randint(1, 1000, (4000,), generator=g).tolist()
    ordered = sorted(dataset.lengths)
    bagua = [sum(ordered[r::4]) for r in range(4)]
    assert bagua == sorted(bagua)
    ours = [sum(dataset.lengths[i] for i in s) for s in samplers(dataset, 4)]
    assert max(ours) - min(ours) < (max(bagua) - min(bagua)) / 3


def test_random_level() -> None:
    dataset = Lengths(300)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"random_level must be in \[0, 1\]"):
            LoadBalancingDistributedSampler(dataset, len, num_replicas=2, rank=0, random_level=bad)
    calm = [list(s) for s in samplers(dataset, 3)]
    noisy = [list(s) for s in samplers(dataset, 3, random_level=1.0)]
    assert calm != noisy
    assert {i for x in noisy for i in x} == set(range(300))
    with pytest.warns(UserWarning, match="no effect"):
        LoadBalancingDistributedSampler(
            dataset, len, num_replicas=2, rank=0, shuffle=False, random_level=0.5
        )


def test_argument_errors() -> None:
    dataset = Lengths(10)
    with pytest.raises(ValueError, match="exactly one"):
        LoadBalancingDistributedSampler(dataset, None, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="9 values for a dataset of 10"):
        LoadBalancingDistributedSampler(
            dataset, None, num_replicas=2, rank=0, complexities=[1] * 9
        )
    with pytest.raises(ValueError, match="outside"):
        LoadBalancingDistributedSampler(dataset, len, num_replicas=2, rank=2)


def test_resume_mid_epoch_on_fewer_ranks() -> None:
    dataset = Lengths(240)
    old = samplers(dataset, 4)
    for s in old:
        s.set_epoch(2)
    batch = 5
    done = set()
    for step in range(3):
        for s in old:
            done.update(list(s)[step * batch : (step + 1) * batch])
            s.record_batch(step, batch)
    state = old[0].state_dict()
    assert state["processed_num"] == 60 and state["epoch"] == 2
    new = samplers(dataset, 3)
    for s in new:
        s.load_state_dict(state)
    rest = Counter(i for s in new for i in s)
    assert set(rest) | done == set(range(240)) and not set(rest) & done
    assert sum(rest.values()) == 180 and new[0].processed_num == 60
    # A second resize in the same epoch.
    for s in new:
        s.record_batch(0, 10)
    again = samplers(dataset, 2)
    for s in again:
        s.load_state_dict(new[0].state_dict())
    assert again[0].processed_num == 90
    rest2 = {i for s in again for i in s}
    assert len(rest2) == 150 and not rest2 & done
    with pytest.raises(ValueError, match="segments"):
        again[0].load_state_dict({"epoch": 0, "processed_num": 5})


def test_reset_keeps_the_progress() -> None:
    # TorchState.reset() calls reset() after a membership change, without a restore.
    dataset = Lengths(90)
    ranks = samplers(dataset, 3)
    done = set()
    for s in ranks:
        done.update(list(s)[:4])
        s.record_batch(0, 4)
        s.reset()
    assert ranks[0].processed_num == 12
    rest = {i for s in ranks for i in s}
    assert rest | done == set(range(90)) and not rest & done
    ranks[0].set_epoch(1)
    assert ranks[0].processed_num == 0 and len(ranks[0]) == 30


def token_batches(indices: list[int], lengths: list[int], budget: int = 300) -> list[list[int]]:
    batches: list[list[int]] = [[]]
    used = 0
    for i in indices:
        if batches[-1] and used + lengths[i] > budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += lengths[i]
    return batches if batches[0] else []


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler(drop_last: bool) -> None:
    dataset = Lengths(500)
    ranks = samplers(dataset, 3)
    batchers = [
        LoadBalancingDistributedBatchSampler(
            s, lambda x: token_batches(x, dataset.lengths), drop_last=drop_last
        )
        for s in ranks
    ]
    lists = [list(b) for b in batchers]
    assert len({len(x) for x in lists}) == 1 == len({len(b) for b in batchers})
    covered = {i for x in lists for batch in x for i in batch}
    if not drop_last:
        assert covered == set(range(500))
    for b in batchers:
        b.set_epoch(1)
    assert [list(b) for b in batchers] != lists
    with pytest.raises(ValueError, match="drop_last=False"):
        LoadBalancingDistributedBatchSampler(samplers(dataset, 2, drop_last=True)[0], list)
    with pytest.raises(TypeError, match="LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(
            DistributedSampler(dataset, 2, 0), list  # type: ignore[arg-type]
        )


def test_batch_sampler_resume() -> None:
    dataset = Lengths(400)
    ranks = samplers(dataset, 3)
    batchers = [
        LoadBalancingDistributedBatchSampler(s, lambda x: token_batches(x, dataset.lengths))
        for s in ranks
    ]
    done = set()
    for b in batchers:
        for k, batch in enumerate(list(b)[:4]):
            done.update(batch)
            b.record_batch(k)
    state = ranks[0].state_dict()
    assert state == ranks[2].state_dict() and state["processed_num"] == len(done)
    new = samplers(dataset, 2)
    for s in new:
        s.load_state_dict(state)
    rebatched = [
        LoadBalancingDistributedBatchSampler(s, lambda x: token_batches(x, dataset.lengths))
        for s in new
    ]
    rest = {i for b in rebatched for batch in b for i in batch}
    assert rest | done == set(range(400)) and not rest & done
