"""What the DistributedOptimizer variants share: Horovod's error messages, the countdown of
backward passes per parameter, the ``synchronize()``/``step()`` protocol, and the subclass
of the user's optimizer class that each factory builds."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch

from baguahvd.runtime.runtime import runtime

TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
STEP_AFTER_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
    "code."
)

UNTRACKED = (
    "{names}: trains now (requires_grad) but did not when DistributedOptimizer({kind}) was "
    "built, or was added by add_param_group since; {kind} cannot reduce its gradient, and "
    "the ranks would train apart. Build the DistributedOptimizer again after changing which "
    "parameters train (the new one takes the parameters over)."
)


class SynchronizeProtocol:
    """Horovod's contract between hooks, ``synchronize()``, ``step()`` and ``zero_grad()``.

    Each parameter counts down from ``backward_passes_per_step``; its gradient is
    communicated when the count reaches zero, and ``synchronize()`` resets it. ``step()``
    synchronizes first unless inside ``skip_synchronize()``.
    """

    backward_passes_per_step: int
    _wrapped_optimizer_class: type[torch.optim.Optimizer]
    """The user's optimizer class (see :func:`optimizer_subclass`)."""
    _allreduce_delay: dict[torch.Tensor, int]
    _parameter_names: dict[torch.Tensor, str]
    param_groups: list[dict[str, Any]]
    _synchronized: bool
    _should_synchronize: bool

    def synchronize(self) -> None:
        raise NotImplementedError

    def _on_gradient(self, p: torch.Tensor) -> None:
        """What the hook of :meth:`_claim` does once autograd has accumulated ``p.grad``."""
        raise NotImplementedError

    def _claim(self, p: torch.Tensor) -> Any:
        """Hooks :meth:`_on_gradient` to ``p``'s gradient and returns the hook's handle.

        A parameter is reduced by the latest DistributedOptimizer that wraps it: an earlier
        one (of a previous phase of training, still held by its scheduler, or just not
        collected yet) would otherwise reduce it a second time under the same name. So the
        earlier one's hook is removed and it is told (:meth:`_released`). The hook holds
        the optimizer weakly, so that a dropped optimizer is freed instead of being kept
        alive by the parameters.
        """
        previous = runtime.wrapped.get(p)
        if previous is not None:
            previous.release()
        owner = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            optimizer = owner()
            if optimizer is not None:
                optimizer._on_gradient(p)

        handle = p.register_post_accumulate_grad_hook(hook)
        runtime.wrapped[p] = Claim(handle, owner)
        return handle

    def _released(self) -> None:
        """A later DistributedOptimizer took one of this optimizer's parameters over (see
        :meth:`_claim`); the hook there is already gone."""

    def _refuse_untracked(self, tracked: Collection[torch.Tensor], kind: str) -> None:
        """Raises ``ValueError`` naming the parameters that train now (``requires_grad``)
        but are not in ``tracked``, what the optimizer reduces since it was built: frozen
        then, or added by ``add_param_group`` since. Their gradients would stay local to
        each rank, and the ranks' weights would part silently."""
        untracked = [
            self._parameter_names.get(p, "a parameter added by add_param_group")
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad and p not in tracked
        ]
        if untracked:
            raise ValueError(UNTRACKED.format(names=", ".join(untracked), kind=kind))

    def _init_protocol(self, params: Iterable[torch.Tensor], passes: int) -> None:
        self.backward_passes_per_step = passes
        self._allreduce_delay = {p: passes for p in params}
        self._synchronized = False
        self._should_synchronize = True

    def _count_pass(self, p: torch.Tensor) -> bool:
        """Counts one backward pass of ``p``; True when its gradient is due."""
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        return self._allreduce_delay[p] == 0

    def _reset_count(self, params: Iterable[torch.Tensor] | None = None) -> None:
        for p in self._allreduce_delay if params is None else params:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _passes_started(self) -> bool:
        """Whether some gradient is accumulated but not yet communicated."""
        return any(
            count != self.backward_passes_per_step for count in self._allreduce_delay.values()
        )

    def _synchronize_for_step(self) -> None:
        """The start of ``step()``: synchronize unless told not to."""
        if self._should_synchronize:
            if self._synchronized:
                # Points at the user's step() call, past torch's own wrapper of step().
                warnings.warn(STEP_AFTER_SYNC, stacklevel=4)
            self.synchronize()
        self._synchronized = False

    def _gradients_pending(self) -> bool:
        """Whether a backward pass since the last ``synchronize()`` left gradients to
        reduce."""
        return self._passes_started()

    def _closure_for_step(self, closure: Any) -> Any:
        """The start of ``step(closure)``: synchronizes unless told not to, and returns what
        to hand the wrapped optimizer's ``step``.

        A closure computes the gradients (its backward pass) that the wrapped optimizer
        reads after each call, and LBFGS calls it several times a step: so they are reduced
        as each call returns, and the step synchronizes first only where a backward pass
        before it left gradients. Horovod synchronizes before the step only, so the wrapped
        optimizer stepped on each rank's own gradients and the ranks' weights parted.
        Inside ``skip_synchronize()`` the closure is handed on as it is.
        """
        if closure is None or not self._should_synchronize:
            self._synchronize_for_step()
            return closure
        if self._gradients_pending():
            self._synchronize_for_step()

        def reduced() -> Any:
            loss = closure()
            self.synchronize()
            self._synchronized = False  # synchronized by the step, not by the user
            return loss

        return reduced

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize; use it after calling
        ``synchronize()`` yourself (e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes are accumulated locally per communication."""
        self.backward_passes_per_step = passes
        self._reset_count()


def optimizer_subclass(optimizer: torch.optim.Optimizer, methods: type) -> type:
    """A subclass of ``type(optimizer)``, with the same name, holding the methods of
    ``methods`` and of its bases up to ``torch.optim.Optimizer``.

    The methods reach the wrapped optimizer's own through ``_wrapped_optimizer_class``
    rather than ``super(self.__class__, self)``, which would recurse forever from an
    instance of a further subclass (Lightning wraps optimizers that way)."""
    namespace: dict[str, Any] = {"_wrapped_optimizer_class": optimizer.__class__}
    for klass in reversed(methods.__mro__):
        if klass in torch.optim.Optimizer.__mro__:
            continue
        namespace.update(
            (key, value)
            for key, value in vars(klass).items()
            if key not in ("__dict__", "__weakref__")
        )
    return type(optimizer.__class__.__name__, (optimizer.__class__,), namespace)


def with_defaults_of(
    wrapped: torch.optim.Optimizer, optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """``wrapped`` (built from ``optimizer.param_groups``), whose ``add_param_group`` now
    fills what a new group leaves out from ``optimizer``'s defaults, the ``lr``, momentum...
    its user gave it, rather than from its class's."""
    wrapped.defaults = dict(optimizer.defaults)
    return wrapped


def check_named_parameters(
    named_parameters: Any, param_groups: list[dict[str, Any]]
) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters`` as a list, checked to name every parameter of ``param_groups``
    once; positional names when it is None."""
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


@dataclasses.dataclass(frozen=True)
class Claim:
    """What the DistributedOptimizer that wraps a parameter registered for it, kept in
    ``runtime.wrapped`` rather than on the parameter, where pickling a whole model
    (``torch.save(model)``) would meet it."""

    hook: Any
    """The handle of the parameter's post-accumulate-grad hook."""
    owner: weakref.ref[Any]
    """The optimizer."""

    def release(self) -> None:
        """Removes the hook and tells the optimizer, if it is still alive."""
        self.hook.remove()
        optimizer = self.owner()
        if optimizer is not None:
            optimizer._released()
