"""SyncBatchNorm against a single-process BatchNorm over the concatenated batch.

Every rank builds the whole batch from a fixed seed and keeps its own rows, so the oracle
(torch's BatchNorm on the whole batch) runs on every rank too. Batches are uneven across
ranks, and one layout leaves a rank with no rows at all.
"""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.torch.sync_batch_norm import SyncBatchNorm

LAYOUTS = {
    # rows held by each rank, as a function of (rank, size)
    "uneven": lambda r, n: 2 + 3 * r,
    "one_empty": lambda r, n: 0 if r == n - 1 else 3 + r,
}


def rows(layout: str, size: int) -> list[int]:
    return [LAYOUTS[layout](r, size) for r in range(size)]


def my_slice(tensor: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    start = sum(counts[:rank])
    return tensor[start : start + counts[rank]]


BatchNorm = torch.nn.modules.batchnorm._BatchNorm


def reference_bn(dim: int, channels: int, **kwargs: object) -> BatchNorm:
    cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}[dim]
    return cls(channels, **kwargs)  # type: ignore[arg-type]


def make_pair(
    channels: int, dim: int, dtype: torch.dtype, **kwargs: object
) -> tuple[SyncBatchNorm, BatchNorm]:
    sync = SyncBatchNorm(channels, **kwargs).to(dtype)  # type: ignore[arg-type]
    ref = reference_bn(dim, channels, **kwargs).to(dtype)
    if sync.affine:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for module in (sync, ref):
                generator.manual_seed(7)
                module.weight.copy_(torch.rand(channels, generator=generator, dtype=dtype) + 0.5)
                module.bias.copy_(torch.randn(channels, generator=generator, dtype=dtype))
    return sync, ref


SHAPES = {2: (5,), 3: (4, 3), 4: (3, 2, 3)}  # trailing dims (C, ...) by input dim


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dim", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_matches_concatenated_batch(
    rank: int, size: int, layout: str, dim: int, dtype: torch.dtype
) -> None:
    counts = rows(layout, size)
    trailing = SHAPES[dim]
    channels = trailing[0]
    sync, ref = make_pair(channels, dim, dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for step in range(3):
        generator = torch.Generator().manual_seed(100 + step)
        full = torch.randn(sum(counts), *trailing, generator=generator, dtype=dtype) * 3 + 1
        upstream = torch.randn(full.shape, generator=generator, dtype=dtype)

        x_ref = full.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * upstream).sum().backward()

        x = my_slice(full, counts, rank).clone().requires_grad_()
        y = sync(x)
        (y * my_slice(upstream, counts, rank)).sum().backward()

        torch.testing.assert_close(y, my_slice(y_ref, counts, rank), atol=tol, rtol=tol)
        assert x.grad is not None and x_ref.grad is not None
        torch.testing.assert_close(x.grad, my_slice(x_ref.grad, counts, rank), atol=tol, rtol=tol)
        for name in ("weight", "bias"):
            local = getattr(sync, name).grad
            summed = hvd.allreduce(local, op=hvd.Sum, name=f"test_sbn.{name}")
            torch.testing.assert_close(summed, getattr(ref, name).grad, atol=tol, rtol=tol)
        torch.testing.assert_close(sync.running_mean, ref.running_mean, atol=tol, rtol=tol)
        torch.testing.assert_close(sync.running_var, ref.running_var, atol=tol, rtol=tol)
        assert sync.num_batches_tracked.item() == ref.num_batches_tracked.item() == step + 1
        sync.zero_grad()
        ref.zero_grad()


def test_eval_uses_running_stats_locally(rank: int, size: int) -> None:
    counts = rows("uneven", size)
    sync, ref = make_pair(4, 2, torch.float64)
    generator = torch.Generator().manual_seed(3)
    full = torch.randn(sum(counts), 4, generator=generator, dtype=torch.float64)
    sync(my_slice(full, counts, rank))
    ref(full)
    sync.eval()
    ref.eval()
    # Evaluation needs no other rank: a rank-specific batch must not communicate.
    local = torch.randn(rank + 1, 4, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(sync(local), ref(local))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_without_running_stats(rank: int, size: int, mode: str) -> None:
    counts = rows("uneven", size)
    sync, ref = make_pair(3, 4, torch.float64, track_running_stats=False)
    getattr(sync, mode)()
    getattr(ref, mode)()
    generator = torch.Generator().manual_seed(11)
    full = torch.randn(sum(counts), 3, 2, 2, generator=generator, dtype=torch.float64)
    assert sync.running_mean is None
    expected = my_slice(ref(full), counts, rank)
    torch.testing.assert_close(sync(my_slice(full, counts, rank)), expected)


def test_cumulative_average_and_no_affine(rank: int, size: int) -> None:
    counts = rows("uneven", size)
    sync, ref = make_pair(2, 3, torch.float64, momentum=None, affine=False)
    assert sync.weight is None
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        full = torch.randn(sum(counts), 2, 3, generator=generator, dtype=torch.float64)
        x_ref = full.clone().requires_grad_()
        ref(x_ref).pow(2).sum().backward()
        x = my_slice(full, counts, rank).clone().requires_grad_()
        sync(x).pow(2).sum().backward()
        assert x.grad is not None and x_ref.grad is not None
        torch.testing.assert_close(x.grad, my_slice(x_ref.grad, counts, rank))
    torch.testing.assert_close(sync.running_mean, ref.running_mean)
    torch.testing.assert_close(sync.running_var, ref.running_var)


def test_two_layers_share_collective_names(rank: int, size: int) -> None:
    """Layers of different widths reuse the same collective names one after the other."""
    counts = rows("one_empty", size)

    def model(norm: type) -> torch.nn.Sequential:
        torch.manual_seed(5)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 4), norm(4), torch.nn.ReLU(), torch.nn.Linear(4, 3), norm(3)
        ).double()

    sync_model = model(SyncBatchNorm)
    ref_model = model(torch.nn.BatchNorm1d)
    generator = torch.Generator().manual_seed(9)
    full = torch.randn(sum(counts), 6, generator=generator, dtype=torch.float64)
    ref_model(full).sum().backward()
    x = my_slice(full, counts, rank)
    out = sync_model(x)
    out.sum().backward()
    torch.testing.assert_close(out, my_slice(ref_model(full), counts, rank))
    for (name, p), (_, q) in zip(sync_model.named_parameters(), ref_model.named_parameters()):
        assert p.grad is not None and q.grad is not None
        summed = hvd.allreduce(p.grad, op=hvd.Sum, name=f"test_sbn.two.{name}")
        torch.testing.assert_close(summed, q.grad)


def test_training_with_distributed_optimizer(rank: int, size: int) -> None:
    """A few SGD steps with SyncBatchNorm and DistributedOptimizer equal single-process
    training on the whole (uneven) batch."""
    counts = rows("uneven", size)
    total = sum(counts)

    def model(norm: type) -> torch.nn.Sequential:
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), norm(4), torch.nn.Tanh(),
                                   torch.nn.Linear(4, 1)).double()

    sync_model = model(SyncBatchNorm)
    ref_model = model(torch.nn.BatchNorm1d)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(sync_model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=sync_model.named_parameters(),
    )
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        data = torch.randn(total, 5, generator=generator, dtype=torch.float64)
        target = torch.randn(total, 1, generator=generator, dtype=torch.float64)
        ref_optimizer.zero_grad()
        torch.nn.functional.mse_loss(ref_model(data), target, reduction="sum").div(total).backward()
        ref_optimizer.step()
        optimizer.zero_grad()
        local = torch.nn.functional.mse_loss(
            sync_model(my_slice(data, counts, rank)), my_slice(target, counts, rank),
            reduction="sum",
        )
        # The optimizer averages over ranks, so scale each rank's share of the sum by size.
        (local * size / total).backward()
        optimizer.step()
    for p, q in zip(sync_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(sync_model[1], name), getattr(ref_model[1], name))


def test_half_precision_input(rank: int, size: int) -> None:
    counts = rows("uneven", size)
    sync = SyncBatchNorm(3)
    ref = torch.nn.BatchNorm1d(3)
    generator = torch.Generator().manual_seed(4)
    full = torch.randn(sum(counts), 3, generator=generator)
    out = sync(my_slice(full, counts, rank).bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), my_slice(ref(full), counts, rank), atol=0.05, rtol=0.02)
    torch.testing.assert_close(sync.running_mean, ref.running_mean, atol=1e-2, rtol=1e-2)


def test_errors(rank: int, size: int) -> None:
    sync = SyncBatchNorm(3)
    assert isinstance(sync, BatchNorm)
    with pytest.raises(ValueError, match=r"^expected at least 2D input \(got 1D input\)$"):
        sync(torch.randn(3))
    # A single value per channel over all ranks has no variance; every rank refuses.
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        sync(torch.randn(1 if rank == 0 else 0, 3))


def test_cpu_input_is_accepted(rank: int, size: int) -> None:
    out = SyncBatchNorm(2)(torch.randn(4, 2))
    assert out.device.type == "cpu" and out.shape == (4, 2)
