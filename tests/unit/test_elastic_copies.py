"""The in-memory copy of a commit: a deep copy that reuses the tensors of an earlier copy
nothing reads any more, and never those of a copy a background write still reads."""

from __future__ import annotations

import copy
import pathlib
import threading
from collections import OrderedDict
from typing import Any

import pytest
import torch

from baguahvd.torch.elastic.copies import copy_state
from baguahvd.torch.elastic.state import TorchState
from baguahvd.torch.elastic.store import CheckpointStore
from baguahvd.torch.elastic.writer import CommitWriter


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))


def _shares_memory(a: dict, b: dict) -> bool:
    return any(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
               for x in a.values() for y in b.values())


def test_without_a_spare_it_is_a_deep_copy_with_the_state_dict_s_metadata() -> None:
    state = _model().state_dict()
    copied = copy_state(state)
    assert type(copied) is OrderedDict and copied._metadata == state._metadata
    assert copied._metadata is not state._metadata
    assert copied.keys() == state.keys()
    assert all(torch.equal(copied[k], state[k]) for k in state)
    assert not _shares_memory(copied, state)


def test_a_spare_of_the_same_layout_takes_the_copy_in_its_own_tensors() -> None:
    model = _model()
    spare = copy_state(model.state_dict())
    with torch.no_grad():
        model[0].weight.add_(1.0)
    state = model.state_dict()
    copied = copy_state(state, spare)
    assert all(copied[k] is spare[k] for k in state)
    assert all(torch.equal(copied[k], state[k]) for k in state)
    assert not _shares_memory(copied, state)


def test_an_optimizer_state_is_copied_into_the_spare_and_plain_values_deep_copied() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    spare = copy_state(optimizer.state_dict())
    optimizer.step()
    state = optimizer.state_dict()
    copied = copy_state(state, spare)
    for index, slots in state["state"].items():
        for key, value in slots.items():
            assert copied["state"][index][key] is spare["state"][index][key]
            assert torch.equal(copied["state"][index][key], value)
    assert copied["param_groups"] == state["param_groups"]
    assert copied["param_groups"][0] is not state["param_groups"][0]
    torch.optim.Adam(model.parameters()).load_state_dict(copied)


def test_tied_tensors_stay_tied_and_a_tied_spare_takes_one_source_only() -> None:
    shared = torch.arange(4.0)
    copied = copy_state({"a": shared, "b": shared})
    assert copied["a"] is copied["b"] and copied["a"] is not shared
    one = torch.zeros(4)
    untied = {"a": torch.ones(4), "b": torch.full((4,), 2.0)}
    again = copy_state(untied, {"a": one, "b": one})
    assert again["a"] is one and again["b"] is not one
    assert again["a"].tolist() == [1.0] * 4 and again["b"].tolist() == [2.0] * 4


@pytest.mark.parametrize("change", ["shape", "dtype", "strides", "grad", "class"])
def test_a_tensor_the_spare_cannot_take_is_deep_copied(change: str) -> None:
    source = torch.arange(6.0).view(2, 3)
    spare = torch.zeros(2, 3)
    if change == "shape":
        spare = torch.zeros(3, 2)
    elif change == "dtype":
        spare = torch.zeros(2, 3, dtype=torch.float64)
    elif change == "strides":
        source = source.t().contiguous().t()
    elif change == "grad":
        source = source.clone().requires_grad_()
    else:
        source = torch.nn.Parameter(source.clone(), requires_grad=False)
    copied = copy_state({"w": source}, {"w": spare})["w"]
    assert copied is not spare and copied is not source
    assert torch.equal(copied, source) and copied.stride() == source.stride()
    assert type(copied) is type(source) and copied.requires_grad == source.requires_grad


def test_containers_of_another_layout_do_not_lend_their_tensors() -> None:
    spare = {"w": [torch.zeros(2)], "t": (torch.zeros(2), torch.zeros(2))}
    state = {"w": [torch.ones(2), torch.ones(2)], "t": [torch.ones(2), torch.ones(2)]}
    copied = copy_state(state, spare)
    assert copied == {"w": copied["w"], "t": copied["t"]}
    assert all(x is not y for x in copied["w"] + copied["t"]
               for y in [*spare["w"], *spare["t"]])
    assert all(torch.equal(x, torch.ones(2)) for x in copied["w"] + copied["t"])


class _Writer:
    """Stands for the commit writer: the commits whose tensors a write still reads."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def holds(self) -> frozenset[int]:
        return frozenset(self.held)


def test_a_save_never_writes_into_the_copy_of_a_commit_the_writer_holds() -> None:
    model = torch.nn.Linear(3, 3)
    state = TorchState(model)
    writer = _Writer()
    object.__setattr__(state, "_writer", writer)
    handler = state._handlers["model"]
    saved = []
    for number in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(float(number))
        state.save()
        state._commits = number
        writer.held = {1}  # commit 1's write is still in flight throughout
        saved.append(handler.saved()["weight"])
        assert torch.equal(saved[-1], model.weight.detach())
        assert saved[-1] is not model.weight
    # Commit 1's copy kept its values; the others took turns in two sets of tensors.
    assert saved[0].tolist() == [[1.0] * 3] * 3
    assert saved[3] is saved[1] and saved[4] is saved[2]
    assert saved[2] is not saved[1] and all(s is not saved[0] for s in saved[1:])
    writer.held = set()  # the write ended: commit 1's copy is free, but one spare is kept
    with torch.no_grad():
        model.weight.fill_(6.0)
    state.save()
    assert handler.saved()["weight"] is saved[3]  # the newest free copy, commit 4's
    assert torch.equal(handler.saved()["weight"], model.weight.detach())
    state.restore()
    assert model.weight.tolist() == [[6.0] * 3] * 3


def test_without_a_writer_two_copies_take_turns() -> None:
    model = torch.nn.Linear(2, 2)
    state = TorchState(model)
    handler = state._handlers["model"]
    first = handler.saved()["weight"]
    state.save()
    second = handler.saved()["weight"]
    state.save()
    assert handler.saved()["weight"] is first
    state.save()
    assert handler.saved()["weight"] is second
    assert copy.deepcopy(handler.saved()).keys() == model.state_dict().keys()


class _GatedStore(CheckpointStore):
    """Writes nothing: records each commit's weights as its write reads them, once the
    test lets the writes go."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, host="node-a")
        self.go = threading.Event()
        self.started = threading.Event()
        self.written: dict[int, list[float]] = {}

    def write(self, number: int, payload: Any) -> str:
        self.started.set()
        assert self.go.wait(30.0), "the test never let the write go"
        weight = payload["handlers"]["model"]["weight"]
        self.written[number] = sorted(set(weight.flatten().tolist()))
        return ""


def test_commits_made_during_a_write_leave_the_tensors_it_reads_alone(
    tmp_path: pathlib.Path,
) -> None:
    model = torch.nn.Linear(4, 4)
    state = TorchState(model)
    store = _GatedStore(str(tmp_path))
    writer = CommitWriter(store)
    object.__setattr__(state, "_writer", writer)
    for number in range(1, 7):  # as commit() does, without its collective host check
        with torch.no_grad():
            model.weight.fill_(float(number))
        state.save()
        state._commits = number
        writer.submit(number, state._payload())
        if number == 1:  # its write under way before the next commits come
            assert store.started.wait(30.0), "the writer never started commit 1"
    store.go.set()
    writer.wait()
    # Commit 1 was being written throughout; 2 to 5 were superseded, 6 written last.
    assert store.written == {1: [1.0], 6: [6.0]}
