"""broadcast_object, allgather_object, broadcast_parameters and broadcast_optimizer_state.

Expected values are rebuilt locally: a model or optimizer seeded with the root's rank is
what every rank must hold after the broadcast.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import baguahvd.torch as hvd


@dataclasses.dataclass
class Record:
    """A user-defined class sent by value."""

    owner: int
    tags: tuple[str, ...]
    weights: torch.Tensor


def _root(size: int) -> int:
    return size - 1


# ---------------------------------------------------------------------------------------
# broadcast_object / allgather_object


def test_broadcast_object_dict_with_tensors(rank: int, size: int) -> None:
    root = _root(size)
    obj = {"rank": rank, "tensor": torch.full((2, 2), float(rank)), "nested": [rank, (rank,)]}
    result = hvd.broadcast_object(obj, root_rank=root)
    assert result["rank"] == root
    assert torch.equal(result["tensor"], torch.full((2, 2), float(root)))
    assert result["nested"] == [root, (root,)]
    assert isinstance(result["nested"][1], tuple)
    if rank == root:
        assert result is obj


def test_broadcast_object_custom_class(rank: int, size: int) -> None:
    root = 0
    obj = Record(rank, tuple(f"t{i}" for i in range(rank + 1)), torch.arange(rank + 2.0))
    result = hvd.broadcast_object(obj, root_rank=root, name="record")
    assert isinstance(result, Record)
    assert result.owner == root
    assert result.tags == ("t0",)
    assert torch.equal(result.weights, torch.arange(2.0))


@pytest.mark.parametrize(
    "value",
    [None, 7, 3.5, "text", b"\x00bytes", [], {}, list(range(1000))],
    ids=["none", "int", "float", "str", "bytes", "empty_list", "empty_dict", "long_list"],
)
def test_broadcast_object_simple_values(rank: int, size: int, value) -> None:
    root = _root(size)
    mine = value if rank == root else ("not the root", rank)
    assert hvd.broadcast_object(mine, root_rank=root, name="simple") == value


def test_broadcast_object_default_root_and_repeats(rank: int, size: int) -> None:
    for step in range(3):
        assert hvd.broadcast_object({"step": step, "rank": rank}) == {"step": step, "rank": 0}


def test_broadcast_object_in_a_process_set(rank: int, size: int) -> None:
    odd = hvd.add_process_set(list(range(1, size, 2)))
    even = hvd.add_process_set(list(range(0, size, 2)))
    mine = even if rank % 2 == 0 else odd
    root = mine.ranks[-1]
    result = hvd.broadcast_object({"rank": rank}, root_rank=root, process_set=mine)
    assert result == {"rank": root}
    assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)


def test_allgather_object(rank: int, size: int) -> None:
    obj = {"rank": rank, "items": list(range(rank)), "tensor": torch.full((rank + 1,), 1.0 * rank)}
    gathered = hvd.allgather_object(obj)
    assert len(gathered) == size
    for r, item in enumerate(gathered):
        assert item["rank"] == r
        assert item["items"] == list(range(r))
        assert torch.equal(item["tensor"], torch.full((r + 1,), 1.0 * r))


def test_allgather_object_sizes_differ(rank: int, size: int) -> None:
    gathered = hvd.allgather_object("x" * (1000 * rank), name="ragged_strings")
    assert gathered == ["x" * (1000 * r) for r in range(size)]
    assert hvd.allgather_object(None, name="nones") == [None] * size
    records = hvd.allgather_object(Record(rank, (), torch.zeros(1)), name="records")
    assert [record.owner for record in records] == list(range(size))


# ---------------------------------------------------------------------------------------
# broadcast_parameters


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU(), torch.nn.Linear(3, 2)
    )
    # Make the buffers rank-specific as well.
    with torch.no_grad():
        model[1].running_mean.fill_(float(seed))
        model[1].num_batches_tracked.fill_(seed)
    return model


def _assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def test_broadcast_parameters_state_dict(rank: int, size: int) -> None:
    root = _root(size)
    model = _model(rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    _assert_state_equal(model.state_dict(), _model(root).state_dict())


def test_broadcast_parameters_named_parameters(rank: int, size: int) -> None:
    root = 0
    model = _model(rank + 10)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=root)
    expected = _model(root + 10)
    for (name, param), (_, wanted) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(param, wanted), name
    # Buffers were not in the list, so they keep this rank's values.
    assert torch.equal(model[1].running_mean, torch.full((3,), float(rank + 10)))


def test_broadcast_parameters_plain_tensor_list(rank: int, size: int) -> None:
    root = _root(size)
    tensors = [torch.full((i + 1,), float(rank)) for i in range(3)]
    hvd.broadcast_parameters(tensors, root_rank=root)
    for i, tensor in enumerate(tensors):
        assert torch.equal(tensor, torch.full((i + 1,), float(root)))


def test_broadcast_parameters_keeps_autograd_working(rank: int, size: int) -> None:
    model = _model(rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model.train()
    loss = model(torch.ones(5, 4)).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


class _WithExtraState(torch.nn.Linear):
    """A module with a non-tensor entry in its state dict (``_extra_state``)."""

    def get_extra_state(self) -> dict[str, int]:
        return {"calls": 3}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


def test_broadcast_parameters_warns_of_what_is_not_a_tensor(rank: int, size: int) -> None:
    """Values that are not tensors cannot be overwritten in place: the tensors are still
    broadcast, and a warning names the others (Horovod fails with an AttributeError)."""
    root = _root(size)
    torch.manual_seed(rank)
    module = _WithExtraState(3, 2)
    state = module.state_dict()
    with pytest.warns(UserWarning, match=r"not tensors as they are: _extra_state \(dict\)"):
        hvd.broadcast_parameters(state, root_rank=root)
    torch.manual_seed(root)
    expected = torch.nn.Linear(3, 2)
    assert torch.equal(module.weight, expected.weight)
    assert torch.equal(module.bias, expected.bias)
    with pytest.warns(UserWarning, match=r"not tensors as they are: 1 \(float\)"):
        hvd.broadcast_parameters([torch.zeros(2), 1.5], root_rank=root)


def test_broadcast_parameters_rejects_a_generator(size: int) -> None:
    model = _model(0)
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(model.parameters(), root_rank=0)
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(tuple(model.parameters()), root_rank=0)
    result = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_generator")
    assert result.item() == size


# ---------------------------------------------------------------------------------------
# broadcast_optimizer_state


def _trained(kind: str, seed: int, data_seed: int, steps: int = 2) -> torch.optim.Optimizer:
    """An optimizer on ``_model(seed)`` after ``steps`` steps on data drawn from
    ``data_seed``; hyperparameters depend on ``seed`` so that they differ across ranks."""
    model = _model(seed)
    params = model.parameters()
    scale = 1.0 + seed
    if kind == "sgd":
        optimizer = torch.optim.SGD(
            params, lr=0.01 * scale, momentum=0.5 + 0.1 * seed, nesterov=seed % 2 == 0,
            weight_decay=0.001 * seed,
        )
    elif kind == "adam":
        optimizer = torch.optim.Adam(
            params, lr=0.001 * scale, betas=(0.8 + 0.01 * seed, 0.99), amsgrad=seed % 2 == 1
        )
    else:
        optimizer = getattr(torch.optim, kind)(params, lr=0.001 * scale)
    generator = torch.Generator().manual_seed(1000 + data_seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=generator)).pow(2).sum().backward()
        optimizer.step()
    optimizer.model = model  # type: ignore[attr-defined]
    return optimizer


def _snapshot(optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def _assert_optimizer_state_equal(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for index, entries in expected["state"].items():
        mine = actual["state"][index]
        assert mine.keys() == entries.keys()
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert isinstance(mine[key], torch.Tensor), (index, key)
                assert mine[key].dtype == value.dtype, (index, key)
                assert torch.equal(mine[key], value), (index, key)
            else:
                assert type(mine[key]) is type(value) and mine[key] == value, (index, key)
    assert len(actual["param_groups"]) == len(expected["param_groups"])
    for group, wanted in zip(actual["param_groups"], expected["param_groups"]):
        assert group.keys() == wanted.keys()
        for key, value in wanted.items():
            assert type(group[key]) is type(value), key
            assert group[key] == value, key


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state_after_steps(rank: int, size: int, kind: str) -> None:
    root = _root(size)
    optimizer = _trained(kind, seed=rank, data_seed=rank)
    before = _snapshot(optimizer)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    expected = _snapshot(_trained(kind, seed=root, data_seed=root))
    _assert_optimizer_state_equal(optimizer.state_dict(), expected)
    if rank == root:
        # The root's own state, including its step count, is left alone.
        _assert_optimizer_state_equal(optimizer.state_dict(), before)


def test_broadcast_optimizer_state_types_preserved(rank: int, size: int) -> None:
    root = 0
    optimizer = _trained("adam", seed=rank, data_seed=rank)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    group = optimizer.param_groups[0]
    assert isinstance(group["betas"], tuple)
    assert group["betas"] == (0.8, 0.99)
    assert isinstance(group["amsgrad"], bool) and group["amsgrad"] is False
    assert isinstance(group["lr"], float) and group["lr"] == 0.001
    sgd = _trained("sgd", seed=rank, data_seed=rank)
    hvd.broadcast_optimizer_state(sgd, root_rank=root)
    sgd_group = sgd.param_groups[0]
    assert sgd_group["nesterov"] is True
    assert isinstance(sgd_group["momentum"], float) and sgd_group["momentum"] == 0.5
    assert sgd_group["weight_decay"] == 0.0


def test_broadcast_optimizer_state_then_identical_training(rank: int, size: int) -> None:
    root = 0
    optimizer = _trained("adam", seed=rank, data_seed=rank)
    model = optimizer.model  # type: ignore[attr-defined]
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    generator = torch.Generator().manual_seed(42)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=generator)).pow(2).sum().backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="identical_training")
    for row in everyone:
        assert torch.equal(row, flat)


def test_broadcast_optimizer_state_before_any_step(rank: int, size: int) -> None:
    root = _root(size)
    optimizer = _trained("adam", seed=rank, data_seed=rank, steps=0)
    model = optimizer.model  # type: ignore[attr-defined]
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    # As Horovod: a step with zero gradients created the state, then the root's replaced it.
    oracle = _trained("adam", seed=root, data_seed=root, steps=0)
    _initializing_step(oracle)
    _assert_optimizer_state_equal(optimizer.state_dict(), _snapshot(oracle))
    assert int(optimizer.state_dict()["state"][0]["step"]) == 1
    for param in model.parameters():
        assert param.grad is not None and torch.equal(param.grad, torch.zeros_like(param))


def test_broadcast_optimizer_state_without_the_initializing_step(rank: int, size: int) -> None:
    root = _root(size)
    optimizer = _trained("adam", seed=rank, data_seed=rank, steps=0)
    model = optimizer.model  # type: ignore[attr-defined]
    params_before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(optimizer, root_rank=root, initialize_state=False)
    state = optimizer.state_dict()
    # No step is taken on anybody's behalf: the state stays empty and no parameter moves.
    assert len(state["state"]) == 0
    for param, before in zip(model.parameters(), params_before):
        assert torch.equal(param, before)
    # The hyperparameters are the root's.
    expected = _snapshot(_trained("adam", seed=root, data_seed=root, steps=0))
    _assert_optimizer_state_equal(state, expected)
    for param in model.parameters():
        assert param.grad is not None and torch.equal(param.grad, torch.zeros_like(param))


def test_broadcast_optimizer_state_zero_grads(rank: int, size: int) -> None:
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    kept = torch.nn.Parameter(torch.ones(2))
    missing = torch.nn.Parameter(torch.ones(3))
    # Horovod's step replaces every gradient with zeros; without the step, only missing
    # gradients are made.
    for initialize_state, kept_grad in ((True, 0.0), (False, 5.0)):
        kept.grad = torch.full((2,), 5.0)
        missing.grad = None
        optimizer = torch.optim.Adam([frozen, kept, missing], lr=0.1)
        hvd.broadcast_optimizer_state(
            optimizer, root_rank=0, initialize_state=initialize_state
        )
        assert frozen.grad is None
        assert torch.equal(kept.grad, torch.full((2,), kept_grad))
        assert torch.equal(missing.grad, torch.zeros(3))
    # An optimizer that has state keeps every gradient as it was.
    trained = _trained("sgd", seed=rank, data_seed=rank)
    for param in trained.param_groups[0]["params"]:
        param.grad = None
    hvd.broadcast_optimizer_state(trained, root_rank=0)
    assert all(p.grad is None for p in trained.param_groups[0]["params"])


def _initializing_step(optimizer: torch.optim.Optimizer) -> None:
    """The oracle of Horovod's state-creating step: zero gradients, one plain step, for an
    optimizer without state (Adagrad makes its state when constructed, and takes none)."""
    if optimizer.state_dict()["state"]:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    optimizer.step()


_FIRST_STEP_OPTIMIZERS = {
    "sgd_momentum_weight_decay": lambda params: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, weight_decay=1e-2
    ),
    "adam_weight_decay": lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=1e-2),
    "rmsprop": lambda params: torch.optim.RMSprop(
        params, lr=0.01, momentum=0.5, weight_decay=1e-2
    ),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.01, weight_decay=1e-2),
    "sgd_weight_decay_only": lambda params: torch.optim.SGD(params, lr=0.1, weight_decay=1e-2),
}


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("kind", sorted(_FIRST_STEP_OPTIMIZERS))
def test_broadcast_optimizer_state_moves_parameters_as_horovod_does(
    rank: int, size: int, kind: str, distributed: bool
) -> None:
    # A Horovod-style script: parameters from the root, then its optimizer state. With
    # weight decay the state-creating step moves the parameters: every rank ends where the
    # root's plain step from the same parameters ends, bit for bit.
    root = _root(size)
    make = _FIRST_STEP_OPTIMIZERS[kind]
    model = _model(rank)
    optimizer = make(model.parameters())
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    oracle_model = _model(root)
    oracle = make(oracle_model.parameters())
    _initializing_step(oracle)
    for mine, expected in zip(model.parameters(), oracle_model.parameters()):
        assert torch.equal(mine, expected)
    moved = not torch.equal(next(model.parameters()), next(_model(root).parameters()))
    assert moved == (kind != "adagrad")
    _assert_optimizer_state_equal(optimizer.state_dict(), _snapshot(oracle))
    if kind == "sgd_momentum_weight_decay":
        # SGD's momentum starts at weight_decay * p of the parameters before the step.
        start = next(_model(root).parameters()).detach()
        buffer = optimizer.state_dict()["state"][0]["momentum_buffer"]
        torch.testing.assert_close(buffer, 1e-2 * start, rtol=1e-6, atol=0)


def test_broadcast_optimizer_state_mixed_requires_grad(rank: int, size: int) -> None:
    root = 0
    torch.manual_seed(rank)
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    trained = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9)
    trained.grad = torch.full((3,), float(rank + 1))
    optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    state = optimizer.state_dict()["state"]
    assert 0 not in state
    assert torch.equal(state[1]["momentum_buffer"], torch.full((3,), float(root + 1)))


def test_broadcast_optimizer_state_only_the_root_has_state(rank: int, size: int) -> None:
    # E.g. a checkpoint restored on the root only: the others get the state and step count.
    root = 0
    steps = 3 if rank == root else 0
    optimizer = _trained("adam", seed=root, data_seed=root, steps=steps)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    expected = _snapshot(_trained("adam", seed=root, data_seed=root, steps=3))
    _assert_optimizer_state_equal(optimizer.state_dict(), expected)
    assert int(optimizer.state_dict()["state"][0]["step"]) == 3


def test_broadcast_optimizer_state_only_the_others_have_state(rank: int, size: int) -> None:
    # The root has not stepped: it takes Horovod's state-creating step, and everybody ends
    # with the state that step made.
    root = size - 1
    steps = 0 if rank == root else 2
    optimizer = _trained("sgd", seed=root, data_seed=rank, steps=steps)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    oracle = _trained("sgd", seed=root, data_seed=root, steps=0)
    _initializing_step(oracle)
    _assert_optimizer_state_equal(optimizer.state_dict(), _snapshot(oracle))
    # Without the step, everybody ends without state, as the root.
    optimizer = _trained("sgd", seed=root, data_seed=rank, steps=steps)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root, initialize_state=False)
    assert len(optimizer.state_dict()["state"]) == 0


@pytest.mark.parametrize(
    "kind",
    ["Adadelta", "Adagrad", "Adamax", "AdamW", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"],
)
def test_broadcast_optimizer_state_other_optimizers(rank: int, size: int, kind: str) -> None:
    root = _root(size)
    optimizer = _trained(kind, seed=rank, data_seed=rank)
    before = _snapshot(optimizer)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    _assert_optimizer_state_equal(
        optimizer.state_dict(), _snapshot(_trained(kind, seed=root, data_seed=root))
    )
    if rank == root:
        _assert_optimizer_state_equal(optimizer.state_dict(), before)


def test_broadcast_optimizer_state_lbfgs_is_refused(size: int) -> None:
    optimizer = torch.optim.LBFGS(_model(0).parameters())
    with pytest.raises(ValueError, match="cannot broadcast torch.optim.LBFGS state"):
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    result = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_lbfgs")
    assert result.item() == size


def test_broadcast_state_into_a_distributed_optimizer(rank: int, size: int) -> None:
    # Horovod's recipe: broadcast parameters and optimizer state, then train on different
    # data per rank; the averaged gradients keep every rank's model identical.
    root = 0
    model = _model(rank)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1)),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    assert optimizer.param_groups[0]["lr"] == 0.001
    generator = torch.Generator().manual_seed(rank)
    model.eval()  # BatchNorm statistics would differ per rank in train mode.
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=generator)).pow(2).sum().backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="distributed_training")
    for row in everyone:
        assert torch.allclose(row, flat)
    # A later broadcast of a stepped DistributedOptimizer's state works as well.
    hvd.broadcast_optimizer_state(optimizer, root_rank=size - 1)
    # The state-creating step and two training steps, as under Horovod.
    assert int(optimizer.state_dict()["state"][0]["step"]) == 3
