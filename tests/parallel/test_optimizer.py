"""DistributedOptimizer against single-process training.

Every rank builds the same model and the data of every rank from fixed seeds. The oracle is
a plain torch optimizer on one process whose gradient is the mean over ranks of each rank's
gradient (what ``op=Average`` promises), computed by running every rank's loss locally.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import baguahvd.torch as hvd

TOO_MANY = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
ZERO_GRAD = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
STEP_AFTER_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize()."
)
ROWS = 4  # rows of data per rank and step

Loss = Callable[[nn.Module, int, int], torch.Tensor]  # (model, rank, step) -> loss
MakeOptimizer = Callable[[Any], torch.optim.Optimizer]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def data(rank: int, step: int, width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(ROWS, width, generator=generator, dtype=torch.float64)
    y = torch.randn(ROWS, 3, generator=generator, dtype=torch.float64)
    return x, y


def mse(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = data(rank, step)
    return nn.functional.mse_loss(model(x), y)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def reference_backward(model: nn.Module, loss: Loss, size: int, step: int) -> None:
    """Accumulates the mean over ranks of every rank's gradient into ``model``."""
    for r in range(size):
        (loss(model, r, step) / size).backward()


def step_both(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ref: nn.Module,
    ref_optimizer: torch.optim.Optimizer,
    loss: Loss,
    rank: int,
    size: int,
    step: int,
    oracle: Loss | None = None,
) -> None:
    """One step of ``model`` on this rank's batch and of its single-process oracle on every
    rank's (``oracle``: the oracle's loss, where it is not ``loss``)."""
    optimizer.zero_grad()
    loss(model, rank, step).backward()
    optimizer.step()
    ref_optimizer.zero_grad()
    reference_backward(ref, loss if oracle is None else oracle, size, step)
    ref_optimizer.step()


def train_both(
    rank: int,
    size: int,
    loss: Loss = mse,
    make_optimizer: MakeOptimizer = sgd,
    steps: int = 3,
    build: Callable[[], nn.Module] = mlp,
    **kwargs: Any,
) -> tuple[nn.Module, nn.Module]:
    """Trains a model with DistributedOptimizer and its single-process oracle."""
    model, ref = build(), build()
    optimizer = hvd.DistributedOptimizer(
        make_optimizer(model.parameters()), named_parameters=model.named_parameters(), **kwargs
    )
    ref_optimizer = make_optimizer(ref.parameters())
    for step in range(steps):
        step_both(model, optimizer, ref, ref_optimizer, loss, rank, size, step)
    return model, ref


def with_buckets(monkeypatch: pytest.MonkeyPatch, buckets: bool) -> None:
    """Optimizers built from now on in this test use gradient buckets or not
    (BAGUAHVD_GRADIENT_BUCKETS, which init() has read)."""
    from baguahvd.runtime.runtime import runtime

    assert runtime.config is not None
    monkeypatch.setattr(runtime, "config",
                        dataclasses.replace(runtime.config, gradient_buckets=buckets))


def assert_same_parameters(model: nn.Module, ref: nn.Module, tol: float = 1e-10) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------
# Construction


@pytest.mark.parametrize("make_optimizer", [sgd, adam])
def test_is_a_subclass_with_the_same_name(make_optimizer: MakeOptimizer) -> None:
    model = mlp()
    inner = make_optimizer(model.parameters())
    optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    assert isinstance(optimizer, type(inner))
    assert type(optimizer).__name__ == type(inner).__name__
    assert optimizer is not inner
    assert optimizer.param_groups[0]["lr"] == inner.param_groups[0]["lr"]
    assert optimizer.backward_passes_per_step == 1
    assert optimizer.op == hvd.Average


def test_parameter_names() -> None:
    model = mlp()
    named = hvd.DistributedOptimizer(sgd(model.parameters()),
                                     named_parameters=(x for x in model.named_parameters()))
    assert set(named._parameter_names.values()) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert named._parameter_names[p] == name
    unnamed = hvd.DistributedOptimizer(sgd(model.parameters()))
    assert sorted(unnamed._parameter_names.values()) == [
        f"allreduce.noname.0.{j}" for j in range(4)
    ]


def test_named_parameters_errors() -> None:
    model = mlp()
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match=re.escape(
        "named_parameters should be a sequence of tuples (name, parameter), usually produced "
        "by model.named_parameters()."
    )):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=[p for _, p in params])
    duplicated = [("a", params[0][1]), ("a", params[1][1]), ("b", params[2][1]),
                  ("b", params[3][1])]
    with pytest.raises(ValueError, match=re.escape(
        "Parameter names in named_parameters must be unique. Found duplicates: a, b"
    )):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=duplicated)
    with pytest.raises(ValueError, match=re.escape(
        "named_parameters was specified, but one or more model parameters were not named. "
        "Python object ids: " + str(id(params[3][1]))
    )):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=params[:3])


def test_argument_errors() -> None:
    model = mlp()
    with pytest.raises(ValueError, match=r"^backward_passes_per_step must be > 0$"):
        hvd.DistributedOptimizer(sgd(model.parameters()), backward_passes_per_step=0)
    with pytest.raises(ValueError,
                       match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups should be a non-negative integer"):
        hvd.DistributedOptimizer(sgd(model.parameters()), groups=-1)
    with pytest.raises(ValueError, match="groups must consist of torch.Tensor."):
        hvd.DistributedOptimizer(sgd(model.parameters()), groups=[["weight"]])
    first = next(model.parameters())
    with pytest.raises(ValueError, match="A parameter can only appear once in groups."):
        hvd.DistributedOptimizer(sgd(model.parameters()), groups=[[first], [first]])


def test_algorithm_argument() -> None:
    model = mlp()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        algorithm="gradient_allreduce",
    )
    assert isinstance(optimizer, torch.optim.SGD)
    with pytest.raises(ValueError, match="gradient_allreduce") as info:
        hvd.DistributedOptimizer(sgd(model.parameters()), algorithm="no_such_algorithm")
    assert "no_such_algorithm" in str(info.value)


def test_num_groups_is_deprecated(rank: int, size: int) -> None:
    model = mlp()
    with pytest.warns(DeprecationWarning, match="num_groups"):
        optimizer = hvd.DistributedOptimizer(sgd(model.parameters()), num_groups=2,
                                             named_parameters=model.named_parameters())
    if size > 1:
        assert len(optimizer._groups) == 2


# ---------------------------------------------------------------------------------------
# Training equals the single-process oracle


@pytest.mark.parametrize("make_optimizer", [sgd, adam], ids=["sgd_momentum", "adam"])
def test_matches_single_process(rank: int, size: int, make_optimizer: MakeOptimizer) -> None:
    model, ref = train_both(rank, size, make_optimizer=make_optimizer)
    assert_same_parameters(model, ref)


def test_full_batch_equivalence(rank: int, size: int) -> None:
    """With equal shards, averaging per-rank mean losses is full-batch training."""
    model = mlp()
    ref = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    ref_optimizer = sgd(ref.parameters())
    for step in range(3):
        batches = [data(r, step) for r in range(size)]
        full_x = torch.cat([b[0] for b in batches])
        full_y = torch.cat([b[1] for b in batches])
        ref_optimizer.zero_grad()
        nn.functional.mse_loss(ref(full_x), full_y).backward()
        ref_optimizer.step()
        optimizer.zero_grad()
        mse(model, rank, step).backward()
        optimizer.step()
    assert_same_parameters(model, ref)


@pytest.mark.parametrize(
    "groups", [2, "lists", "one_list"], ids=["groups=2", "groups=[[...],[...]]", "partial"]
)
def test_groups_equal_ungrouped(rank: int, size: int, groups: Any) -> None:
    def build() -> nn.Module:
        return mlp()

    def grouped(model: nn.Module) -> Any:
        params = list(model.parameters())
        if groups == "lists":
            return [params[:2], params[2:]]
        if groups == "one_list":
            return [[params[0], params[3]]]  # the others stay single
        return groups

    model, ref = build(), build()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        groups=grouped(model),
    )
    ref_optimizer = sgd(ref.parameters())
    for step in range(3):
        step_both(model, optimizer, ref, ref_optimizer, mse, rank, size, step)
    assert_same_parameters(model, ref)


def test_groups_follow_rank_zero_order(rank: int, size: int) -> None:
    """Ranks listing their parameters in different orders still form the same groups."""
    model, ref = mlp(), mlp()
    named = list(model.named_parameters())
    if rank % 2:
        named.reverse()
    optimizer = hvd.DistributedOptimizer(
        sgd([p for _, p in named]), named_parameters=named, groups=3,
    )
    order = [optimizer._parameter_names[p] for group in optimizer._groups for p in group]
    assert order == hvd.broadcast_object(order, 0, name="test_opt.group_order")
    ref_optimizer = sgd(ref.parameters())
    for step in range(2):
        step_both(model, optimizer, ref, ref_optimizer, mse, rank, size, step)
    assert_same_parameters(model, ref)


@pytest.mark.parametrize("op", ["Average", "Sum"])
@pytest.mark.parametrize("groups", [None, 2], ids=["ungrouped", "groups=2"])
def test_backward_passes_per_step(rank: int, size: int, groups: Any, op: str) -> None:
    """Two local backward passes are summed, then reduced across ranks once per step."""
    scale = size if op == "Sum" else 1

    def scaled(model: nn.Module, r: int, step: int) -> torch.Tensor:
        return mse(model, r, step) * scale

    model, ref = mlp(), mlp()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        backward_passes_per_step=2, groups=groups, op=getattr(hvd, op),
    )
    ref_optimizer = sgd(ref.parameters())
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(2):
            mse(model, rank, 10 * step + micro).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        for micro in range(2):
            reference_backward(ref, scaled, size, 10 * step + micro)
        ref_optimizer.step()
    assert_same_parameters(model, ref)


@pytest.mark.parametrize("buckets", [False, True], ids=["per_tensor", "buckets"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("groups", [None, 2], ids=["ungrouped", "groups=2"])
def test_each_gradient_is_reduced_once(
    rank: int, size: int, groups: Any, passes: int, buckets: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from baguahvd.torch import buckets as bucket_module
    from baguahvd.torch import optimizer as module

    calls = {"single": 0, "grouped": 0, "bucket": 0}

    def counting(kind: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[kind] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(module, "allreduce_async_", counting("single", module.allreduce_async_))
    monkeypatch.setattr(module, "grouped_allreduce_async_",
                        counting("grouped", module.grouped_allreduce_async_))
    monkeypatch.setattr(bucket_module, "bucket_allreduce_async_",
                        counting("bucket", bucket_module.bucket_allreduce_async_))
    with_buckets(monkeypatch, buckets)
    model = mlp()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        backward_passes_per_step=passes, groups=groups,
    )
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(passes):
            mse(model, rank, 10 * step + micro).backward()
        optimizer.step()
    # The first step reduces gradients one by one (or by group) while it records their
    # order; the next ones in buckets: one of all four gradients, or one per group.
    if size == 1:
        assert calls == {"single": 0, "grouped": 0, "bucket": 0}
    elif groups is None:
        assert calls == ({"single": 4, "grouped": 0, "bucket": 2} if buckets
                         else {"single": 3 * 4, "grouped": 0, "bucket": 0})
    else:
        assert calls == ({"single": 0, "grouped": 2, "bucket": 2 * 2} if buckets
                         else {"single": 0, "grouped": 3 * 2, "bucket": 0})


def test_set_backward_passes_per_step(rank: int, size: int) -> None:
    model, ref = mlp(), mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    optimizer.set_backward_passes_per_step(3)
    assert optimizer.backward_passes_per_step == 3
    ref_optimizer = sgd(ref.parameters())
    optimizer.zero_grad()
    ref_optimizer.zero_grad()
    for micro in range(3):
        mse(model, rank, micro).backward()
        reference_backward(ref, mse, size, micro)
    optimizer.step()
    ref_optimizer.step()
    assert_same_parameters(model, ref)


def test_too_many_backward_passes(rank: int, size: int) -> None:
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2)
    mse(model, rank, 0).backward()
    mse(model, rank, 1).backward()
    if size > 1:
        with pytest.raises(AssertionError, match=re.escape(TOO_MANY)):
            mse(model, rank, 2).backward()
    # The allreduces started by the second pass still complete, and training goes on.
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        optimizer.step()
    optimizer.zero_grad()
    mse(model, rank, 3).backward()
    optimizer.step()


@pytest.mark.parametrize("buckets", [False, True], ids=["per_tensor", "buckets"])
@pytest.mark.parametrize("passes", [1, 2])
def test_zero_grad_before_step_is_refused(
    rank: int, size: int, passes: int, buckets: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused while allreduces are in flight, and (as in Horovod) while gradients are
    half accumulated. Bucketed gradients are dropped too (backward brings their views
    back)."""
    with_buckets(monkeypatch, buckets)
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes)
    mse(model, rank, 0).backward()
    if size > 1:
        with pytest.raises(AssertionError, match=re.escape(ZERO_GRAD)):
            optimizer.zero_grad()
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kind", ["per_tensor", "buckets", "groups", "gradient_allreduce"])
@pytest.mark.parametrize("name", ["SGD", "LBFGS"])
def test_gradients_a_closure_computes_are_reduced(
    monkeypatch: pytest.MonkeyPatch, rank: int, size: int, kind: str, name: str
) -> None:
    """``step(closure)``: the gradients of the closure's backward pass are reduced before
    the wrapped optimizer reads them, after every call (LBFGS makes several a step), so the
    weights follow the single-process oracle's. (Horovod 0.28.1 synchronizes before the
    step only: each rank stepped on its own gradients and the ranks' weights parted.)"""
    with_buckets(monkeypatch, kind == "buckets")
    model, ref = mlp(), mlp()

    def make(params: Any) -> torch.optim.Optimizer:
        if name == "LBFGS":
            return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=3)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    options: dict[str, Any] = {"groups": 1} if kind == "groups" else {}
    if kind == "gradient_allreduce":
        options["algorithm"] = kind
    optimizer = hvd.DistributedOptimizer(make(model.parameters()),
                                         named_parameters=model.named_parameters(), **options)
    ref_optimizer = make(ref.parameters())
    for step in range(3):

        def closure(step: int = step) -> torch.Tensor:
            optimizer.zero_grad()
            loss = mse(model, rank, step)
            loss.backward()
            # LBFGS decides on the loss: every rank must see the same one.
            return hvd.allreduce(loss.detach(), name="test.closure.loss")

        def oracle(step: int = step) -> torch.Tensor:
            ref_optimizer.zero_grad()
            reference_backward(ref, mse, size, step)
            with torch.no_grad():
                return sum(mse(ref, r, step) for r in range(size)) / size

        loss = optimizer.step(closure)
        expected = ref_optimizer.step(oracle)
        torch.testing.assert_close(loss, expected, atol=1e-10, rtol=1e-10)
    assert_same_parameters(model, ref)


def test_synchronize_then_clip(rank: int, size: int) -> None:
    """Horovod's gradient-clipping pattern: synchronize, clip, step without synchronizing."""
    model, ref = mlp(), mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    ref_optimizer = sgd(ref.parameters())
    for step in range(3):
        optimizer.zero_grad()
        mse(model, rank, step).backward()
        optimizer.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with optimizer.skip_synchronize():
                optimizer.step()
        ref_optimizer.zero_grad()
        reference_backward(ref, mse, size, step)
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_optimizer.step()
    assert_same_parameters(model, ref)


def test_step_after_synchronize_warns_once(rank: int, size: int) -> None:
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    mse(model, rank, 0).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    relevant = [w for w in caught if issubclass(w.category, UserWarning)]
    assert len(relevant) == 1
    assert STEP_AFTER_SYNC in str(relevant[0].message)
    # The next ordinary step does not warn.
    optimizer.zero_grad()
    mse(model, rank, 1).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()


# ---------------------------------------------------------------------------------------
# Parameters used by only some ranks


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(4, 4)
        self.left = nn.Linear(4, 3)
        self.right = nn.Linear(4, 3)
        self.double()

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return getattr(self, branch)(torch.tanh(self.trunk(x)))


def branch_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    # Even ranks use one branch, odd ranks the other, swapping every step; with one rank
    # both branches are used so that no parameter is left without a gradient everywhere.
    x, y = data(rank, step)
    branches = ["left", "right"] if (rank + step) % 2 == 0 else ["right", "left"]
    used = branches[:1] if hvd.size() > 1 else branches
    return sum(nn.functional.mse_loss(model(x, b), y) for b in used)  # type: ignore[return-value]


@pytest.mark.parametrize("groups", [None, 2, "lists"], ids=["ungrouped", "groups=2", "lists"])
def test_parameters_unused_on_some_ranks(rank: int, size: int, groups: Any) -> None:
    model, ref = TwoBranches(), TwoBranches()
    if groups == "lists":
        groups = [[model.left.weight, model.right.weight], [model.left.bias, model.right.bias]]
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        groups=groups,
    )
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        step_both(model, optimizer, ref, ref_optimizer, branch_loss, rank, size, step)
    assert_same_parameters(model, ref)


def test_frozen_parameter_is_skipped(rank: int, size: int) -> None:
    model, ref = mlp(), mlp()
    for m in (model, ref):
        m[0].bias.requires_grad_(False)
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    ref_optimizer = sgd(ref.parameters())
    for step in range(2):
        step_both(model, optimizer, ref, ref_optimizer, mse, rank, size, step)
    assert model[0].bias.grad is None
    assert_same_parameters(model, ref)


# ---------------------------------------------------------------------------------------
# Reduction options


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compression_is_close(rank: int, size: int, name: str) -> None:
    compression = getattr(hvd.Compression, name)
    model, ref = train_both(rank, size, compression=compression)
    tol = 2e-3 if name == "fp16" else 2e-2
    assert_same_parameters(model, ref, tol=tol)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_gradient_predivide_factor(rank: int, size: int) -> None:
    model, ref = train_both(rank, size, gradient_predivide_factor=2.0)
    assert_same_parameters(model, ref)


def test_op_sum(rank: int, size: int) -> None:
    def summed(model: nn.Module, r: int, step: int) -> torch.Tensor:
        return mse(model, r, step) * size  # the oracle's mean over ranks times size

    model, ref = mlp(), mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(), op=hvd.Sum)
    ref_optimizer = sgd(ref.parameters())
    for step in range(3):
        step_both(model, optimizer, ref, ref_optimizer, mse, rank, size, step, oracle=summed)
    assert_same_parameters(model, ref)


# ---------------------------------------------------------------------------------------
# Sparse gradients


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.embedding = nn.Embedding(12, 3, sparse=True).double()
        self.head = nn.Linear(3, 1).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).squeeze(-1)


def bag_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + 10 * step + rank)
    ids = torch.randint(0, 12, (ROWS,), generator=generator)  # repeats are likely
    target = torch.randn(ROWS, generator=generator, dtype=torch.float64)
    return nn.functional.mse_loss(model(ids), target)


def sparse_adam(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.05),
            torch.optim.SGD(model.head.parameters(), lr=0.1)]


def sparse_sgd(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.1)]


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["sparse", "as_dense"])
@pytest.mark.parametrize("make", [sparse_adam, sparse_sgd], ids=["SparseAdam", "SGD"])
def test_sparse_gradients(rank: int, size: int, make: Any, sparse_as_dense: bool) -> None:
    model, ref = Bag(), Bag()
    named = dict(model.named_parameters())
    optimizers = [
        hvd.DistributedOptimizer(
            inner,
            named_parameters=[(n, p) for n, p in named.items()
                              if any(p is q for q in inner.param_groups[0]["params"])],
            sparse_as_dense=sparse_as_dense,
        )
        for inner in make(model)
    ]
    ref_optimizers = make(ref)
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        bag_loss(model, rank, step).backward()
        assert model.embedding.weight.grad is not None
        for optimizer in optimizers:
            optimizer.step()
        assert model.embedding.weight.grad.is_sparse
        for optimizer in ref_optimizers:
            optimizer.zero_grad()
        reference_backward(ref, bag_loss, size, step)
        for optimizer in ref_optimizers:
            optimizer.step()
    assert_same_parameters(model, ref)


# ---------------------------------------------------------------------------------------
# broadcast_optimizer_state


def snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(optimizer.state_dict())


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert actual["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(actual["state"][index][key], value, rtol=0, atol=0)
            else:
                assert actual["state"][index][key] == value


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_broadcast_optimizer_state(rank: int, size: int, distributed: bool) -> None:
    model = mlp()
    inner = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.8, 0.95))
    if rank == 0:
        # Only the root has stepped (locally), so the others have no state at all.
        for step in range(2):
            inner.zero_grad()
            mse(model, 0, step).backward()
            inner.step()
    before = snapshot(inner)
    optimizer = inner
    if distributed:
        optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        optimizer.load_state_dict(before)
    root_state = hvd.broadcast_object(before if rank == 0 else None, 0, name="test_bos.root")
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    after = snapshot(optimizer)
    assert_same_state(after, root_state)
    if rank == 0:
        assert_same_state(after, before)
    assert isinstance(optimizer.param_groups[0]["betas"], tuple)
    assert optimizer.param_groups[0]["lr"] == 0.01
    for p in model.parameters():
        assert float(optimizer.state[p]["step"]) == 2.0


def test_broadcast_optimizer_state_before_any_step(rank: int, size: int) -> None:
    model = mlp()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Horovod's state-creating step with zero gradients: momentum buffers of zeros, no
    # parameter moved (no weight decay), zero gradients left behind.
    assert len(optimizer.state) == len(before)
    for p, old in zip(model.parameters(), before):
        assert torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p))
        assert torch.equal(p, old)
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_replacing_the_optimizer(rank: int, size: int) -> None:
    """A new DistributedOptimizer on the same model replaces the old one's hooks once the
    old one is dropped (e.g. a new phase of training with other hyperparameters)."""
    model, ref = mlp(), mlp()
    ref_optimizer = sgd(ref.parameters())
    for phase in range(2):
        optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                             named_parameters=model.named_parameters())
        ref_optimizer = sgd(ref.parameters())
        for step in range(2):
            step_both(model, optimizer, ref, ref_optimizer, mse, rank, size, 10 * phase + step)
        alive = weakref.ref(optimizer)
        del optimizer
        gc.collect()
        assert alive() is None, "the parameters' hooks keep the old optimizer alive"
    assert_same_parameters(model, ref)


@pytest.mark.parametrize("kind", ["adasum", "gradient_allreduce", "bytegrad", "async"])
def test_a_later_optimizer_of_any_kind_takes_the_parameters_over(
    rank: int, size: int, kind: str
) -> None:
    """Adasum and the Bagua algorithms, as the default path: a second DistributedOptimizer
    over the same model, the first still alive, trains without the first reducing the
    gradients again under the same names (DuplicateNameError before); the first one's
    algorithm is stopped. With a synchronous algorithm every rank ends with the same
    weights."""
    if kind == "adasum" and size & (size - 1):
        pytest.skip("Adasum runs on a power-of-two number of ranks")
    model = mlp().float()  # bytegrad compresses float32 gradients

    def wrap() -> torch.optim.Optimizer:
        if kind == "adasum":
            return hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Adasum,
                                            named_parameters=model.named_parameters())
        return hvd.DistributedOptimizer(sgd(model.parameters()), algorithm=kind,
                                        named_parameters=model.named_parameters())

    kept = []
    for phase in range(2):
        kept.append(wrap())
        for step in range(3):
            kept[-1].zero_grad()
            x, y = data(rank, 10 * phase + step)
            nn.functional.mse_loss(model(x.float()), y.float()).backward()
            kept[-1].step()
    if kind != "adasum":
        assert kept[0].algorithm_impl is None  # type: ignore[attr-defined]
        kept[1].close()  # type: ignore[attr-defined]
    if kind != "async":
        weights = [p.detach().clone() for p in model.parameters()]
        for theirs in hvd.allgather_object(weights, name="test.replaced.weights"):
            for mine, their in zip(weights, theirs):
                torch.testing.assert_close(mine, their, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["bytegrad", "decentralized", "async"])
def test_a_dropped_algorithm_optimizer_is_closed(rank: int, size: int, kind: str) -> None:
    """An algorithm optimizer that the user drops without ``close()`` is collected, and its
    algorithm closed: its threads end, the async one's averaging with the other ranks
    included. (Each dropped one left its threads running before, and the async one went
    on averaging the dropped model with the other ranks.)"""
    from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm

    # The threads themselves: an ident can be reused once a thread has ended, and an
    # earlier test's algorithm thread may be ending now.
    before = set(threading.enumerate())
    model = mlp().float()  # bytegrad compresses float32 gradients
    algorithm: Any = AsyncModelAverageAlgorithm(sync_interval_ms=5) if kind == "async" else kind
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()), algorithm=algorithm,
                                         named_parameters=model.named_parameters())
    # A scheduler patches the optimizer's step: a reference cycle, which the cyclic
    # collector frees (on whichever thread triggers it).
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    for step in range(3):
        optimizer.zero_grad()
        x, y = data(rank, step)
        nn.functional.mse_loss(model(x.float()), y.float()).backward()
        optimizer.step()
        scheduler.step()
    started = [t for t in threading.enumerate() if t not in before]
    assert started, "the algorithm runs no thread of its own"
    dropped = weakref.ref(optimizer)
    del optimizer, scheduler
    gc.collect()
    assert dropped() is None
    for thread in started:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name


@pytest.mark.parametrize("buckets", [True, False, "groups"])
@pytest.mark.parametrize("change", ["unfreeze", "add_param_group", "freeze"])
def test_changing_which_parameters_train(
    monkeypatch: pytest.MonkeyPatch, rank: int, size: int, change: str, buckets: Any
) -> None:
    """A parameter unfrozen (``requires_grad_()``) or added by ``add_param_group`` after
    DistributedOptimizer was built is reduced from that step on, and one frozen since keeps
    no gradient, so weight decay and momentum leave it alone (also inside a bucket or a
    user's group): as the single-process oracle does. (Horovod 0.28.1 leaves the first two
    unreduced: the ranks train apart.)"""
    with_buckets(monkeypatch, buckets is True)
    model, ref = mlp(), mlp()
    grouping: dict[str, Any] = {}
    if buckets == "groups":  # the first layer's weight and bias as one unit
        grouping["groups"] = [list(model[0].parameters())] if change == "freeze" else 1

    def make(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)

    for m in (model, ref):
        m[0].weight.requires_grad_(change != "unfreeze")
    first = (lambda m: m.parameters()) if change != "add_param_group" else (
        lambda m: m[2].parameters())
    optimizer = hvd.DistributedOptimizer(make(first(model)),
                                         named_parameters=list(model.named_parameters()),
                                         **grouping)
    ref_optimizer = make(first(ref))
    for step in range(6):
        if step == 3:
            for m, opt in ((model, optimizer), (ref, ref_optimizer)):
                if change == "add_param_group":
                    opt.add_param_group({"params": list(m[0].parameters())})
                else:
                    m[0].weight.requires_grad_(change == "unfreeze")
        step_both(model, optimizer, ref, ref_optimizer, mse, rank, size, step)
    assert_same_parameters(model, ref)
    if change == "freeze":
        assert model[0].weight.grad is None


@pytest.mark.parametrize("kind", ["adasum", "gradient_allreduce"])
@pytest.mark.parametrize("change", ["unfreeze", "add_param_group"])
def test_an_algorithm_refuses_parameters_it_does_not_reduce(
    rank: int, size: int, kind: str, change: str
) -> None:
    """Adasum and the Bagua algorithms reduce what trained when they were built: a
    parameter unfrozen or added since raises a named error on every rank at the next step
    instead of staying local to each rank."""
    if kind == "adasum" and size & (size - 1):
        pytest.skip("Adasum runs on a power-of-two number of ranks")
    model = mlp()
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    params = model.parameters() if change == "unfreeze" else model[2].parameters()
    extra: dict[str, Any] = {"op": hvd.Adasum} if kind == "adasum" else {"algorithm": kind}
    optimizer = hvd.DistributedOptimizer(sgd(params), named_parameters=model.named_parameters()
                                         if change == "unfreeze" else model[2].named_parameters(),
                                         **extra)
    optimizer.zero_grad()
    mse(model, rank, 0).backward()
    optimizer.step()
    if change == "unfreeze":
        model[0].weight.requires_grad_(True)
        named = "0.weight"
    else:
        optimizer.add_param_group({"params": list(model[0].parameters())})
        named = "a parameter added by add_param_group"
    optimizer.zero_grad()
    mse(model, rank, 1).backward()
    with pytest.raises(ValueError, match=re.escape(named) + ": trains now"):
        optimizer.step()
    if kind != "adasum":
        optimizer.close()  # type: ignore[attr-defined]


def test_a_wrapped_model_pickles_and_copies_as_torch_does(rank: int, size: int) -> None:
    """``torch.save(model)`` and ``copy.deepcopy(model)`` work after DistributedOptimizer
    has wrapped the model's parameters (as with Horovod, which keeps its hooks out of the
    parameters): the copy is a plain model with the same weights."""
    model, _ = train_both(rank, size)
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    for copied in (loaded, copy.deepcopy(model)):
        assert_same_parameters(copied, model)
        assert all(vars(p) == {} for p in copied.parameters())


@pytest.mark.parametrize("algorithm", [None, "gradient_allreduce"])
def test_a_further_subclass_of_the_built_class_still_steps(
    rank: int, size: int, algorithm: str | None
) -> None:
    """Wrappers (Lightning's) subclass the class DistributedOptimizer builds; its methods
    must reach the user's optimizer without recursing into themselves."""
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         algorithm=algorithm)

    class Wrapped(optimizer.__class__):  # type: ignore[name-defined,misc]
        pass

    optimizer.__class__ = Wrapped
    for step in range(2):
        optimizer.zero_grad()
        mse(model, rank, step).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for row in hvd.allgather(flat.unsqueeze(0), name=f"further_subclass.{algorithm}"):
        assert torch.equal(row, flat)
