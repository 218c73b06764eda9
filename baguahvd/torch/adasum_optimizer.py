"""DistributedOptimizer with ``op=Adasum``: Horovod's delta optimizer.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021)
combines the ranks' *updates* rather than their gradients. For each parameter, as soon as its
gradient is ready:

1. save the current weights ``start``;
2. run the wrapped optimizer's step for this parameter alone, from ``start``;
3. turn the parameter into the local update ``delta = stepped - start``;
4. allreduce ``delta`` with the Adasum operation (asynchronously).

``step()`` waits for every parameter's combined update and sets ``weights = start + delta``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from baguahvd.common.ops import Adasum
from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.torch.mpi_ops import allreduce_async_, synchronize
from baguahvd.torch.optimizer_protocol import (
    ZERO_GRAD_RACE,
    SynchronizeProtocol,
    check_named_parameters,
    optimizer_subclass,
    with_defaults_of,
)


class _DistributedAdasumOptimizer(SynchronizeProtocol, torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see the factory)."""

    def __init__(
        self,
        params: Any,
        named: list[tuple[str, torch.Tensor]],
        compression: Any,
        backward_passes_per_step: int,
        process_set: ProcessSet,
    ) -> None:
        self._wrapped_optimizer_class.__init__(self, params)  # type: ignore[misc,call-arg]
        self._compression = compression
        self._parameter_names: dict[torch.Tensor, str] = {p: name for name, p in named}
        self._init_protocol((p for _, p in named), backward_passes_per_step)
        self.op = Adasum
        self.process_set = process_set
        self._handles: dict[torch.Tensor, tuple[Any, Any]] = {}
        self._starting_models: dict[torch.Tensor, torch.Tensor] = {}
        self._requires_update: list[torch.Tensor] = []
        self._hook_handles: list[Any] = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                self._requires_update.append(p)
                self._starting_models[p] = torch.zeros_like(p, requires_grad=False)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._hook_handles.append(self._claim(p))

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._count_pass(p):
            self._handles[p] = self._allreduce_delta_async(p)

    def _allreduce_delta_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
                self._wrapped_optimizer_class.step(self)  # type: ignore[misc]
                p.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(
            compressed.contiguous(),
            name=self._parameter_names.get(p),
            op=Adasum,
            process_set=self.process_set,
        )
        return handle, (ctx, compressed)

    def synchronize(self) -> None:
        """Nothing to do: Adasum combines updates inside ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        self._refuse_untracked(self._starting_models, "op=Adasum")
        loss = closure() if closure is not None else None
        for p in self._requires_update:
            if p not in self._handles:
                self._handles[p] = self._allreduce_delta_async(p)
        with torch.no_grad():
            for p, (handle, (ctx, _)) in self._handles.items():
                delta = self._compression.decompress(synchronize(handle), ctx)
                start = self._starting_models[p]
                start.add_(delta.view_as(start).to(start.dtype))
                p.copy_(start)
        self._reset_count(self._handles)
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = False) -> None:
        if self._handles:
            raise AssertionError(ZERO_GRAD_RACE)
        # Gradients stay allocated: the per-parameter step needs them.
        self._wrapped_optimizer_class.zero_grad(self, set_to_none=False)  # type: ignore[misc]


def make_adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any,
    compression: Any,
    backward_passes_per_step: int,
    process_set: ProcessSet,
    size: int,
) -> torch.optim.Optimizer:
    """Builds the ``op=Adasum`` variant of ``DistributedOptimizer`` for a job of ``size``
    ranks: a subclass of ``type(optimizer)`` with the same name."""
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if size & (size - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    cls = optimizer_subclass(optimizer, _DistributedAdasumOptimizer)
    wrapped = cls(
        optimizer.param_groups,
        check_named_parameters(named_parameters, optimizer.param_groups),
        compression,
        backward_passes_per_step,
        process_set,
    )
    return with_defaults_of(wrapped, optimizer)
