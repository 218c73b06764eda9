"""QAdam: Adam whose first moment is averaged with 8-bit compression after a warmup.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed" (arXiv 2102.02888) observe that Adam's second moment ``v`` settles early
in training; once it is frozen, Adam's update is linear in the first moment ``m``, so ``m``
can be averaged with a compressed collective instead of the gradients (compressing
gradients under a moving ``v`` diverges). Bagua's QAdam compresses ``m`` to 8 bits with
MinMaxUInt8 and keeps no error feedback.

Steps, with ``t`` the optimizer step being taken and ``W = warmup_steps``:

1. **Warmup** (``t <= W``): bucketed full-precision gradient allreduce (average, never
   hierarchical), then an ordinary Adam step: ``m`` and ``v`` are updated with the averaged
   gradient (plus L2 weight decay).
2. **Switch** (after step ``W``): broadcast the weights and the optimizer state (``step``,
   ``exp_avg``, ``exp_avg_sq``) from the process set's first rank.
3. **Compression** (``t > W``), per bucket of first moments (padded to a multiple of the
   ranks), as soon as backward has produced its gradients:

   a. ``m ← β1·m + (1 − β1)·g`` with this rank's raw gradient ``g`` (no weight decay);
   b. average ``m`` over the ranks with ByteGrad's compressed scatter-gather
      (:class:`baguahvd.torch.algorithms.primitives.MinMaxUInt8`; hierarchical:
      full-precision node average, compressed exchange among node leaders, node broadcast).

   The step then applies ``p ← p − lr/(1 − β1^t) · m / (sqrt(v)/sqrt(1 − β2^t) + eps)``
   with the averaged ``m`` and the frozen ``v``; every rank holds the same ``m`` and ``v``,
   so the weights stay identical.

Two deliberate departures from Bagua (spec pitfall 24): Bagua updates the moments only
while ``t < W``, so its ``W``-th step applies a stale ``m`` and discards that step's
gradient; here the first ``W`` steps are complete Adam steps, which also makes
:class:`QAdamOptimizer` and a wrapped ``torch.optim.Adam`` follow the same trajectory. And a
:class:`QAdamOptimizer` stepping without the algorithm (one process) keeps updating ``m``
with its gradient after warmup (step 3a without 3b) instead of freezing it. As in Bagua,
weight decay has no effect after warmup.

A third departure fixes a divergence: elements whose ``v`` froze at exactly zero (no
gradient during all of warmup, e.g. inactive ReLU units) would take steps of ``lr·m/eps``
once their gradient appears; they take ``v`` from the averaged ``m`` instead, once (see
:func:`seed_unset_second_moment`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    GradientAlgorithmImpl,
    bucket_name,
    check_bool,
)
from baguahvd.torch.algorithms.buckets import Bucket
from baguahvd.torch.algorithms.hierarchy import optional_hierarchy
from baguahvd.torch.algorithms.primitives import (
    MinMaxUInt8,
    centralized_reduce,
    check_compressible,
)
from baguahvd.torch.mpi_ops import broadcast_async_, synchronize

DEFAULT_WARMUP_STEPS = 100
"""Warmup of ``algorithm="qadam"`` around a ``torch.optim.Adam`` (QAdamOptimizer's default)."""


def _step_dtype() -> torch.dtype:
    # What torch.optim.Adam stores its step count in, so that state dicts interchange.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def init_state(state: dict[str, Any], p: torch.Tensor) -> None:
    """Adam's state layout: ``step`` (a scalar tensor), ``exp_avg``, ``exp_avg_sq``."""
    state["step"] = torch.tensor(0.0, dtype=_step_dtype())
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def step_count(state: dict[str, Any]) -> int:
    """Steps taken according to ``state`` (0 when empty); ``step`` may be a tensor or int."""
    step = state.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def advance(state: dict[str, Any]) -> float:
    """Increments the state's step count and returns the new value ``t``."""
    step = state["step"]
    if isinstance(step, torch.Tensor):
        step += 1
        return float(step.item())
    state["step"] = step + 1
    return float(step + 1)


def seed_unset_second_moment(state: dict[str, Any], group: dict[str, Any], t: float) -> None:
    """Gives frozen second-moment elements that are still exactly zero a value from ``m``.

    An element whose gradient was zero through all of warmup (a unit that stayed inactive)
    freezes with ``v = 0``; once its gradient appears, Bagua's update divides ``m`` by
    ``eps`` alone and takes a step ~1e8 times too large, which diverges. Such elements take
    ``v = m^2 (1 - β2^t)`` instead (so ``v̂ = m^2`` and the step has Adam's size) the first
    time their ``m`` is nonzero, and stay frozen from then on. ``m`` is the averaged
    momentum, the same on every rank, so ``v`` stays identical across ranks.
    """
    v = state["exp_avg_sq"]
    m = state["exp_avg"]
    unset = (v == 0) & (m != 0)
    if bool(unset.any()):
        beta2 = group["betas"][1]
        v[unset] = m[unset].square() * (1 - beta2**t)


def adam_update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], t: float) -> None:
    """``p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)`` in torch.optim.Adam's
    operation order, so that results match it bit for bit."""
    beta1, beta2 = group["betas"]
    step_size = group["lr"] / (1 - beta1**t)
    bias_correction2_sqrt = (1 - beta2**t) ** 0.5
    denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["eps"])
    p.addcdiv_(state["exp_avg"], denom, value=-step_size)


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with a warmup after which the second moment is frozen (QAdam, arXiv 2102.02888).

    Standalone, for ``t <= warmup_steps`` it is exactly ``torch.optim.Adam`` (L2
    ``weight_decay``); afterwards ``v`` is frozen and ``m`` follows the raw gradient. Under
    :class:`QAdamAlgorithm` the first moment is averaged across ranks with 8-bit compression
    after warmup (see the module docstring). State keys are Adam's.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (>= 0).
        warmup_steps: steps of full Adam and full-precision gradient averaging (> 0).
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty added to the gradient during warmup (>= 0).

    Raises:
        ValueError: a hyperparameter is out of range; the message names it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: lr must be >= 0, got {lr!r}.")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: eps must be >= 0, got {eps!r}.")
        for index in (0, 1):
            if not 0.0 <= betas[index] < 1.0:
                raise ValueError(
                    f"Invalid beta parameter at index {index}: betas[{index}] must be in "
                    f"[0, 1), got {betas[index]!r}."
                )
        if not 0.0 <= weight_decay:
            raise ValueError(
                f"Invalid weight_decay value: weight_decay must be >= 0, got {weight_decay!r}."
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or (
            warmup_steps <= 0
        ):
            raise ValueError(
                f"Invalid warmup_steps: warmup_steps must be an integer > 0, got "
                f"{warmup_steps!r}."
            )
        defaults = dict(
            lr=lr, warmup_steps=warmup_steps, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One QAdam step (without communication); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QAdamOptimizer does not support sparse gradients.")
                state = self.state[p]
                if not state:
                    init_state(state, p)
                t = advance(state)
                grad = p.grad
                if t <= group["warmup_steps"]:
                    if group["weight_decay"] != 0:
                        grad = grad.add(p, alpha=group["weight_decay"])
                    state["exp_avg"].lerp_(grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    state["exp_avg"].lerp_(grad, 1 - beta1)
                    seed_unset_second_moment(state, group, t)
                adam_update(p, state, group, t)
        return loss


class QAdamAlgorithm(Algorithm):
    """Full-precision Adam during warmup, then 8-bit compressed first-moment averaging.

    Works with a :class:`QAdamOptimizer` (its ``warmup_steps``) or an ordinary
    ``torch.optim.Adam`` (its ``lr``, ``betas``, ``eps``, ``weight_decay``, and
    :data:`DEFAULT_WARMUP_STEPS`); ``algorithm="qadam"`` picks these settings up from the
    wrapped optimizer. See the module docstring for the steps.

    Args:
        q_adam_optimizer: the :class:`QAdamOptimizer` being wrapped, for users coming from
            Bagua; its ``warmup_steps`` is used. Optional.
        hierarchical: average ``m`` in full precision inside each node and compress only
            between nodes (Bagua's default: True). Warmup is never hierarchical.

    Raises:
        ValueError: ``q_adam_optimizer`` is not a QAdamOptimizer, or ``hierarchical`` is not
            a bool.
    """

    name = "qadam"

    def __init__(
        self, q_adam_optimizer: QAdamOptimizer | None = None, hierarchical: bool = True
    ) -> None:
        if q_adam_optimizer is not None and not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise ValueError(
                f"q_adam_optimizer must be a QAdamOptimizer or None, got "
                f"{type(q_adam_optimizer).__name__}."
            )
        check_bool("hierarchical", hierarchical)
        self.q_adam_optimizer = q_adam_optimizer
        self.hierarchical = hierarchical

    def warmup_steps_for(self, optimizer: torch.optim.Optimizer) -> int:
        """The warmup length used with ``optimizer`` (see the class docstring)."""
        for source in (self.q_adam_optimizer, optimizer):
            if isinstance(source, QAdamOptimizer):
                return int(source.param_groups[0]["warmup_steps"])
        return DEFAULT_WARMUP_STEPS

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        optimizer = context.optimizer
        kind = type(optimizer).__name__
        if not isinstance(optimizer, (QAdamOptimizer, torch.optim.Adam)):
            raise ValueError(
                f"qadam needs a torch.optim.Adam or a QAdamOptimizer to wrap, got {kind}."
            )
        if isinstance(optimizer, torch.optim.Adam):
            for option in ("amsgrad", "maximize", "decoupled_weight_decay"):
                if any(group.get(option) for group in optimizer.param_groups):
                    raise ValueError(
                        f"qadam implements plain Adam; {option}=True (in {kind}) is not "
                        "supported."
                    )
            if isinstance(optimizer, torch.optim.AdamW):
                raise ValueError("qadam implements Adam with L2 weight decay, not AdamW.")
        check_compressible(self.name, context.parameters, "moments")
        return QAdamImpl(self, context, self.warmup_steps_for(optimizer))


class QAdamImpl(GradientAlgorithmImpl):
    """The hooks of :class:`QAdamAlgorithm`: gradients during warmup, first moments after."""

    algorithm: QAdamAlgorithm
    alignment_by_size = True

    def __init__(
        self, algorithm: QAdamAlgorithm, context: AlgorithmContext, warmup_steps: int
    ) -> None:
        super().__init__(algorithm, context)
        self.warmup_steps = warmup_steps
        self.hierarchy = optional_hierarchy(context.process_set, algorithm.hierarchical)
        self._group_of = {
            id(p): group for group in context.optimizer.param_groups for p in group["params"]
        }
        self.compressing = False
        """Whether the warmup is over (the moments, not the gradients, are communicated)."""
        if self.optimizer_step_id() >= warmup_steps:
            self._switch()

    @property
    def _state(self) -> dict[Any, dict[str, Any]]:
        return self.context.optimizer.state  # type: ignore[return-value]

    def optimizer_step_id(self) -> int:
        """Optimizer steps taken, read from the optimizer state (so checkpoints resume in
        the right stage)."""
        return max((step_count(self._state[p]) for _, p in self.context.parameters
                    if p in self._state), default=0)

    # -- hooks ---------------------------------------------------------------------------

    def pack(self, bucket: Bucket) -> None:
        if bucket is self.buckets[0] and not self.compressing and (
            self.optimizer_step_id() >= self.warmup_steps
        ):
            # A checkpoint past the warmup was loaded after wrapping.
            self._switch()
        if self.compressing:
            self._update_moments(bucket)
        else:
            bucket.gather_grads()

    def communicate(self, bucket: Bucket) -> None:
        if self.compressing:
            centralized_reduce(
                bucket.flat,
                bucket_name(self.algorithm, bucket, "momentum"),
                self.context.process_set,
                self.hierarchy,
                compressor=MinMaxUInt8(),
            )
        else:
            centralized_reduce(
                bucket.flat,
                bucket_name(self.algorithm, bucket, "grad"),
                self.context.process_set,
            )

    def unpack(self, bucket: Bucket) -> None:
        if self.compressing:
            self._scatter_moments(bucket)
        else:
            bucket.scatter_grads()

    def step(self, closure: Any, optimizer_step: Callable[[Any], Any]) -> Any:
        if not self.compressing:
            return optimizer_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for _, p in self.context.parameters:
                state = self._state[p]
                group = self._group_of[id(p)]
                t = advance(state)
                seed_unset_second_moment(state, group, t)
                adam_update(p, state, group, t)
        return loss

    def post_step(self) -> None:
        super().post_step()
        if not self.compressing and self.optimizer_step_id() >= self.warmup_steps:
            self._switch()

    # -- internals -----------------------------------------------------------------------

    def _update_moments(self, bucket: Bucket) -> None:
        """Step 3a for the bucket's parameters, then copies the moments into ``flat``."""
        offset = 0
        for p in bucket.params:
            count = p.numel()
            m = self._state[p]["exp_avg"]
            beta1 = self._group_of[id(p)]["betas"][0]
            if p.grad is None:
                m.mul_(beta1)
            else:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                m.lerp_(grad, 1 - beta1)
            bucket.flat[offset : offset + count].copy_(m.reshape(-1))
            offset += count

    def _scatter_moments(self, bucket: Bucket) -> None:
        offset = 0
        for p in bucket.params:
            count = p.numel()
            m = self._state[p]["exp_avg"]
            m.copy_(bucket.flat[offset : offset + count].view_as(m))
            offset += count

    def _switch(self) -> None:
        """Step 2: every rank continues from the first rank's weights and state."""
        process_set = self.context.process_set
        assert process_set.ranks is not None
        root = min(process_set.ranks)
        for _, p in self.context.parameters:
            state = self._state[p]
            if not state:
                init_state(state, p)
        steps = torch.tensor(
            [step_count(self._state[p]) for _, p in self.context.parameters],
            dtype=torch.float64,
        )
        handles = [broadcast_async_(steps, root, name="bagua.qadam.switch.steps",
                                    process_set=process_set)]
        for name, p in self.context.parameters:
            state = self._state[p]
            for key, tensor in (("weight", p.data), ("exp_avg", state["exp_avg"]),
                                ("exp_avg_sq", state["exp_avg_sq"])):
                handles.append(
                    broadcast_async_(tensor, root, name=f"bagua.qadam.switch.{name}.{key}",
                                     process_set=process_set)
                )
        for handle in handles:
            synchronize(handle)
        for (_, p), value in zip(self.context.parameters, steps.tolist()):
            state = self._state[p]
            if isinstance(state["step"], torch.Tensor):
                state["step"].fill_(value)
            else:
                state["step"] = int(value)
        self.compressing = True
