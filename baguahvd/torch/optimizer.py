"""Horovod's DistributedOptimizer (``algorithm=None``): averages gradients across ranks while
backward is still running.

Each parameter's gradient is allreduced as soon as autograd has accumulated it (a
post-accumulate-grad hook), so communication overlaps the rest of the backward pass;
``step()`` waits for what is outstanding, then runs the wrapped optimizer.

From the second step on, gradients that can be are views of flat buckets, each reduced as
one request when its last gradient is due (:mod:`baguahvd.torch.buckets`); the others, and
every gradient while ``BAGUAHVD_GRADIENT_BUCKETS=0``, with Adasum or with a compressor of
the user's own, are reduced one by one (or by ``groups``) as in Horovod.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from baguahvd.common.ops import ReduceOp
from baguahvd.runtime.process_sets import ProcessSet
from baguahvd.runtime.runtime import runtime
from baguahvd.torch.buckets import (
    BUCKET_COMPRESSIONS,
    GradientBuckets,
    Recording,
    agree_layout,
    bucket_threshold,
    layout_with_groups,
)
from baguahvd.torch.functions import broadcast_object
from baguahvd.torch.mpi_ops import (
    allreduce_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)
from baguahvd.torch.optimizer_protocol import (
    ZERO_GRAD_RACE,
    SynchronizeProtocol,
    check_named_parameters,
    optimizer_subclass,
    with_defaults_of,
)


class _DistributedOptimizer(SynchronizeProtocol, torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see the factory)."""

    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        self._wrapped_optimizer_class.__init__(self, params)  # type: ignore[misc,call-arg]
        self._compression = compression
        named = check_named_parameters(named_parameters, self.param_groups)
        self._parameter_names: dict[torch.Tensor, str] = {p: name for name, p in named}
        self._init_protocol((p for _, p in named), backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._hook_handles: list[Any] = []
        self._hooked: set[torch.Tensor] | None = None
        """The parameters with this optimizer's hook; None where it reduces nothing (a
        single rank, or a process set without this one)."""
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._groups = _resolve_groups(groups, trainable, self._parameter_names, process_set)
        self._group_of: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {
            p: group for group in self._groups for p in group
        }
        self._group_ready: dict[tuple[torch.Tensor, ...], set[torch.Tensor]] = {}
        self._buckets: GradientBuckets | None = None
        self._recording: Recording | None = None
        """What the first step saw, while buckets are wanted and not built yet."""
        config = runtime.config
        elastic = bool(config is not None and config.elastic)
        if process_set.included() and (runtime.size() > 1 or elastic):
            self._register_hooks()
            if (
                (config is None or config.gradient_buckets)
                and op != ReduceOp.ADASUM
                and compression in BUCKET_COMPRESSIONS
            ):
                self._recording = Recording()

    # -- hooks -----------------------------------------------------------------------------

    def _register_hooks(self) -> None:
        self._hooked = set()
        self._hook_new()

    def _hook_new(self) -> set[torch.Tensor]:
        """Hooks the parameters that train (``requires_grad``) and have no hook yet: every
        one at construction; later, at each ``synchronize()``, those unfrozen or added by
        ``add_param_group`` since (their gradient of that step is reduced with the ones
        whose hook did not fire). Returns the parameters that train."""
        hooked = self._hooked
        assert hooked is not None
        trainable = {
            p for group in self.param_groups for p in group["params"] if p.requires_grad
        }
        for p in trainable - hooked:
            hooked.add(p)
            self._hook_handles.append(self._claim(p))
        return trainable

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Torch's ``add_param_group``; the new parameters are reduced from the next
        ``synchronize()`` on, each named by its position (``allreduce.noname.<group>.<i>``,
        the same on every rank that adds the same groups)."""
        self._wrapped_optimizer_class.add_param_group(self, param_group)  # type: ignore[misc]
        names = getattr(self, "_parameter_names", None)
        if names is None:  # torch's __init__ adding the first groups
            return
        index = len(self.param_groups) - 1
        for position, p in enumerate(self.param_groups[index]["params"]):
            names.setdefault(p, f"allreduce.noname.{index}.{position}")
            self._allreduce_delay.setdefault(p, self.backward_passes_per_step)

    def _released(self) -> None:
        # The buckets' fill hooks would point gradients at their views before the later
        # optimizer's buckets could.
        if self._buckets is not None:
            self._buckets.close()

    def _on_gradient(self, p: torch.Tensor) -> None:
        # The countdown reaches zero exactly when this gradient has been handed to an
        # allreduce (or to its group); it is reset only by synchronize().
        buckets = self._live_buckets()
        recording = self._recording
        if recording is not None:
            recording.saw(p)
        if not self._count_pass(p):
            return
        if buckets is not None and buckets.due(p):
            return
        if recording is not None:
            recording.due(p)
        group = self._group_of.get(p)
        if group is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        ready = self._group_ready.setdefault(group, set())
        ready.add(p)
        if len(ready) == len(group):
            del self._group_ready[group]
            self._handles[group] = self._grouped_allreduce_async(group)

    def _live_buckets(self) -> GradientBuckets | None:
        """The buckets, unless their layout was agreed under an earlier engine: after an
        elastic reset the members may have changed, so the next step records again."""
        buckets = self._buckets
        if buckets is not None and buckets.engine is not runtime.engine:
            buckets.close()
            self._buckets = buckets = None
            self._recording = Recording()
        return buckets

    def _factors(self) -> tuple[float, float]:
        if self.op == ReduceOp.AVERAGE:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name, self.op, self.process_set), "sparse"
            tensor = tensor.to_dense()
        elif not tensor.is_contiguous():
            # A channels_last parameter's gradient: reduced as a contiguous copy, which
            # synchronize() copies back.
            tensor = tensor.contiguous()
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._factors()
        handle = allreduce_async_(
            compressed,
            name=name,
            op=self.op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self.process_set,
        )
        return handle, (ctx, compressed)

    def _grouped_allreduce_async(self, group: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        tensors = []
        contexts = []
        # Members frozen since the groups were formed, without a gradient: the group still
        # sends one for them (zeros), but the optimizer must not see it.
        frozen = {p for p in group if p.grad is None and not p.requires_grad}
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad.contiguous()
            compressed, ctx = self._compression.compress(grad)
            tensors.append(compressed)
            contexts.append(ctx)
        pre, post = self._factors()
        handle = grouped_allreduce_async_(
            tensors,
            name=self._parameter_names.get(group[0]),
            op=self.op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self.process_set,
        )
        return handle, (contexts, tensors, frozen)

    # -- synchronization ---------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finishes the allreduce of every gradient and writes the results into ``.grad``.

        Gradients whose hook has not fired (unused parameters, or fewer backward passes
        than ``backward_passes_per_step``) are allreduced now, so that every rank submits
        the same names.
        """
        if not self.process_set.included():
            self._synchronized = True
            return
        # What trains now, which a frozen parameter leaves and an unfrozen one joins.
        trainable = set() if self._hooked is None else self._hook_new()
        launched: set[torch.Tensor] = set()
        for key in self._handles:
            launched.update(key if isinstance(key, tuple) else (key,))
        buckets = self._live_buckets()
        if buckets is not None:
            launched.update(buckets.slots)
            buckets.force()
        for p in sorted(trainable - launched, key=self._order):
            if self._recording is not None:
                self._recording.due(p)
            group = self._group_of.get(p)
            if group is not None:
                if group not in self._handles:
                    self._group_ready.pop(group, None)
                    self._handles[group] = self._grouped_allreduce_async(group)
            else:
                self._handles[p] = self._allreduce_grad_async(p)
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                contexts, _, frozen = ctx
                for p, output, c in zip(key, outputs, contexts):
                    if p in frozen:  # sent as zeros: its gradient stays None
                        p.grad = None
                    else:
                        self._write_grad(p, self._compression.decompress(output, c))
                self._reset_count(key)
                continue
            if ctx == "sparse":
                self._write_grad(key, handle())
            else:
                output = synchronize(handle)
                self._write_grad(key, self._compression.decompress(output, ctx[0]))
            self._reset_count((key,))
        self._handles.clear()
        self._group_ready.clear()
        if buckets is not None:
            buckets.wait()
            self._reset_count(buckets.slots)
        elif self._recording is not None:
            self._build_buckets(self._recording, trainable)
        self._synchronized = True

    def _build_buckets(self, recording: Recording, trainable: set[torch.Tensor]) -> None:
        """Agrees on the layout with the other members (collective) and moves the
        gradients into their buckets."""
        self._recording = None
        names = self._parameter_names
        threshold = bucket_threshold(
            runtime.require_engine().settings.fusion_threshold,
            runtime.config.bucket_bytes if runtime.config is not None else 0,
        )
        order, threshold, breaks = agree_layout(
            recording, names, trainable, threshold, self.process_set
        )
        params = {names[p]: p for p in trainable}
        layout = layout_with_groups(order, params, self._groups, names, threshold, breaks)
        if layout:
            self._buckets = GradientBuckets(
                layout, params, self.op, self._factors(), self._compression, self.process_set,
                order,
            )

    def _order(self, p: torch.Tensor) -> str:
        return self._parameter_names.get(p, "")

    @staticmethod
    def _write_grad(p: torch.Tensor, value: torch.Tensor) -> None:
        assert p.grad is not None
        if p.grad.is_sparse:
            p.grad = value if value.is_sparse else value.to_sparse()
        elif value.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(value.to(p.grad.dtype).view_as(p.grad))

    def _gradients_pending(self) -> bool:
        return bool(self._handles or self._group_ready or self._passes_started())

    def step(self, closure: Any = None) -> Any:
        closure = self._closure_for_step(closure)
        return self._wrapped_optimizer_class.step(self, closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Like Horovod, also refuse while gradients are half accumulated (fewer backward
        # passes than backward_passes_per_step): zeroing them would desynchronise the
        # countdowns from the gradients.
        if self._gradients_pending():
            raise AssertionError(ZERO_GRAD_RACE)
        # Bucketed gradients too: backward points them at their zeroed views again
        # (GradientBucket.fill).
        return self._wrapped_optimizer_class.zero_grad(self, set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._handles.clear()
        self._group_ready.clear()
        if self._buckets is not None:
            self._buckets.reset()
        self._synchronized = False
        self._reset_count()
        self._wrapped_optimizer_class.load_state_dict(self, state_dict)  # type: ignore[misc]


def _resolve_groups(
    groups: Any,
    params: list[torch.Tensor],
    names: dict[torch.Tensor, str],
    process_set: ProcessSet,
) -> list[tuple[torch.Tensor, ...]]:
    """Turns ``groups`` into tuples of parameters; ``params`` are the trainable parameters
    of the optimizer, split into consecutive chunks when ``groups`` is an int."""
    if groups is None or (isinstance(groups, int) and groups == 0):
        return []
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(
                "groups should be a non-negative integer or a list of list of torch.Tensor."
            )
        if not params:
            return []
        ordered = params
        if process_set.included():
            # Rank 0's parameter order decides, so that every rank forms the same groups
            # even if the ranks listed their parameters in different orders.
            root = process_set.ranks[0] if process_set.ranks else 0
            order = broadcast_object(
                [names[p] for p in params],
                root,
                name="optimizer.groups",
                process_set=process_set,
            )
            position = {name: index for index, name in enumerate(order)}
            ordered = sorted(params, key=lambda p: position.get(names[p], len(position)))
        count = min(groups, len(ordered))
        size, extra = divmod(len(ordered), count)
        chunks, start = [], 0
        for index in range(count):
            stop = start + size + (1 if index < extra else 0)
            chunks.append(tuple(ordered[start:stop]))
            start = stop
        return chunks
    if isinstance(groups, list):
        seen: set[int] = set()
        result = []
        for group in groups:
            if not isinstance(group, (list, tuple)):
                raise ValueError(
                    "groups should be a non-negative integer or a list of list of torch.Tensor."
                )
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
            if group:
                result.append(tuple(group))
        return result
    raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")


def make_allreduce_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
    compression: Any,
    backward_passes_per_step: int,
    op: ReduceOp,
    gradient_predivide_factor: float,
    groups: Any,
    sparse_as_dense: bool,
    process_set: ProcessSet,
) -> torch.optim.Optimizer:
    """Builds Horovod's per-gradient allreduce variant of ``DistributedOptimizer`` (see
    :func:`baguahvd.torch.distributed_optimizer.DistributedOptimizer` for the arguments): a
    subclass of ``type(optimizer)`` with the same name."""
    cls = optimizer_subclass(optimizer, _DistributedOptimizer)
    wrapped = cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    return with_defaults_of(wrapped, optimizer)
