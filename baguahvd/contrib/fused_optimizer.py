"""``fuse_optimizer``: any elementwise torch optimizer stepped on a few flat buffers.

Protocol. At fuse time the parameters of each param group are bucketed by (dtype, device);
each bucket's parameters, gradients and per-element optimizer state (``exp_avg``,
``momentum_buffer``, ...) are copied into one contiguous buffer each, and every
parameter's ``.data``, ``.grad`` and state tensor becomes a view into its buffer. A bucket
has one *flat parameter*: a 1-D tensor over the parameter buffer whose ``.grad`` is the
gradient buffer and whose state holds the state buffers.

Each ``step()``:

1. checks every bucket (data pointers of the parameters, gradients and state against the
   buffers): a gradient that autograd allocated afresh (after ``zero_grad(set_to_none=True)``)
   or state that ``load_state_dict`` replaced is copied back into the buffer and re-viewed;
   a bucket in a state that fusing would change (some but not all gradients ``None``,
   per-parameter scalars such as ``step`` that differ, a state entry of another shape) is
   stepped unfused this time, parameter by parameter, exactly as without fusion;
2. puts the flat parameters (and the unfused ones) into ``param_groups`` and their state
   into ``optimizer.state`` for the duration of the original ``step()``, then restores both,
   so the user, ``state_dict()`` and schedulers only ever see the original parameters;
3. writes per-parameter scalars (``step``) back from the flat state. State that the step
   created lazily on a flat parameter (Adam's moments at the first step) is handed to the
   parameters: per-element tensors as views, 0-d tensors as views of one buffer.

The update is the optimizer's own code run on bigger tensors, so it is
bit-identical to the unfused optimizer for optimizers whose update is elementwise; an
optimizer that looks at a tensor's shape or norm (LBFGS, Adafactor, LAMB-like trust ratios)
would compute something else and is refused where torch ships it.
"""

from __future__ import annotations

import types
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_ATTRIBUTE = "_baguahvd_fusion"

# torch optimizers whose update is not elementwise (or whose state is not per element).
_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
_PERSISTENT = 3  # unfused steps in a row of one bucket before a warning


class AlreadyFusedError(ValueError):
    """``fuse_optimizer`` was given an optimizer it has fused already."""


class UnsupportedOptimizerError(TypeError):
    """The optimizer's update is not elementwise, so fusing would change its results."""


@dataclass
class _Bucket:
    """Parameters of one param group sharing dtype and device, and their buffers."""

    params: list[torch.Tensor]
    offsets: list[int]
    flat: torch.Tensor  # the flat parameter: a view of the whole parameter buffer
    grad_buffer: torch.Tensor
    # key -> buffer; per-element state (same shape as each parameter)
    elementwise: dict[str, torch.Tensor] = field(default_factory=dict)
    # key -> (per-parameter 0-d views' buffer, the one value the flat step uses)
    scalars: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    plain: dict[str, Any] = field(default_factory=dict)  # non-tensor state, e.g. None
    scalars_checked: bool = False
    grad_views: list[torch.Tensor] = field(default_factory=list)  # views of grad_buffer
    unfused_in_a_row: int = 0

    def slices(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [
            buffer[offset : offset + p.numel()].view_as(p)
            for p, offset in zip(self.params, self.offsets)
        ]


def _views_intact(tensors: list[Any], buffer: torch.Tensor, offsets: list[int]) -> bool:
    base = buffer.data_ptr()
    size = buffer.element_size()
    return all(
        t is not None and t.data_ptr() == base + offset * size
        for t, offset in zip(tensors, offsets)
    )


def _overlaps(tensors: list[Any], buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return any(start <= t.data_ptr() < end for t in tensors)


def _flatten_into(tensors: list[torch.Tensor], buffer: torch.Tensor) -> None:
    torch.cat([t.detach().reshape(-1) for t in tensors], out=buffer)


class _Fusion:
    """The buckets of one optimizer and the fused ``step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
        self.optimizer = optimizer
        self.original_step = step
        self.groups: list[tuple[list[int], list[_Bucket], list[torch.Tensor]]] = []
        self.fused_steps = 0
        self.unfused_steps = 0
        for group in optimizer.param_groups:
            self.groups.append(self._plan_group(group["params"]))

    def _plan_group(
        self, params: list[torch.Tensor]
    ) -> tuple[list[int], list[_Bucket], list[torch.Tensor]]:
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        alone: list[torch.Tensor] = []
        for p in params:
            # 0-d parameters would make 0-d state (``step``) look per-element; frozen ones
            # never have a gradient and would keep their bucket unfused.
            if p.is_sparse or not p.is_contiguous() or p.dim() == 0 or not p.requires_grad:
                alone.append(p)
            else:
                by_kind[(p.dtype, p.device)].append(p)
        buckets = []
        for members in by_kind.values():
            if len(members) < 2:
                alone.extend(members)
                continue
            buckets.append(self._make_bucket(members))
        return [id(p) for p in params], buckets, alone

    def _make_bucket(self, params: list[torch.Tensor]) -> _Bucket:
        offsets = []
        total = 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        first = params[0]
        data = torch.empty(total, dtype=first.dtype, device=first.device)
        _flatten_into(params, data)
        grad_buffer = torch.zeros_like(data)
        bucket = _Bucket(list(params), offsets, data, grad_buffer)
        with torch.no_grad():
            for p, view in zip(params, bucket.slices(data)):
                p.data = view
        flat = torch.nn.Parameter(data, requires_grad=False)
        flat.grad = grad_buffer
        bucket.flat = flat
        bucket.grad_views = bucket.slices(grad_buffer)
        self._adopt_grads(bucket)
        return bucket

    # -- per-step checks -------------------------------------------------------------------

    def _adopt_grads(self, bucket: _Bucket) -> bool:
        """Makes every gradient a view of the gradient buffer; False if some are None."""
        grads = [p.grad for p in bucket.params]
        if any(g is None for g in grads):
            return False
        if _views_intact(grads, bucket.grad_buffer, bucket.offsets):
            return True
        if any(g.is_sparse for g in grads):  # type: ignore[union-attr]
            return False
        flat_grads = [g.reshape(-1) for g in grads]  # type: ignore[union-attr]
        if bucket.grad_views and not _overlaps(grads, bucket.grad_buffer):
            torch.cat(flat_grads, out=bucket.grad_buffer)
        else:
            # A fresh buffer: some gradients are views of the old one.
            bucket.grad_buffer = torch.cat(flat_grads)
            bucket.flat.grad = bucket.grad_buffer
            bucket.grad_views = bucket.slices(bucket.grad_buffer)
        for p, view in zip(bucket.params, bucket.grad_views):
            p.grad = view
        return True

    def _adopt_data(self, bucket: _Bucket) -> None:
        if _views_intact(bucket.params, bucket.flat, bucket.offsets):
            return
        with torch.no_grad():
            # A parameter whose ``.data`` was replaced: take its new values.
            views = bucket.slices(bucket.flat)
            for p, view in zip(bucket.params, views):
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.data)
                    p.data = view

    def _adopt_state(self, bucket: _Bucket) -> bool:
        """Makes the state flat; False when this bucket's state cannot be fused now."""
        states = [self.optimizer.state.get(p, {}) for p in bucket.params]
        keys = set(states[0])
        if any(set(s) != keys for s in states):
            return False
        if not keys:
            # Not stepped yet (or stateless): the flat step creates the state, and
            # _distribute hands it to the parameters.
            bucket.elementwise.clear()
            bucket.scalars.clear()
            bucket.plain.clear()
            return True
        if keys != set(bucket.elementwise) | set(bucket.scalars) | set(bucket.plain):
            bucket.elementwise.clear()
            bucket.scalars.clear()
            bucket.plain.clear()
        for key in keys:
            values = [s[key] for s in states]
            if not self._adopt_key(bucket, key, values, states):
                return False
        if not bucket.scalars_checked:
            for views, _ in bucket.scalars.values():
                if not torch.equal(views, views[0].expand_as(views)):
                    return False
            bucket.scalars_checked = True
        return True

    def _adopt_key(
        self, bucket: _Bucket, key: str, values: list[Any], states: list[dict[str, Any]]
    ) -> bool:
        if key in bucket.elementwise:
            if _views_intact(values, bucket.elementwise[key], bucket.offsets):
                return True
        elif key in bucket.scalars:
            if _views_intact(values, bucket.scalars[key][0], list(range(len(values)))):
                return True
        elif key in bucket.plain:
            value = bucket.plain[key]
            if not any(isinstance(v, torch.Tensor) for v in values):
                if all(v is value or v == value for v in values):
                    return True
            del bucket.plain[key]
        tensors = all(isinstance(v, torch.Tensor) for v in values)
        if not tensors:
            if any(isinstance(v, torch.Tensor) for v in values):
                return False
            first = values[0]
            if not all(v is first or v == first for v in values):
                return False
            bucket.elementwise.pop(key, None)
            bucket.scalars.pop(key, None)
            bucket.plain[key] = first
            return True
        kinds = {(v.dtype, v.device, v.is_sparse) for v in values}
        if len(kinds) != 1 or values[0].is_sparse:
            return False
        if all(v.shape == p.shape for v, p in zip(values, bucket.params)):
            # A fresh buffer: some values may still be views of the old one.
            buffer = torch.cat([v.detach().reshape(-1) for v in values])
            for state, view in zip(states, bucket.slices(buffer)):
                state[key] = view
            bucket.scalars.pop(key, None)
            bucket.elementwise[key] = buffer
            return True
        if all(v.dim() == 0 for v in values):
            views = torch.stack([v.detach() for v in values])
            for i, state in enumerate(states):
                state[key] = views[i]
            bucket.elementwise.pop(key, None)
            bucket.scalars[key] = (views, views[0].clone())
            bucket.scalars_checked = False
            return True
        return False

    def _distribute(self, bucket: _Bucket, flat_state: dict[str, Any]) -> None:
        """Gives each parameter its views of the state that the flat step created."""
        states = [self.optimizer.state[p] for p in bucket.params]
        for key, value in flat_state.items():
            if isinstance(value, torch.Tensor) and value.shape == bucket.flat.shape:
                bucket.elementwise[key] = value
                for state, view in zip(states, bucket.slices(value)):
                    state[key] = view
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                views = value.detach().expand(len(states)).clone()
                bucket.scalars[key] = (views, value)
                for i, state in enumerate(states):
                    state[key] = views[i]
            elif isinstance(value, torch.Tensor):
                raise UnsupportedOptimizerError(
                    f"{type(self.optimizer).__name__} created state {key!r} of shape "
                    f"{list(value.shape)} for a parameter of {bucket.flat.numel()} elements; "
                    "only per-element and scalar state can be fused, use it unfused"
                )
            else:
                bucket.plain[key] = value
                for state in states:
                    state[key] = value
        bucket.scalars_checked = True

    def _unfused(self, bucket: _Bucket) -> None:
        bucket.scalars_checked = False
        bucket.unfused_in_a_row += 1
        self.unfused_steps += 1
        if bucket.unfused_in_a_row == _PERSISTENT:
            warnings.warn(
                f"fuse_optimizer: {len(bucket.params)} parameters of dtype "
                f"{bucket.flat.dtype} were stepped unfused {_PERSISTENT} times in a row: some "
                "have no gradient, or their state differs (e.g. a step count behind after "
                "steps without a gradient). Results are right but not faster; give them a "
                "param group of their own, or zero their gradients instead of setting None",
                stacklevel=4,
            )

    # -- the step --------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            # Gradients must exist before the buffers are checked.
            with torch.enable_grad():
                loss = closure()
        optimizer = self.optimizer
        groups = optimizer.param_groups
        saved_params = [group["params"] for group in groups]
        saved_state = optimizer.state
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        fused: list[_Bucket] = []
        for index, group in enumerate(groups):
            params = group["params"]
            plan = self.groups[index] if index < len(self.groups) else None
            if plan is None or plan[0] != [id(p) for p in params]:
                continue
            stepped: list[torch.Tensor] = []
            for bucket in plan[1]:
                self._adopt_data(bucket)
                if all(p.grad is None for p in bucket.params):
                    stepped.extend(bucket.params)  # the optimizer skips them: nothing to fuse
                elif self._adopt_grads(bucket) and self._adopt_state(bucket):
                    for key, (_, value) in bucket.scalars.items():
                        state[bucket.flat][key] = value
                    state[bucket.flat].update(bucket.plain)
                    state[bucket.flat].update(bucket.elementwise)
                    stepped.append(bucket.flat)
                    fused.append(bucket)
                    bucket.unfused_in_a_row = 0
                else:
                    self._unfused(bucket)
                    stepped.extend(bucket.params)
            stepped.extend(plan[2])
            group["params"] = stepped
        for bucket in fused:
            for views, value in bucket.scalars.values():
                value.copy_(views[0])
        flats = {id(bucket.flat) for bucket in fused}
        for p, p_state in saved_state.items():
            state[p] = p_state
        optimizer.state = state
        try:
            result = self.original_step()
        finally:
            for group, params in zip(groups, saved_params):
                group["params"] = params
            optimizer.state = saved_state
        for p, p_state in state.items():
            # State that the unfused parameters created lazily.
            if p_state and id(p) not in flats and p not in saved_state:
                saved_state[p] = p_state
        for bucket in fused:
            self.fused_steps += 1
            flat_state = state[bucket.flat]
            if not bucket.elementwise and not bucket.scalars and not bucket.plain:
                if flat_state:
                    self._distribute(bucket, flat_state)
                continue
            for key, (views, _) in bucket.scalars.items():
                views.fill_(flat_state[key])
            for key in bucket.plain:
                bucket.plain[key] = flat_state[key]
                for p in bucket.params:
                    saved_state[p][key] = flat_state[key]
        return loss if closure is not None else result


def is_fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` was fused by :func:`fuse_optimizer`."""
    return _ATTRIBUTE in vars(optimizer)


def fuse_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes ``optimizer.step()`` run on a few flat buffers instead of one tensor per parameter.

    For each param group, the parameters of the same dtype and device, their gradients and
    their per-element optimizer state are moved into one contiguous buffer each; the
    parameters stay the same objects (``model.parameters()`` keeps working) and become views
    into the buffer, and autograd accumulates into the gradient buffer. ``step()`` then runs
    the optimizer's own update once per buffer. Results are bit-identical to the unfused
    optimizer, including across ``state_dict()``/``load_state_dict()``.

    Each step checks the buffers and repairs what was replaced: gradients that autograd
    allocated after ``zero_grad(set_to_none=True)`` (the default) are copied into the buffer
    (one copy per bucket; ``zero_grad(set_to_none=False)`` avoids it), state loaded by
    ``load_state_dict()`` and parameters whose ``.data`` was reassigned are re-flattened. A
    bucket that fusing would change is stepped unfused for that step (some but not all of
    its gradients ``None``, per-parameter scalars such as ``step`` that differ), with a
    warning after 3 such steps in a row. State created lazily by a step is created on the
    flat buffers. ``step(closure)`` calls the closure first. Frozen, 0-d, sparse and
    non-contiguous parameters, and parameter groups added later, stay unfused.

    With ``hvd.DistributedOptimizer``, wrap first and fuse the result
    (``fuse_optimizer(hvd.DistributedOptimizer(opt))``): ``DistributedOptimizer`` builds a
    new optimizer from the param groups, so fusing first would be dropped by the wrapping
    (the results stay correct, only unfused). Create LR schedulers after fusing.

    Example:
        >>> opt = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        >>> loss.backward(); opt.step(); opt.zero_grad()

    Args:
        optimizer: a torch optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop,
            Adagrad, Adamax, NAdam, RAdam, ASGD, Rprop, Adadelta or such a custom one).

    Returns:
        The same optimizer object, fused.

    Raises:
        AlreadyFusedError: ``optimizer`` is fused already.
        UnsupportedOptimizerError: a torch optimizer whose update is not elementwise.
    """
    if is_fused_optimizer(optimizer):
        raise AlreadyFusedError(
            "this optimizer is fused already; call fuse_optimizer() once per optimizer"
        )
    for klass in type(optimizer).__mro__:
        if klass.__module__.startswith("torch.optim") and klass.__name__ in _NOT_ELEMENTWISE:
            raise UnsupportedOptimizerError(
                f"{klass.__name__}'s update depends on whole tensors (shapes or norms), so a "
                "fused step would compute something else; use it unfused"
            )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"fuse_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    fusion = _Fusion(optimizer, optimizer.step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vars(optimizer)[_ATTRIBUTE] = fusion
        optimizer.step = types.MethodType(  # type: ignore[method-assign]
            lambda self, closure=None: vars(self)[_ATTRIBUTE].step(closure), optimizer
        )
    return optimizer
