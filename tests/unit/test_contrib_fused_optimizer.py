"""fuse_optimizer against the same optimizer unfused: bit-identical, step after step."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from baguahvd.contrib import (
    AlreadyFusedError,
    UnsupportedOptimizerError,
    fuse_optimizer,
    is_fused_optimizer,
)

MakeOptimizer = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: dict[str, MakeOptimizer] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-3),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=1e-3, weight_decay=1e-3),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    # Mixed sizes (odd ones included) and two dtypes, so there are several buckets.
    return nn.Sequential(
        nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5), nn.Tanh(), nn.Linear(5, 3)
    ).float()


def grouped(m: nn.Module) -> list[dict[str, Any]]:
    params = list(m.parameters())
    return [{"params": params[:4]}, {"params": params[4:], "lr": 0.01}]


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range, set_to_none: bool) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 7, generator=g)
        y = torch.randn(16, 3, generator=g)
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def assert_same(a: nn.Module, b: nn.Module, oa: Any, ob: Any) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        assert (pa.grad is None) == (pb.grad is None)
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        assert state.keys() == sb["state"][key].keys()
        for name, value in state.items():
            other = sb["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (key, name)
            else:
                assert value == other


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("groups", [False, True])
def test_bit_identical(name: str, set_to_none: bool, groups: bool) -> None:
    make = OPTIMIZERS[name]
    ref, fused = model(), model()
    ref_opt = make(grouped(ref) if groups else ref.parameters())
    opt = fuse_optimizer(make(grouped(fused) if groups else fused.parameters()))
    assert is_fused_optimizer(opt) and not is_fused_optimizer(ref_opt)
    train(ref, ref_opt, range(6), set_to_none)
    train(fused, opt, range(6), set_to_none)
    assert_same(ref, fused, ref_opt, opt)
    fusion = vars(opt)["_baguahvd_fusion"]
    assert fusion.fused_steps > 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_round_trip(name: str) -> None:
    make = OPTIMIZERS[name]
    ref, fused = model(), model()
    ref_opt, opt = make(ref.parameters()), fuse_optimizer(make(fused.parameters()))
    train(ref, ref_opt, range(3), True)
    train(fused, opt, range(3), True)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    # Into a fresh fused optimizer over a copy of the model, and back into this one.
    other = copy.deepcopy(fused)
    other_opt = fuse_optimizer(make(other.parameters()))
    other_opt.load_state_dict(torch.load(buffer))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(ref, ref_opt, range(3, 7), True)
    train(fused, opt, range(3, 7), True)
    train(other, other_opt, range(3, 7), False)
    assert_same(ref, fused, ref_opt, opt)
    assert_same(ref, other, ref_opt, other_opt)
    # A fused optimizer's state loads into an unfused one.
    plain = copy.deepcopy(ref)
    plain_opt = make(plain.parameters())
    plain_opt.load_state_dict(opt.state_dict())
    train(plain, plain_opt, range(7, 9), True)
    train(ref, ref_opt, range(7, 9), True)
    assert_same(ref, plain, ref_opt, plain_opt)


def test_parameters_are_views_and_grads_land_in_the_buffer() -> None:
    m = model()
    opt = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    train(m, opt, range(1), False)
    flats = {p.untyped_storage().data_ptr() for p in m.parameters()}
    grads = {p.grad.untyped_storage().data_ptr() for p in m.parameters()}
    assert len(flats) == 1 and len(grads) == 1


def test_partial_grads_and_replaced_data_fall_back_correctly() -> None:
    ref, fused = model(), model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = fuse_optimizer(torch.optim.Adam(fused.parameters(), lr=1e-2))
    train(ref, ref_opt, range(2), True)
    train(fused, opt, range(2), True)
    for m, o in ((ref, ref_opt), (fused, opt)):
        # One layer without a gradient: Adam skips it, so its step count falls behind.
        o.zero_grad()
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(9))
        m[4].weight.requires_grad_(False)
        m(x).sum().backward()
        o.step()
        m[4].weight.requires_grad_(True)
        with torch.no_grad():
            m[0].weight.data = m[0].weight.data * 0.5
    train(ref, ref_opt, range(3, 5), True)
    with pytest.warns(UserWarning, match="stepped unfused 3 times in a row"):
        train(fused, opt, range(3, 5), True)
    assert_same(ref, fused, ref_opt, opt)


def test_a_buffer_without_any_gradient_is_skipped_not_unfused() -> None:
    # One layer per param group, so one buffer each; the second layer has no gradient at
    # step 1: the optimizer skips it, and both buffers keep stepping fused.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ref = copy.deepcopy(m)

    def groups(model: nn.Module) -> list[dict[str, Any]]:
        return [{"params": model[0].parameters()}, {"params": model[1].parameters()}]

    opt = fuse_optimizer(torch.optim.Adam(groups(m), lr=1e-2))
    ref_opt = torch.optim.Adam(groups(ref), lr=1e-2)
    for model, o in ((m, opt), (ref, ref_opt)):
        for step in range(4):
            o.zero_grad()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            (model[0](x) if step == 1 else model(x)).sum().backward()
            o.step()
    assert_same(ref, m, ref_opt, opt)
    fusion = vars(opt)["_baguahvd_fusion"]
    assert fusion.unfused_steps == 0 and fusion.fused_steps == 7


def test_closure_and_added_group() -> None:
    ref, fused = model(), model()
    ref_opt = torch.optim.SGD(list(ref.parameters())[:4], lr=0.1, momentum=0.9)
    opt = fuse_optimizer(torch.optim.SGD(list(fused.parameters())[:4], lr=0.1, momentum=0.9))
    ref_opt.add_param_group({"params": list(ref.parameters())[4:]})
    opt.add_param_group({"params": list(fused.parameters())[4:]})
    for m, o in ((ref, ref_opt), (fused, opt)):
        for step in range(4):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))

            def closure(m: nn.Module = m, o: Any = o, x: torch.Tensor = x) -> torch.Tensor:
                o.zero_grad()
                loss = m(x).pow(2).mean()
                loss.backward()
                return loss

            assert o.step(closure) is not None
    assert_same(ref, fused, ref_opt, opt)


def test_over_torch_fused_kernel_is_close_not_identical() -> None:
    # torch's fused CPU kernels round a vector body and its scalar tail differently, so the
    # same element can differ in its last bit when it sits elsewhere in a bigger buffer.
    ref, fused = model(), model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = fuse_optimizer(torch.optim.AdamW(fused.parameters(), lr=1e-2, fused=True))
    train(ref, ref_opt, range(5), True)
    train(fused, opt, range(5), True)
    assert vars(opt)["_baguahvd_fusion"].fused_steps > 0
    for p, q in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_errors() -> None:
    m = model()
    opt = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(AlreadyFusedError, match="fused already"):
        fuse_optimizer(opt)
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        fuse_optimizer(torch.optim.LBFGS(model().parameters()))
    with pytest.raises(UnsupportedOptimizerError, match="SparseAdam"):
        fuse_optimizer(torch.optim.SparseAdam(model().parameters()))


class _PerTensorScale(torch.optim.Optimizer):
    """Keeps a 2-element state per tensor: not per-element, not scalar."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("scale", torch.ones(2))
                    p.add_(p.grad, alpha=-group["lr"])


def test_state_neither_per_element_nor_scalar_is_refused() -> None:
    m = model()
    opt = fuse_optimizer(_PerTensorScale(m.parameters()))
    with pytest.raises(UnsupportedOptimizerError, match="state 'scale' of shape \\[2\\]"):
        train(m, opt, range(1), True)
