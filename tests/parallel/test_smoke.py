import torch

import baguahvd.torch as hvd


def test_allreduce_sum(rank: int, size: int) -> None:
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    y = hvd.allreduce(x, op=hvd.Sum, name="x")
    assert torch.equal(y, torch.arange(6, dtype=torch.float32) * sum(range(1, size + 1)))
