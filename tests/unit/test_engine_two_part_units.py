"""Device units launched in two parts (``baguahvd.engine.execution.completion``): the communication,
then, once the host has seen it finish without error, what writes the users' outputs."""

from __future__ import annotations

import pytest
import torch

from baguahvd.engine.execution.completion import CollectiveFailure, Completions
from baguahvd.engine.messages import OpType, RequestMeta, build_response
from baguahvd.engine.requests import Outcome, Request


class Log(list):
    """What happened, in order; stands in for the timeline, which notes each completed
    request as ``<name>.done``."""

    active = True

    def done(self, name: str, args: object = None) -> None:
        self.append(f"{name}.done")


def started() -> tuple[Completions, Device, Log]:
    log = Log()
    return Completions(log), Device(), log  # type: ignore[arg-type]


class Device:
    """A device communicator whose launched parts finish when the test says so."""

    def __init__(self) -> None:
        self.fired: set[str] = set()
        self.failure: Exception | None = None
        self.checked: list[str] = []

    def finished(self, launched: str) -> bool:
        return launched in self.fired

    def wait(self, launched: str) -> None:
        self.fired.add(launched)

    def check_succeeded(self, launched: str) -> None:
        self.checked.append(launched)
        if self.failure is not None:
            raise self.failure

    def abort(self, reason: str) -> None:
        pass


def two_parts(completions: Completions, comm: Device, name: str,
              log: list[str]) -> Request:
    meta = RequestMeta(key=name, name=name, op=OpType.ALLREDUCE, process_set_id=0, rank=0,
                       dtype="float32", shapes=((1,),), device="GPU")
    request = Request(meta, [torch.ones(1)], None)

    def then() -> str:
        log.append(f"{name}.rest")
        return f"{name}.rest"

    completions.add(comm, name, [(build_response([meta], (0, 1), ()), request)],
                    [Outcome(request, [])], then)
    return request


def test_the_rest_is_launched_once_the_first_part_finished_and_completes_after_it() -> None:
    completions, comm, log = started()
    two_parts(completions, comm, "a", log)
    assert not completions.poll()
    assert log == []
    comm.fired.add("a")
    assert completions.poll()  # launched the rest: worth polling again soon
    assert log == ["a.rest"] and comm.checked == ["a"]
    assert not completions.poll()
    assert log == ["a.rest"]  # the rest has not finished
    comm.fired.add("a.rest")
    assert not completions.poll()
    assert log == ["a.rest", "a.done"] and len(completions) == 0


def test_later_units_go_on_while_an_earlier_one_still_runs() -> None:
    completions, comm, log = started()
    for name in "abc":
        two_parts(completions, comm, name, log)
    comm.fired.update({"a", "b"})
    completions.poll()
    assert log == ["a.rest", "b.rest"]
    comm.fired.update({"b.rest", "c", "c.rest"})
    completions.poll()
    # c's rest is launched; nothing completes before a.
    assert log == ["a.rest", "b.rest", "c.rest"]
    comm.fired.add("a.rest")
    completions.poll()
    assert log == ["a.rest", "b.rest", "c.rest", "a.done", "b.done", "c.done"]


def test_draining_launches_and_waits_for_the_rest() -> None:
    completions, comm, log = started()
    two_parts(completions, comm, "a", log)
    completions.drain()
    assert log == ["a.rest", "a.done"]


def test_an_error_seen_after_the_first_part_stops_the_rest() -> None:
    completions, comm, log = started()
    request = two_parts(completions, comm, "a", log)
    comm.fired.add("a")
    comm.failure = RuntimeError("NCCL_ERROR_6")
    with pytest.raises(CollectiveFailure, match="NCCL_ERROR_6") as info:
        completions.poll()
    assert info.value.unit[0][1] is request
    assert log == []
