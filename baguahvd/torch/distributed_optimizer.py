"""``DistributedOptimizer``: chooses among Horovod's per-gradient allreduce
(:mod:`baguahvd.torch.optimizer`), Horovod's Adasum delta optimizer
(:mod:`baguahvd.torch.adasum_optimizer`) and a Bagua algorithm
(:mod:`baguahvd.torch.algorithms.optimizer`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from baguahvd.common.ops import Adasum, Average, ReduceOp, to_reduce_op
from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.adasum_optimizer import make_adasum_optimizer
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer
from baguahvd.torch.algorithms.registry import resolve
from baguahvd.torch.compression import Compression
from baguahvd.torch.optimizer import make_allreduce_optimizer


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a factory
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    algorithm: Any = None,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that gradients are averaged across ranks before each step.

    The result is a new optimizer of a subclass of ``type(optimizer)`` (same class name),
    built from ``optimizer.param_groups``; hooks start an allreduce for each gradient as soon
    as it is ready, and ``step()`` waits for them.

    From the second step on, dense contiguous gradients are views of flat buckets (per dtype
    and device, in the order backward produces them, up to the fusion threshold each), and
    each bucket is allreduced in place as one request once its last gradient is ready, with
    no copy through a fusion buffer. ``zero_grad()`` sets gradients to None, as torch's
    does, and backward points them at their views again, each bucket zeroed just before
    autograd accumulates into it. ``BAGUAHVD_GRADIENT_BUCKETS=0`` reduces every gradient on
    its own, as Horovod does (see :mod:`baguahvd.torch.buckets`).

    A parameter is reduced by the latest DistributedOptimizer that wraps it: building a new
    one over the same model (a new phase of training) silences the earlier one's hooks,
    even while the earlier one is still referenced, and stops an earlier algorithm's
    background work. Nothing is stored on the parameters themselves, so
    ``torch.save(model)`` and ``copy.deepcopy(model)`` work as without it.

    Parameters unfrozen or added by ``add_param_group`` after it was built are reduced
    from the next ``synchronize()`` on (a group added without ``lr``... takes the wrapped
    optimizer's defaults); frozen ones keep no gradient. With ``op=Adasum`` or an
    ``algorithm``, such a parameter raises ``ValueError`` at the next step.

    ``step(closure)`` reduces the gradients of the closure's backward pass as each call of
    the closure returns, before the wrapped optimizer reads them (LBFGS calls it several
    times); an optimizer that decides on the returned loss needs the same loss on every
    rank (return ``hvd.allreduce(loss.detach())``).

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names key the allreduces across ranks
            (default: positional names).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with ``Average``, divide by this before the sum and
            multiply after (the set size still divides).
        num_groups: deprecated; use ``groups``.
        groups: an int (split the parameters into that many fused groups) or a list of
            lists of parameters, each allreduced as one unit.
        sparse_as_dense: allreduce sparse gradients as dense tensors.
        process_set: the ranks that average gradients.
        algorithm: a Bagua algorithm (keyword only): a registered name such as
            ``"bytegrad"`` or an algorithm object carrying hyperparameters. Default: the
            ``BAGUAHVD_ALGORITHM`` setting, else Horovod's per-gradient allreduce.
    """
    reduce_op = to_reduce_op(op)
    if gradient_predivide_factor != 1.0 and reduce_op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    # Before init() this raises Horovod's not-initialized error: an optimizer built then
    # would register no hooks and the ranks would silently train apart.
    world_size = runtime.size()
    chosen = algorithm
    if chosen is None and runtime.config is not None:
        chosen = runtime.config.algorithm
    if chosen is not None:
        resolved = resolve(chosen)
        if reduce_op != ReduceOp.AVERAGE or compression is not Compression.none or groups:
            raise ValueError(
                f"algorithm={resolved.name!r} does its own reduction and compression; "
                "op, compression and groups only apply to Horovod's allreduce (algorithm=None)."
            )
        return make_algorithm_optimizer(
            optimizer, named_parameters, resolved, backward_passes_per_step, process_set
        )
    if reduce_op == Adasum and world_size > 1:
        return make_adasum_optimizer(
            optimizer,
            named_parameters,
            compression,
            backward_passes_per_step,
            process_set,
            world_size,
        )
    return make_allreduce_optimizer(
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        reduce_op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
