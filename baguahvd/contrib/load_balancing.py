"""Load-balanced distributed sampling: every step costs about the same on every rank.

A synchronous data-parallel step waits for the slowest rank, so when samples differ in cost
(sequence length, image size) a random split wastes the time between the cheapest and the
most expensive rank. The plan of an epoch, computed identically on every rank from the
seed, the epoch and the per-sample complexities:

1. a generator seeded with ``seed + epoch``; the pool (the samples not processed yet this
   epoch, all of them at the start) in random order if ``shuffle``, padded by repeating it,
   or cut with ``drop_last``, to a multiple of the number of ranks R;
2. a stable sort by complexity plus, if ``shuffle``, an integer noise drawn uniformly from
   ``[0, int((max - min) * random_level + 1))`` per sample; ties keep the random order;
3. the sorted list is cut into chunks of R consecutive samples of similar complexity, and
   chunk ``c`` is rotated by ``(c + epoch) % R``, so no rank always takes the cheapest
   member of its chunks;
4. the chunks in random order if ``shuffle``; rank ``r``'s i-th sample is member ``r`` of
   the i-th chunk.

Batches of B consecutive samples of each rank then hold the same chunks on every rank.

Elastic resume: the epoch's progress is a list of segments, one per world size it ran
under: (R, how many samples of its list each rank processed). The processed samples are
recomputed from the segments, and the rest of the epoch is planned again over the current
ranks, so a restart continues with the samples not processed yet, balanced again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
import torch.utils.data

from baguahvd.runtime.runtime import runtime
from baguahvd.torch.elastic import ElasticSampler

Segment = tuple[int, list[int]]  # (number of ranks, samples processed per rank)


class LoadBalancingDistributedSampler(ElasticSampler):
    """A ``DistributedSampler`` whose every step has about the same total complexity on
    every rank (Bagua's ``LoadBalancingDistributedSampler``, see the module docstring).

    Each epoch covers every sample once (padding aside, as ``DistributedSampler``), and
    every rank computes the same plan. Call :meth:`set_epoch` at the start of each epoch.
    It is an :class:`~baguahvd.torch.elastic.ElasticSampler`: put it in a ``TorchState``,
    call :meth:`record_batch` after each batch, and a restart resumes the epoch with the
    samples not processed yet, re-balanced over the new ranks.

    Differences from Bagua's: rank ``r`` does not always take the r-th cheapest sample of
    each chunk (chunks are rotated); samples of equal complexity are not always grouped the
    same way (ties are broken by the shuffle); ``drop_last`` drops random samples rather
    than always the most complex ones; complexities can be given precomputed.

    Example:
        >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> for epoch in range(epochs):
        ...     sampler.set_epoch(epoch)

    Args:
        dataset: the dataset (anything with ``len``; indexed only by ``complexity_fn``).
        complexity_fn: the cost of a sample, ``complexity_fn(dataset[i])``, a number; called
            once per sample here. May be None when ``complexities`` is given.
        num_replicas: number of ranks (default: ``size()``, re-read on an elastic reset).
        rank: this rank (default: ``rank()``, re-read on an elastic reset).
        shuffle: randomize the plan every epoch.
        seed: seed of the plan; the same on every rank.
        drop_last: drop samples to make the epoch divisible by the ranks instead of padding.
        random_level: in [0, 1]; how much random noise (relative to the range of
            complexities) is added before sorting: 0 balances best, 1 mixes most.
        complexities: keyword only; precomputed ``complexity_fn(dataset[i])`` of every
            sample, instead of calling ``complexity_fn``.

    Raises:
        ValueError: ``random_level`` outside [0, 1], an invalid ``num_replicas`` or
            ``rank``, neither or both of ``complexity_fn`` and ``complexities``, or
            ``complexities`` of the wrong length.
    """

    def __init__(
        self,
        dataset: Sized,
        complexity_fn: Callable[[Any], float] | None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
        *,
        complexities: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        if not 0 <= random_level <= 1:
            raise ValueError(f"random_level must be in [0, 1], got {random_level}")
        if (complexity_fn is None) == (complexities is None):
            raise ValueError("give exactly one of complexity_fn and complexities")
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if rank is not None and not 0 <= rank < (num_replicas or runtime.size()):
            raise ValueError(f"rank {rank} is outside [0, num_replicas)")
        if random_level > 0 and not shuffle:
            warnings.warn("random_level has no effect with shuffle=False", stacklevel=2)
        if complexities is None:
            assert complexity_fn is not None
            indexable: Any = dataset
            complexities = [complexity_fn(indexable[i]) for i in range(len(dataset))]
        costs = torch.as_tensor(complexities, dtype=torch.float64).reshape(-1)
        if len(costs) != len(dataset):
            raise ValueError(
                f"complexities has {len(costs)} values for a dataset of {len(dataset)} samples"
            )
        self.dataset = dataset
        self.complexities = costs
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.random_level = random_level
        spread = float(costs.max() - costs.min()) if len(costs) else 0.0
        self.random_number = int(spread * random_level + 1)
        self._fixed_replicas = num_replicas
        self._fixed_rank = rank
        self.epoch = 0
        self.segments: list[Segment] = []
        self.current: list[int] = []  # samples processed per rank under num_replicas
        self.plan_version = 0
        self.reset()

    # -- the plan -------------------------------------------------------------------------

    def plan(self, pool: torch.Tensor, replicas: int, salt: int = 0) -> torch.Tensor:
        """The chunks of ``pool`` (dataset indices) over ``replicas`` ranks: an int64
        tensor ``[num_samples, replicas]`` whose column ``r`` is rank ``r``'s samples."""
        n = len(pool)
        num_samples = n // replicas if self.drop_last else math.ceil(n / replicas)
        total = num_samples * replicas
        if total == 0:
            return torch.empty(0, replicas, dtype=torch.int64)
        g = torch.Generator().manual_seed(self.seed + self.epoch + 7919 * salt)
        base = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        if total > n:
            base = base.repeat(math.ceil(total / n))
        idx = pool[base[:total]]
        key = self.complexities[idx]
        if self.shuffle and self.random_number > 1:
            noise = torch.randint(0, self.random_number, (len(self.complexities),), generator=g)
            key = key + noise[idx].to(key.dtype)
        chunks = idx[torch.sort(key, stable=True).indices].view(num_samples, replicas)
        shift = (torch.arange(num_samples) + self.epoch) % replicas
        columns = (torch.arange(replicas).unsqueeze(0) + shift.unsqueeze(1)) % replicas
        chunks = chunks.gather(1, columns)
        if self.shuffle:
            chunks = chunks[torch.randperm(num_samples, generator=g)]
        return chunks

    def reset(self) -> None:
        """Plans the rest of the epoch over the current ranks (see the module docstring)."""
        if any(self.current):
            # Progress under the previous world size becomes a segment of its own.
            self.segments.append((self.num_replicas, list(self.current)))
        self.num_replicas = self._fixed_replicas or runtime.size()
        self.rank = self._fixed_rank if self._fixed_rank is not None else runtime.rank()
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside [0, {self.num_replicas})")
        pool = torch.arange(len(self.complexities))
        for salt, (replicas, done) in enumerate(self.segments):
            chunks = self.plan(pool, replicas, salt)
            processed = torch.cat([chunks[:count, r] for r, count in enumerate(done)])
            keep = torch.ones(len(self.complexities), dtype=torch.bool)
            keep[processed] = False
            pool = pool[keep[pool]]
        self.chunks = self.plan(pool, self.num_replicas, len(self.segments))
        self.current = [0] * self.num_replicas
        self.num_samples = len(self.chunks)
        self.total_size = self.num_samples * self.num_replicas
        self.plan_version += 1

    def rank_indices(self, rank: int) -> list[int]:
        """The samples of ``rank`` for the rest of this epoch, in order."""
        return self.chunks[:, rank].tolist()  # type: ignore[no-any-return]

    # -- epochs and elastic progress ------------------------------------------------------

    @property
    def processed_num(self) -> int:  # type: ignore[override]
        """Samples processed this epoch, over all ranks."""
        return sum(sum(done) for _, done in self.segments) + sum(self.current)

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` from its first sample."""
        self.epoch = epoch
        self.segments = []
        self.current = []
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Counts one processed batch of ``batch_size`` samples on every rank."""
        self.record_progress([batch_size] * self.num_replicas)

    def record_progress(self, samples_per_rank: list[int]) -> None:
        """Counts ``samples_per_rank[r]`` more processed samples of rank ``r``'s list."""
        self.current = [
            min(done + more, self.num_samples)
            for done, more in zip(self.current, samples_per_rank)
        ]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{'epoch', 'processed_num', 'segments'}``; the segments locate the processed
        samples."""
        segments = [*self.segments]
        if any(self.current):
            segments.append((self.num_replicas, list(self.current)))
        return {"epoch": self.epoch, "processed_num": self.processed_num, "segments": segments}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues from ``state_dict`` (from :meth:`state_dict`) on the current ranks."""
        self.epoch = int(state_dict["epoch"])
        if "segments" not in state_dict and int(state_dict.get("processed_num", 0)):
            raise ValueError(
                "this state has no 'segments': it comes from another sampler; "
                "load a LoadBalancingDistributedSampler's state_dict()"
            )
        self.segments = [(int(r), [int(d) for d in done]) for r, done in state_dict["segments"]]
        self.current = []
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_indices(self.rank))

    def __len__(self) -> int:
        return self.num_samples


class LoadBalancingDistributedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of a :class:`LoadBalancingDistributedSampler` cut by ``batch_fn``
    (Bagua's ``LoadBalancingDistributedBatchSampler``).

    Every rank calls ``batch_fn`` on every rank's list, so all ranks agree on the number of
    batches: the largest count (the smallest with ``drop_last``); a rank with fewer batches
    repeats its own first batches. Record each batch with :meth:`record_batch` for elastic
    resume (the sampler must be in the ``TorchState``).

    Example:
        >>> def batch_fn(indices):  # batches of at most 4096 tokens
        ...     ...
        >>> batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn)
        >>> loader = DataLoader(dataset, batch_sampler=batches)

    Args:
        sampler: the sampler, built with ``drop_last=False``.
        batch_fn: splits a rank's list of indices, in order, into consecutive batches:
            ``batch_fn(indices) -> list[list[int]]``.
        drop_last: use the smallest batch count instead of the largest.

    Raises:
        TypeError: ``sampler`` is not a LoadBalancingDistributedSampler.
        ValueError: the sampler drops samples itself.
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], list[list[int]]],
        drop_last: bool = False,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(
                f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}"
            )
        if sampler.drop_last:
            raise ValueError(
                "build the sampler with drop_last=False and pass drop_last to the batch sampler"
            )
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self._version = -1
        self.generate()

    def generate(self) -> None:
        """Cuts every rank's list into batches and fixes this rank's batches."""
        sampler = self.sampler
        per_rank = [self.batch_fn(sampler.rank_indices(r)) for r in range(sampler.num_replicas)]
        counts = [len(batches) for batches in per_rank]
        self.total_batch = min(counts) if self.drop_last else max(counts)
        # Samples of each rank's list covered by its first k batches (repeats excluded).
        self._covered = [
            [sum(len(b) for b in batches[:k]) for k in range(self.total_batch + 1)]
            for batches in per_rank
        ]
        mine = per_rank[sampler.rank]
        if mine and len(mine) < self.total_batch:
            mine = (mine * math.ceil(self.total_batch / len(mine)))[: self.total_batch]
        self.batches = mine[: self.total_batch]
        self._recorded = 0
        self._base = list(sampler.current)
        self._version = sampler.plan_version

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` of the sampler and re-cuts the batches."""
        self.sampler.set_epoch(epoch)
        self.generate()

    def record_batch(self, batch_idx: int, batch_size: int | None = None) -> None:
        """Counts one more processed batch on every rank (``batch_size`` is ignored: each
        rank's batch has its own size, known from ``batch_fn``)."""
        if self._version != self.sampler.plan_version:
            self.generate()
        self._recorded = min(self._recorded + 1, self.total_batch)
        done = [
            min(covered[min(self._recorded, len(covered) - 1)], self.sampler.num_samples)
            for covered in self._covered
        ]
        self.sampler.current = [base + d for base, d in zip(self._base, done)]

    def __iter__(self) -> Iterator[list[int]]:
        if self._version != self.sampler.plan_version:
            self.generate()
        return iter(self.batches)

    def __len__(self) -> int:
        if self._version != self.sampler.plan_version:
            self.generate()
        return self.total_batch
