"""The DistributedOptimizer variant that hands communication to a Bagua algorithm.

``DistributedOptimizer(opt, named_parameters=..., algorithm="bytegrad")`` builds a subclass of
the user's optimizer class from these methods instead of Horovod's per-gradient allreduce.
Gradient hooks report to the algorithm (``on_backward``), ``step()`` lets it finish the step's
communication (``synchronize``), run or replace the optimizer step (``step``) and act after it
(``post_step``). Horovod's surface stays: ``synchronize()``, ``skip_synchronize()``,
``backward_passes_per_step``, the ``zero_grad`` guard.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any

import torch

from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.algorithms.base import DEFAULT_BUCKET_BYTES, Algorithm, AlgorithmContext
from baguahvd.torch.algorithms.registry import resolve
from baguahvd.torch.optimizer_protocol import (
    ZERO_GRAD_RACE,
    SynchronizeProtocol,
    check_named_parameters,
    optimizer_subclass,
    with_defaults_of,
)


def _communicates_alone() -> bool:
    """Whether the algorithm runs in a job of one rank: in an elastic job (which may grow)
    and under BAGUAHVD_NCCL_SINGLE_RANK (which sends even one rank's CUDA tensors through
    NCCL, to exercise the GPU path); otherwise one rank has nothing to communicate."""
    config = runtime.config
    return config is not None and (config.elastic or config.nccl_single_rank)


class _AlgorithmOptimizer(SynchronizeProtocol, torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see the factory)."""

    def __init__(
        self,
        params: Any,
        named: list[tuple[str, torch.Tensor]],
        algorithm: Algorithm,
        backward_passes_per_step: int,
        process_set: ProcessSet,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._wrapped_optimizer_class.__init__(self, params)  # type: ignore[misc,call-arg]
        self._parameter_names: dict[torch.Tensor, str] = {p: name for name, p in named}
        self.process_set = process_set
        self.algorithm = algorithm
        order = {id(p): i for i, (_, p) in enumerate(named)}
        trainable = [
            (self._parameter_names[p], p)
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad
        ]
        trainable.sort(key=lambda item: order[id(item[1])])
        self._init_protocol((p for _, p in trainable), backward_passes_per_step)
        self._hook_handles: list[Any] = []
        self._impl = None
        if process_set.included() and (runtime.size() > 1 or _communicates_alone()):
            with self._communicating():
                self._impl = algorithm.reify(
                    AlgorithmContext(self, trainable, process_set, bucket_bytes)
                )
            for _, p in trainable:
                self._hook_handles.append(self._claim(p))
            # Dropped without close(): its algorithm's threads (and the async one's
            # averaging with the other ranks) stop once the optimizer is collected.
            self._finalizer = weakref.finalize(self, _close_in_background, self._impl)
            self._finalizer.atexit = False  # hvd.shutdown() closes what is left

    @property
    def algorithm_impl(self) -> Any:
        """The algorithm bound to this optimizer (None on a single rank), e.g. for the async
        algorithm's ``abort()`` and ``resume()``."""
        return self._impl

    def _communicating(self) -> contextlib.AbstractContextManager[None]:
        """Tags the collectives submitted inside the block with the algorithm's activity."""
        return runtime.require_engine().activity(self.algorithm.activity)

    def _released(self) -> None:
        # Its algorithm would go on communicating (the async one from its own thread)
        # under the names the later optimizer now uses.
        self.close()

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._count_pass(p) and self._impl is not None:
            with self._communicating():
                self._impl.on_backward(p)

    def synchronize(self) -> None:
        """Finishes this step's communication (results land in ``.grad`` or the weights)."""
        if self._impl is not None:
            self._refuse_untracked(self._allreduce_delay, f"algorithm={self.algorithm.name!r}")
            with self._communicating():
                self._impl.synchronize()
        self._reset_count()
        self._synchronized = True

    def step(self, closure: Any = None) -> Any:
        closure = self._closure_for_step(closure)
        base_step = functools.partial(self._wrapped_optimizer_class.step, self)  # type: ignore[misc]
        if self._impl is None:
            return base_step(closure)
        with self._communicating():
            result = self._impl.step(closure, base_step)
            self._impl.post_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._passes_started() and not self._synchronized:
            raise AssertionError(ZERO_GRAD_RACE)
        return self._wrapped_optimizer_class.zero_grad(self, set_to_none)  # type: ignore[misc]

    def close(self) -> None:
        """Stops the algorithm's background work (also done at hvd.shutdown())."""
        if self._impl is not None:
            self._finalizer.detach()
            self._impl.close()
            self._impl = None
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()


def _close_in_background(impl: Any) -> None:
    """Closes the algorithm of an optimizer the user dropped, on a thread of its own: the
    optimizer may be collected on any thread (the cyclic collector runs on the one that
    triggers it, the engine's or the algorithm's own included), and the async algorithm's
    ``close()`` waits for the other ranks to stop averaging."""
    threading.Thread(target=impl.close, name="baguahvd-close", daemon=True).start()


def make_algorithm_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any,
    algorithm: Any,
    backward_passes_per_step: int = 1,
    process_set: ProcessSet | None = None,
) -> torch.optim.Optimizer:
    """Builds the algorithm variant of ``DistributedOptimizer`` (which calls this for
    ``algorithm=...``): a subclass of ``type(optimizer)`` with the same name."""
    resolved = resolve(algorithm)
    named = check_named_parameters(named_parameters, optimizer.param_groups)
    cls = optimizer_subclass(optimizer, _AlgorithmOptimizer)
    bucket_bytes = runtime.config.bucket_bytes if runtime.config is not None else None
    wrapped = cls(
        optimizer.param_groups,
        named,
        resolved,
        backward_passes_per_step,
        process_set if process_set is not None else global_process_set,
        *([bucket_bytes] if bucket_bytes else []),
    )
    return with_defaults_of(wrapped, optimizer)
