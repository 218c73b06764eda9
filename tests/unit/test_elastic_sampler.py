"""ElasticSampler's partition, checked against a direct statement of Horovod's rule."""

from __future__ import annotations

import random

import pytest

from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic import ElasticSampler


def _expected(
    n: int, seed: int, epoch: int, processed: int, size: int, rank: int, shuffle: bool = True
) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    rest = order[processed:]
    while rest and len(rest) % size:
        rest = rest + rest[: size - len(rest) % size]
    return rest[rank::size]


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    where = {"rank": 0, "size": 1}
    monkeypatch.setattr(runtime, "rank", lambda: where["rank"])
    monkeypatch.setattr(runtime, "size", lambda: where["size"])
    return where


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 12, 13])
def test_every_rank_gets_its_share(world: dict[str, int], size: int, n: int) -> None:
    world["size"] = size
    shares = []
    for rank in range(size):
        world["rank"] = rank
        sampler = ElasticSampler(list(range(n)), seed=5)
        assert list(sampler) == _expected(n, 5, 0, 0, size, rank)
        assert len(sampler) == len(list(sampler))
        shares.append(list(sampler))
    assert {i for share in shares for i in share} == set(range(n))
    assert len({len(share) for share in shares}) == 1


def test_resume_mid_epoch_continues_the_same_order(world: dict[str, int]) -> None:
    world["size"] = 2
    sampler = ElasticSampler(list(range(24)), seed=1)
    sampler.set_epoch(2)
    sampler.record_batch(0, 3)
    sampler.record_batch(1, 3)
    assert sampler.state_dict() == {"epoch": 2, "processed_num": 12}
    world["size"], world["rank"] = 3, 1  # the job came back with three ranks
    resumed = ElasticSampler(list(range(24)), seed=1)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == _expected(24, 1, 2, 12, 3, 1)
    assert len(resumed) == 4


def test_set_epoch_reshuffles_and_restarts(world: dict[str, int]) -> None:
    sampler = ElasticSampler(list(range(30)), seed=0)
    sampler.record_batch(0, 10)
    first = list(sampler)
    sampler.set_epoch(1)
    assert sampler.processed_num == 0
    assert sorted(sampler) == list(range(30))
    assert list(sampler) != first


def test_no_shuffle_keeps_order(world: dict[str, int]) -> None:
    world["size"], world["rank"] = 2, 1
    sampler = ElasticSampler(list(range(5)), shuffle=False)
    assert list(sampler) == [1, 3, 0]


def test_everything_processed_gives_nothing(world: dict[str, int]) -> None:
    world["size"] = 2
    sampler = ElasticSampler(list(range(4)))
    sampler.load_state_dict({"epoch": 0, "processed_num": 8})
    assert list(sampler) == [] and len(sampler) == 0
