"""DistributedOptimizer: averages gradients across ranks while backward is still running.

Each parameter's gradient is allreduced as soon as autograd has accumulated it (a
post-accumulate-grad hook), so communication overlaps the rest of the backward pass;
``step()`` waits for what is outstanding, then runs the wrapped optimizer.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from baguahvd.common.ops import Adasum, Average, ReduceOp, to_reduce_op
from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.state import runtime
from baguahvd.torch.compression import Compression
from baguahvd.torch.mpi_ops import (
    allreduce_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)
from baguahvd.torch.optimizer_protocol import (
    ZERO_GRAD_RACE,
    SynchronizeProtocol,
    optimizer_subclass,
)

_HOOK_ATTRIBUTE = "_baguahvd_allreduce_hook"


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
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._compression = compression
        named = _check_named_parameters(named_parameters, self.param_groups)
        self._parameter_names: dict[torch.Tensor, str] = {p: name for name, p in named}
        self._init_protocol((p for _, p in named), backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._hook_handles: list[Any] = []
        self._requires_update: set[torch.Tensor] = set()
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._groups = _resolve_groups(groups, trainable, self._parameter_names, process_set)
        self._group_of: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {
            p: group for group in self._groups for p in group
        }
        self._group_ready: dict[tuple[torch.Tensor, ...], set[torch.Tensor]] = {}
        elastic = bool(runtime.config is not None and runtime.config.elastic)
        if process_set.included() and (runtime.size() > 1 or elastic):
            self._register_hooks()

    # -- hooks -----------------------------------------------------------------------------

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    # A parameter is reduced by the latest DistributedOptimizer wrapping it:
                    # an earlier one (say, of a previous training phase) would otherwise
                    # reduce it a second time under the same name.
                    previous = getattr(p, _HOOK_ATTRIBUTE, None)
                    if previous is not None:
                        previous.remove()
                    handle = p.register_post_accumulate_grad_hook(_make_hook(weakref.ref(self)))
                    setattr(p, _HOOK_ATTRIBUTE, handle)
                    self._hook_handles.append(handle)

    def _on_gradient(self, p: torch.Tensor) -> None:
        # The countdown reaches zero exactly when this gradient has been handed to an
        # allreduce (or to its group); it is reset only by synchronize().
        if not self._count_pass(p):
            return
        group = self._group_of.get(p)
        if group is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        ready = self._group_ready.setdefault(group, set())
        ready.add(p)
        if len(ready) == len(group):
            del self._group_ready[group]
            self._handles[group] = self._grouped_allreduce_async(group)

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
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
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
        return handle, (contexts, tensors)

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
        launched: set[torch.Tensor] = set()
        for key in self._handles:
            launched.update(key if isinstance(key, tuple) else (key,))
        for p in sorted(self._requires_update - launched, key=self._order):
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
                contexts, _ = ctx
                for p, output, c in zip(key, outputs, contexts):
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
        self._synchronized = True

    def _order(self, p: torch.Tensor) -> str:
        return self._parameter_names.get(p, "")

    @staticmethod
    def _write_grad(p: torch.Tensor, value: torch.Tensor) -> None:
        assert p.grad is not None
        if p.grad.is_sparse:
            p.grad = value if value.is_sparse else value.to_sparse()
        elif value.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(value.to(p.grad.dtype).view_as(p.grad))

    def step(self, closure: Any = None) -> Any:
        self._synchronize_for_step()
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Like Horovod, also refuse while gradients are half accumulated (fewer backward
        # passes than backward_passes_per_step): zeroing them would desynchronise the
        # countdowns from the gradients.
        if self._handles or self._group_ready or self._passes_started():
            raise AssertionError(ZERO_GRAD_RACE)
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._handles.clear()
        self._group_ready.clear()
        self._synchronized = False
        self._reset_count()
        super(self.__class__, self).load_state_dict(state_dict)  # type: ignore[misc]


def _make_hook(owner: weakref.ref[Any]) -> Any:
    """The hook holds its optimizer weakly, so that a dropped optimizer is freed (and its
    hooks fall silent) instead of being kept alive by the parameters."""

    def hook(p: torch.Tensor) -> None:
        optimizer = owner()
        if optimizer is not None:
            optimizer._on_gradient(p)

    return hook


def _check_named_parameters(
    named_parameters: Any, param_groups: list[dict[str, Any]]
) -> list[tuple[str, torch.Tensor]]:
    if named_parameters is None:
        return [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(param_groups)
            for j, p in enumerate(group["params"])
        ]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters()."
        )
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(duplicates)
        )
    named_ids = {id(p) for _, p in named}
    unnamed = [id(p) for group in param_groups for p in group["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            "Python object ids: " + ", ".join(str(i) for i in unnamed)
        )
    return named


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
            from baguahvd.torch.functions import broadcast_object

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
    chosen = algorithm
    if chosen is None and runtime.config is not None:
        chosen = runtime.config.algorithm
    if chosen is not None:
        from baguahvd.algorithms import resolve
        from baguahvd.torch.algorithm_optimizer import make_algorithm_optimizer

        resolved = resolve(chosen)
        if reduce_op != ReduceOp.AVERAGE or compression is not Compression.none or groups:
            raise ValueError(
                f"algorithm={resolved.name!r} does its own reduction and compression; "
                "op, compression and groups only apply to Horovod's allreduce (algorithm=None)."
            )
        return make_algorithm_optimizer(
            optimizer, named_parameters, resolved, backward_passes_per_step, process_set
        )
    if reduce_op == Adasum and runtime.size() > 1:
        from baguahvd.torch.adasum_optimizer import _DistributedAdasumOptimizer

        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        if runtime.size() & (runtime.size() - 1):
            raise NotImplementedError(
                "Running Adasum with non-power of 2 ranks is not supported yet."
            )
        adasum_cls = optimizer_subclass(optimizer, _DistributedAdasumOptimizer)
        return adasum_cls(  # type: ignore[no-any-return]
            optimizer.param_groups,
            _check_named_parameters(named_parameters, optimizer.param_groups),
            compression,
            backward_passes_per_step,
            process_set,
        )
    cls = optimizer_subclass(optimizer, _DistributedOptimizer)
    return cls(  # type: ignore[no-any-return]
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        reduce_op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
