"""DistributedOptimizer's gradient buckets against its per-tensor path.

Each test trains the same model twice from the same seeds, once with buckets
(``BAGUAHVD_GRADIENT_BUCKETS=1``, the default) and once without, and requires the same
parameters and gradients bit for bit: a bucket sums each gradient elementwise exactly as
the per-tensor request does. The first step of the bucketed run records the order of the
gradients and builds the buckets, so every test runs several steps.

One exception: gloo's ring allreduce over three ranks or more adds each element's
contributions in an order that depends on where the element falls in the buffer, so a
gradient reduced inside a bucket is rounded differently from the same gradient reduced
alone (Horovod's fusion buffer on gloo does the same). There the results must agree to
float32 rounding instead.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import baguahvd.torch as hvd
from baguahvd.runtime.runtime import runtime
from tests.support.gpus import rank_gpu

STEPS = 4
ROWS = 4

Loss = Callable[[nn.Module, int, int], torch.Tensor]


def hooked() -> bool:
    """Whether DistributedOptimizer reduces at all: with more than one rank, or in elastic
    mode (which lets one GPU run these tests as a job of one rank)."""
    return hvd.size() > 1 or bool(runtime.config is not None and runtime.config.elastic)


def use_buckets(monkeypatch: pytest.MonkeyPatch, buckets: bool) -> None:
    """Optimizers built from now on use buckets or not (the setting init() has read)."""
    assert runtime.config is not None
    monkeypatch.setattr(runtime, "config",
                        dataclasses.replace(runtime.config, gradient_buckets=buckets))


def set_threshold(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    engine = runtime.require_engine()
    settings = engine.settings._replace(fusion_threshold=threshold)
    monkeypatch.setattr(type(engine), "settings", property(lambda _: settings))


class Mixed(nn.Module):
    """Parameters of two dtypes, one channels_last convolution (reduced alone), a frozen
    one, and a layer whose output only some steps use."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.conv = nn.Conv2d(2, 3, 3, padding=1).to(memory_format=torch.channels_last)
        self.norm = nn.LayerNorm(3 * 4 * 4)
        self.head = nn.Linear(3 * 4 * 4, 5).double()
        self.extra = nn.Linear(5, 5).double()
        self.frozen = nn.Linear(5, 5).double().requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.norm(torch.tanh(self.conv(x)).flatten(1)).double()
        out = self.frozen(self.head(h))
        return self.extra(out) if step % 2 else out


def mixed_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 2, 4, 4, generator=generator).to(memory_format=torch.channels_last)
    y = torch.randn(ROWS, 5, generator=generator, dtype=torch.float64)
    return nn.functional.mse_loss(model(x, step), y)


class Many(nn.Module):
    """Many small parameters, so that a small threshold makes many buckets."""

    def __init__(self, layers: int = 12) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(layers))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def many_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 6, generator=generator)
    return (model(x, step) ** 2).mean()


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.embedding = nn.Embedding(12, 3, sparse=True).double()
        self.head = nn.Linear(3, 1).double()

    def forward(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        return self.head(self.embedding(ids)).squeeze(-1)


def bag_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + 10 * step + rank)
    ids = torch.randint(0, 12, (ROWS,), generator=generator)
    target = torch.randn(ROWS, generator=generator, dtype=torch.float64)
    return nn.functional.mse_loss(model(ids, step), target)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(
    monkeypatch: pytest.MonkeyPatch,
    buckets: bool,
    rank: int,
    build: Callable[[], nn.Module] = Mixed,
    loss: Loss = mixed_loss,
    passes: int = 1,
    zero: str = "optimizer",
    clip: bool = False,
    groups: Callable[[nn.Module], Any] | None = None,
    meddle: str = "",
    **kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Trains ``build()`` for STEPS steps; ``zero`` says how gradients are cleared:
    ``optimizer`` (set_to_none), ``optimizer_in_place``, ``model`` (set_to_none on the
    module, behind the optimizer's back) or ``replace`` (new zero tensors assigned).
    ``meddle``: ``regrad`` replaces every gradient by a copy between backward and step;
    ``new_engine`` makes the buckets find another engine in the third step, as after an
    elastic reset."""
    use_buckets(monkeypatch, buckets)
    model = build()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        groups=None if groups is None else groups(model), **kwargs,
    )
    for step in range(STEPS):
        if zero == "optimizer":
            optimizer.zero_grad()
        elif zero == "optimizer_in_place":
            optimizer.zero_grad(set_to_none=False)
        elif zero == "model":
            model.zero_grad()
        else:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        if meddle == "new_engine" and step == 2 and optimizer._buckets is not None:
            optimizer._buckets.engine = None  # type: ignore[attr-defined]
        for micro in range(passes):
            loss(model, rank, 10 * step + micro).backward()
        if meddle == "regrad":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.clone()
        if clip:
            optimizer.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    return model, optimizer


def _order_depends_on_layout() -> bool:
    """Whether the data plane's summation order depends on a tensor's place in the buffer
    (gloo's ring at three ranks or more; see the module docstring)."""
    assert runtime.config is not None
    return hvd.size() > 2 and runtime.config.cpu_backend == "gloo"


def _same(first: torch.Tensor, second: torch.Tensor) -> bool:
    if _order_depends_on_layout() and first.dtype.is_floating_point:
        return torch.allclose(first, second, rtol=1e-5, atol=1e-6)
    return torch.equal(first, second)


def assert_identical(first: nn.Module, second: nn.Module) -> None:
    for (name, p), q in zip(first.named_parameters(), second.parameters()):
        assert _same(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None and q.grad is not None:
            assert _same(p.grad.to_dense(), q.grad.to_dense()), name


def compare(monkeypatch: pytest.MonkeyPatch, rank: int, **kwargs: Any) -> torch.optim.Optimizer:
    """Trains with and without buckets; returns the bucketed optimizer."""
    reference, _ = train(monkeypatch, False, rank, **kwargs)
    model, optimizer = train(monkeypatch, True, rank, **kwargs)
    assert_identical(model, reference)
    return optimizer


def bucket_names(optimizer: torch.optim.Optimizer) -> list[str]:
    buckets = getattr(optimizer, "_buckets", None)
    return [] if buckets is None else [bucket.name for bucket in buckets.buckets]


# ---------------------------------------------------------------------------------------
# Identical results


@pytest.mark.parametrize("passes", [1, 2])
def test_same_as_per_tensor(monkeypatch: pytest.MonkeyPatch, rank: int, size: int,
                            passes: int) -> None:
    optimizer = compare(monkeypatch, rank, passes=passes)
    if hooked():
        names = bucket_names(optimizer)
        # The channels_last convolution's weight and the frozen layer stay out.
        assert len(names) == 2  # one float32 bucket, one float64 bucket
        assert not any("conv.weight" in name or "frozen" in name for name in names)
        assert any("conv.bias" in name for name in names)


class Compiled(nn.Module):
    """:class:`Many`'s layers run by ``torch.compile`` (the step stays outside the compiled
    code: an int argument would compile the code again for every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(nn.Sequential(*Many(layers=6).layers))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return torch.tanh(self.body(x))


def test_a_compiled_model_gets_the_same_results_and_bucket_views(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """The accumulators' hooks (each bucket's fill, each gradient's countdown) run the same
    way when the forward pass is compiled."""
    optimizer = compare(monkeypatch, rank, build=Compiled, loss=many_loss)
    if hooked():
        [name] = bucket_names(optimizer)
        built = optimizer._buckets  # type: ignore[attr-defined]
        [bucket] = built.buckets
        assert all(p.grad is view for p, view in zip(bucket.params, bucket.views))


@pytest.mark.parametrize("zero", ["optimizer_in_place", "model", "replace"])
def test_gradients_cleared_or_replaced_behind_the_buckets(
    monkeypatch: pytest.MonkeyPatch, rank: int, zero: str
) -> None:
    compare(monkeypatch, rank, zero=zero)


@pytest.mark.parametrize("meddle", ["regrad", "new_engine"])
def test_gradients_replaced_after_backward_and_a_new_engine(
    monkeypatch: pytest.MonkeyPatch, rank: int, meddle: str
) -> None:
    optimizer = compare(monkeypatch, rank, meddle=meddle)
    if hooked():
        assert len(bucket_names(optimizer)) == 2  # built again after the new engine


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compression(monkeypatch: pytest.MonkeyPatch, rank: int, name: str) -> None:
    compare(monkeypatch, rank, compression=getattr(hvd.Compression, name))


@pytest.mark.parametrize("options", [
    {"gradient_predivide_factor": 2.0}, {"op": hvd.Sum}, {"clip": True},
], ids=["predivide", "sum", "synchronize_then_clip"])
def test_reduction_options(monkeypatch: pytest.MonkeyPatch, rank: int,
                           options: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step-after-synchronize warning
        compare(monkeypatch, rank, **options)


def test_groups_count(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    optimizer = compare(monkeypatch, rank, build=Many, loss=many_loss, groups=lambda _: 5)
    if hooked():
        assert len(bucket_names(optimizer)) == 5


def test_groups_lists(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    def groups(model: nn.Module) -> Any:
        # A bucketable group, one with the channels_last weight and one whose layer the
        # first step does not use: those two stay grouped allreduces.
        return [[model.head.weight, model.head.bias], [model.conv.weight, model.conv.bias],
                [model.extra.weight, model.extra.bias]]

    optimizer = compare(monkeypatch, rank, groups=groups)
    if hooked():
        names = bucket_names(optimizer)
        assert any(name.endswith("[head.weight,head.bias]") for name in names)
        assert not any("conv" in name or "extra" in name for name in names)


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["sparse", "as_dense"])
def test_sparse_gradients_stay_out(monkeypatch: pytest.MonkeyPatch, rank: int, size: int,
                                   sparse_as_dense: bool) -> None:
    optimizer = compare(monkeypatch, rank, build=Bag, loss=bag_loss,
                        sparse_as_dense=sparse_as_dense)
    if hooked():
        assert sorted(bucket_names(optimizer)) == [
            "DistributedOptimizer.bucket.0[head.bias,head.weight]"
            if "0[head.bias" in bucket_names(optimizer)[0]
            else "DistributedOptimizer.bucket.0[head.weight,head.bias]"
        ]


def test_threshold_splits_in_ready_order(monkeypatch: pytest.MonkeyPatch, rank: int,
                                         size: int) -> None:
    # Three 6x6 float32 weights and their biases fit in 3 * (144 + 24) bytes.
    set_threshold(monkeypatch, 3 * (144 + 24))
    optimizer = compare(monkeypatch, rank, build=Many, loss=many_loss)
    if hooked():
        names = bucket_names(optimizer)
        assert len(names) == 4
        # Backward reaches the last layer first.
        for index, name in enumerate(names):
            assert name.startswith(f"DistributedOptimizer.bucket.{index}[")
            inside = sorted(name[name.index("[") + 1:-1].split(","))
            layers = range(11 - 3 * index, 8 - 3 * index, -1)
            assert inside == sorted(f"layers.{i}.{kind}" for i in layers
                                    for kind in ("weight", "bias"))


def test_process_set(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    if size == 1:
        pytest.skip("a set of the one rank would duplicate the global set")
    evens = hvd.add_process_set(list(range(0, size, 2)))
    odds = hvd.add_process_set(list(range(1, size, 2)))
    try:
        mine = evens if rank % 2 == 0 else odds
        compare(monkeypatch, rank, process_set=mine)
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


@pytest.mark.parametrize("options", [
    {"buckets": False}, {"op": hvd.Adasum}, {"compression": "own"},
], ids=["opt_out", "adasum", "own_compressor"])
def test_reduced_one_by_one(monkeypatch: pytest.MonkeyPatch, rank: int,
                            options: dict[str, Any]) -> None:
    if "op" in options and hvd.size() & (hvd.size() - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    if options.get("compression") == "own":
        class Own(hvd.Compression.none):  # type: ignore[name-defined,misc]
            pass

        options = {"compression": Own}
    _, optimizer = train(monkeypatch, options.pop("buckets", True), rank, **options)
    assert bucket_names(optimizer) == []


# ---------------------------------------------------------------------------------------
# No copies


def fusion_bytes_per_step(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module, loss: Any, rank: int
) -> list[int]:
    """Trains ``model`` with buckets for STEPS steps; the bytes the engine copied through
    fusion buffers in each."""
    use_buckets(monkeypatch, True)
    engine = runtime.require_engine()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    copied = []
    for step in range(STEPS):
        before = engine.fusion_bytes
        optimizer.zero_grad()
        loss(model, rank, step).backward()
        optimizer.step()
        copied.append(engine.fusion_bytes - before)
    return copied


def test_no_bytes_through_fusion_buffers(monkeypatch: pytest.MonkeyPatch, rank: int,
                                         size: int) -> None:
    model = Many(layers=40)
    copied = fusion_bytes_per_step(monkeypatch, model, many_loss, rank)
    if hooked():
        assert copied[1:] == [0] * (STEPS - 1)
        assert_views_in_ready_order(model)


def count_copies_into_views(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The list that the buckets from now on append a parameter to whenever they copy its
    gradient into its view (a gradient that autograd did not accumulate there)."""
    from baguahvd.torch import buckets as buckets_module

    copies: list[torch.Tensor] = []
    adopt = buckets_module.adopt

    def counted(p: torch.Tensor, view: torch.Tensor) -> None:
        if p.grad is not None and p.grad is not view:
            copies.append(p)
        adopt(p, view)

    monkeypatch.setattr(buckets_module, "adopt", counted)
    return copies


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_backward_accumulates_into_views_that_zero_grad_dropped(
    monkeypatch: pytest.MonkeyPatch, rank: int, size: int, zero: str
) -> None:
    """zero_grad() sets gradients to None, as torch's does; the next backward points them
    at their views again (each bucket zeroed just before autograd's first accumulation into
    it) without copying any gradient into a view."""
    use_buckets(monkeypatch, True)
    copies = count_copies_into_views(monkeypatch)
    model = Many(layers=6)
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters())
    for step in range(STEPS):
        optimizer.zero_grad() if zero == "optimizer" else model.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        copies.clear()  # the first step's end moves its gradients into the new views
        many_loss(model, rank, step).backward()
        optimizer.step()
    assert copies == []
    if hooked():
        built = optimizer._buckets  # type: ignore[attr-defined]
        assert built is not None
        views = {id(p): view for bucket in built.buckets
                 for p, view in zip(bucket.params, bucket.views)}
        assert all(p.grad is views[id(p)] for p in model.parameters())
        assert_views_in_ready_order(model)


def test_a_later_optimizer_over_the_same_model_takes_the_gradients_over(
    monkeypatch: pytest.MonkeyPatch, rank: int, size: int
) -> None:
    """Wrapping the model's parameters again while the first optimizer stays alive (held by
    a scheduler, say): the gradients become views of the new optimizer's buckets, with no
    copy per gradient, and the results match the per-tensor path."""
    use_buckets(monkeypatch, True)
    copies = count_copies_into_views(monkeypatch)
    model, reference = Many(layers=6), Many(layers=6)
    reference.load_state_dict(model.state_dict())
    kept = [hvd.DistributedOptimizer(sgd(model.parameters()),
                                     named_parameters=model.named_parameters())]
    for phase in range(2):
        if phase:
            kept.append(hvd.DistributedOptimizer(sgd(model.parameters()),
                                                 named_parameters=model.named_parameters()))
        optimizer, plain = kept[-1], sgd(reference.parameters())
        for step in range(STEPS):
            optimizer.zero_grad()
            plain.zero_grad()
            copies.clear()  # the first step's end moves its gradients into the new views
            many_loss(model, rank, step).backward()
            optimizer.step()
            loss = many_loss(reference, rank, step)
            loss.backward()
            for p in reference.parameters():
                p.grad = hvd.allreduce(p.grad, op=hvd.Average)
            plain.step()
        assert copies == []
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs)
    if hooked():
        built = kept[-1]._buckets  # type: ignore[attr-defined]
        assert built is not None
        views = {id(p): view for bucket in built.buckets
                 for p, view in zip(bucket.params, bucket.views)}
        assert all(p.grad is views[id(p)] for p in model.parameters())


def assert_views_in_ready_order(model: Many) -> None:
    """The gradients are views of one buffer, the last layer's first."""
    grads = [[p.grad for p in layer.parameters()] for layer in model.layers]
    storages = {g.untyped_storage().data_ptr() for layer in grads for g in layer}
    assert len(storages) == 1
    for earlier, later in zip(grads, grads[1:]):
        assert min(g.data_ptr() for g in earlier) > max(g.data_ptr() for g in later)


# ---------------------------------------------------------------------------------------
# CUDA buckets (each rank drives GPU local_rank)


def cuda_many() -> nn.Module:
    return Many(layers=40).to(rank_gpu())


def cuda_many_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 6, generator=generator).to(rank_gpu())
    return (model(x, step) ** 2).mean()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_cuda_same_as_per_tensor(monkeypatch: pytest.MonkeyPatch, rank: int, size: int,
                                 compression: str) -> None:
    optimizer = compare(monkeypatch, rank, build=cuda_many, loss=cuda_many_loss,
                        compression=getattr(hvd.Compression, compression))
    if hooked():
        assert len(bucket_names(optimizer)) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_no_bytes_through_fusion_buffers(monkeypatch: pytest.MonkeyPatch, rank: int,
                                              size: int) -> None:
    model = cuda_many()
    copied = fusion_bytes_per_step(monkeypatch, model, cuda_many_loss, rank)
    if hooked():
        assert copied[1:] == [0] * (STEPS - 1)
        assert_views_in_ready_order(model)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Errors name the parameters inside a bucket


def test_a_mismatched_bucket_names_its_parameters(rank: int, size: int) -> None:
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    from baguahvd.common.exceptions import MismatchError
    from baguahvd.common.ops import ReduceOp
    from baguahvd.torch.buckets import GradientBuckets

    # Rank 1's second parameter is larger: the bucket's shapes differ across ranks.
    params = {"fc.weight": torch.zeros(3, requires_grad=True),
              "fc.bias": torch.zeros(2 + rank, requires_grad=True)}
    buckets = GradientBuckets([["fc.weight", "fc.bias"]], params, ReduceOp.SUM, (1.0, 1.0),
                              hvd.Compression.none, hvd.global_process_set)
    for p in params.values():
        buckets.due(p)
    with pytest.raises(MismatchError,
                       match=r"DistributedOptimizer\.bucket\.0\[fc\.weight,fc\.bias\]"):
        buckets.wait()
