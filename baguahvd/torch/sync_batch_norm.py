"""SyncBatchNorm: batch normalization whose statistics cover the batch of every rank.

Unlike Horovod's, it works on CPU tensors, and ranks may hold batches of different sizes
(including none at all).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from baguahvd.common.ops import Sum
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.mpi_ops import allgather, allreduce_

# One name per collective: a SyncBatchNorm blocks until its collective has finished, so
# layers (and iterations) reuse the names one after another, never concurrently.
_STATS_NAME = "sync_batch_norm.stats"
_GRAD_NAME = "sync_batch_norm.sum_dy_xmu"


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the concatenation of the batches of all ranks.

    A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (any input of shape ``(N, C, ...)``). In
    training, or whenever there are no running statistics, the mean and variance are those
    of the batches of every rank put together, and the input gradient is exactly that of a
    single batch norm over the concatenated batch. The gradients of ``weight`` and ``bias``
    stay local: summed over ranks they equal the single-process ones, and
    ``DistributedOptimizer`` averages them like any other gradient. In evaluation with
    running statistics, or with one rank, it is a plain batch norm.

    Every rank must call ``forward`` (and ``backward``) the same number of times, in the
    same order across layers; a rank without data passes a batch of size 0.

    Args:
        num_features: ``C``, the number of channels.
        eps: added to the variance for numerical stability.
        momentum: weight of the batch statistics in the running statistics; ``None`` for a
            cumulative average.
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running statistics for evaluation.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        if not batch_stats or runtime.size() == 1:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, batch_stats,
                factor, self.eps,
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor
        )


def _reduced_dims(tensor: torch.Tensor) -> list[int]:
    return [0, *range(2, tensor.dim())]


def _per_channel(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Shapes a ``(C,)`` tensor to broadcast against ``(N, C, ...)``."""
    return values.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: combine per-rank (count, mean, sum of squared deviations) exactly (Chan et
    al.'s pairwise update), normalise, update the running statistics. Backward: sum the two
    per-channel reductions of the gradient over ranks, then apply the batch-norm input
    gradient with the global count."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
    ) -> torch.Tensor:
        compute = torch.promote_types(input.dtype, torch.float32)
        x = input.to(compute)
        channels = input.shape[1]
        dims = _reduced_dims(input)
        count = input.numel() // channels if channels else 0
        # Per-rank statistics travel in float64 so that combining them adds no error.
        if count > 0:
            local_mean = x.mean(dims)
            local_m2 = (x - _per_channel(local_mean, x)).square().sum(dims)
        else:
            local_mean = x.new_zeros(channels)
            local_m2 = x.new_zeros(channels)
        # On the input's device: a CUDA input cannot be concatenated with host tensors.
        local = torch.cat(
            [x.new_full((1,), float(count), dtype=torch.float64),
             local_mean.double(), local_m2.double()]
        )
        gathered = allgather(local.unsqueeze(0), name=_STATS_NAME)
        counts = gathered[:, :1]
        means = gathered[:, 1 : channels + 1]
        m2s = gathered[:, channels + 1 :]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got "
                f"{int(total)} across all ranks (input size {list(input.shape)} on this rank)"
            )
        mean64 = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean64).square()).sum(0)
        var64 = m2 / total
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - factor).add_(mean64.to(running_mean.dtype), alpha=factor)
            unbiased = (m2 / (total - 1)).to(running_var.dtype)
            running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        mean = mean64.to(compute)
        invstd = torch.rsqrt(var64 + eps).to(compute)
        output = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            output = output * _per_channel(weight.to(compute), x)
        if bias is not None:
            output = output + _per_channel(bias.to(compute), x)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total = total
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        compute = mean.dtype
        x = input.to(compute)
        dy = grad_output.to(compute)
        dims = _reduced_dims(input)
        xmu = x - _per_channel(mean, x)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else compute)
        if ctx.needs_input_grad[0]:
            reductions = torch.cat([sum_dy, sum_dy_xmu])
            allreduce_(reductions, name=_GRAD_NAME, op=Sum)
            channels = mean.numel()
            mean_dy = reductions[:channels] / ctx.total
            mean_dy_xmu = reductions[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_input = (
                dy
                - _per_channel(mean_dy, x)
                - xmu * _per_channel(invstd.square() * mean_dy_xmu, x)
            ) * _per_channel(scale, x)
            grad_input = grad_input.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


__all__ = ["SyncBatchNorm"]
