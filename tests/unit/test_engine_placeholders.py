"""Placeholders on real engines in one process (``tests/fakes/world.py``).

A collective that failed its local checks on one rank is submitted as a placeholder
(:meth:`Engine.take_place`): the others' matching collective fails naming that rank and its
reason, later collectives stay paired, and nothing about it is cached.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from baguahvd.common.exceptions import MismatchError
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.engine import GLOBAL_PROCESS_SET_ID, Engine
from baguahvd.engine.messages import OpType
from baguahvd.engine.requests import Handle
from tests.fakes.world import Job, start_job

SIZE = 3
BAD = 1
REASON = "ValueError: Tensor type torch.BoolTensor is not supported."


@pytest.fixture
def job() -> Iterator[Job]:
    started = start_job(SIZE)
    try:
        yield started
    finally:
        started.close()


def _allreduce(engine: Engine, value: float, name: str | None) -> Handle:
    tensor = torch.tensor([value])
    return engine.submit(
        OpType.ALLREDUCE, "allreduce", GLOBAL_PROCESS_SET_ID, [tensor],
        [torch.empty_like(tensor)], name=name, reduce_op=ReduceOp.SUM,
    )


def _value(handle: Handle) -> float:
    outputs = handle.wait()
    assert outputs is not None
    return float(outputs[0].item())


def _place(engine: Engine, name: str | None) -> None:
    engine.take_place(OpType.ALLREDUCE, "allreduce", GLOBAL_PROCESS_SET_ID, name, REASON)


def test_a_placeholder_fails_the_others_and_keeps_unnamed_collectives_paired(job: Job) -> None:
    def body(rank: int, engine: Engine) -> tuple[str, list[float]]:
        message = ""
        if rank == BAD:
            _place(engine, None)
        else:
            with pytest.raises(MismatchError) as info:
                _allreduce(engine, 100.0, None).wait()
            message = str(info.value)
        return message, [_value(_allreduce(engine, float(step + rank), None))
                         for step in range(3)]

    results = job.run(body)
    for rank, (message, values) in enumerate(results):
        if rank != BAD:
            assert message == f"allreduce.noname.0: rank {BAD} failed its local checks: {REASON}"
        assert values == [3.0, 6.0, 9.0]


def test_placeholders_on_every_rank_fail_nobody(job: Job) -> None:
    def body(rank: int, engine: Engine) -> float:
        _place(engine, None)
        return _value(_allreduce(engine, 1.0, None))

    assert job.run(body) == [3.0] * SIZE


def test_a_placeholder_invalidates_a_cached_response_instead_of_hitting_it(job: Job) -> None:
    def step(rank: int, engine: Engine) -> float:
        return _value(_allreduce(engine, 1.0, "w"))

    for _ in range(3):
        assert job.run(step) == [3.0] * SIZE
    gathers = job.world.calls["gather"]

    def failing(rank: int, engine: Engine) -> str:
        if rank == BAD:
            _place(engine, "w")
            return ""
        with pytest.raises(MismatchError) as info:
            _allreduce(engine, 1.0, "w").wait()
        return str(info.value)

    messages = job.run(failing)
    assert messages[0] == messages[2] == (
        f"allreduce.w: rank {BAD} failed its local checks: {REASON}"
    )
    # Negotiated in full, not answered from the cache; the error response is not cached.
    assert job.world.calls["gather"] > gathers
    assert job.run(step) == [3.0] * SIZE


def test_a_retry_under_the_placeholders_name_is_its_next_round(job: Job) -> None:
    def body(rank: int, engine: Engine) -> float:
        if rank == BAD:
            _place(engine, "retried")
            # Not a duplicate name: it waits for the placeholder and pairs with the others'
            # second call.
            return _value(_allreduce(engine, 10.0, "retried"))
        with pytest.raises(MismatchError, match=f"rank {BAD} failed its local checks"):
            _allreduce(engine, 1.0, "retried").wait()
        return _value(_allreduce(engine, 1.0, "retried"))

    assert job.run(body) == [12.0] * SIZE

