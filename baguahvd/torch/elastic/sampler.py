"""``ElasticSampler``: a distributed sampler that can resume in the middle of an epoch."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from baguahvd.runtime.runtime import runtime


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Splits a dataset across the ranks and remembers how far the epoch got.

    Every epoch the indices are shuffled with ``random.Random(seed + epoch)`` (the same
    order on every rank), the ones already processed this epoch are skipped, the rest is
    padded to a multiple of ``size()`` by repeating it from its start, and rank ``r`` takes
    every ``size()``-th index starting at ``r``. Record each batch with
    :meth:`record_batch` and put the sampler in a ``TorchState``: after a restart, training
    continues with the samples that were not processed yet, split over the new set of
    ranks.

    Args:
        dataset: the dataset (anything with ``len``).
        shuffle: shuffle the indices every epoch.
        seed: seed of the shuffle; the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` from its first sample."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Counts one processed batch of ``batch_size`` samples on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{'epoch': ..., 'processed_num': ...}``."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues from ``state_dict`` (from :meth:`state_dict`) on the current ranks."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Splits the rest of the epoch over the current ``size()`` ranks."""
        self.num_replicas = runtime.size()
        self.rank = runtime.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        while indices and len(indices) < self.total_size:
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
