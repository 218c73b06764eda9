"""Placeholders and call sites on real engines in one process (``tests/fakes/world.py``).

A collective that failed its local checks on one rank is submitted as a placeholder
(:meth:`Engine.take_place`): the others' matching collective fails naming that rank and its
reason, later collectives stay paired, and nothing about it is cached. With
``check_call_sites`` unnamed collectives paired from different lines fail on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from baguahvd.common.exceptions import MismatchError
from baguahvd.common.ops import ReduceOp
from baguahvd.engine.engine import GLOBAL_PROCESS_SET_ID, Engine
from baguahvd.engine.messages import OpType, RequestMeta, build_response
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


def test_unnamed_collectives_from_different_sites_fail_on_every_rank() -> None:
    job = start_job(SIZE, check_call_sites=True)
    try:
        def body(rank: int, engine: Engine) -> str:
            # The site is the innermost frame outside baguahvd and torch: submit() here.
            tensor = torch.ones(1)
            with pytest.raises(MismatchError) as info:
                if rank == BAD:
                    engine.submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [tensor]).wait()
                else:
                    engine.submit(OpType.ALLREDUCE, "allreduce", 0, [tensor], [tensor]).wait()
            return str(info.value)

        messages = job.run(body)
        assert len(set(messages)) == 1
        message = messages[0]
        assert "different call sites" in message
        assert f"rank 0 called allreduce.noname.0 at {__file__}:" in message
        assert f"rank {BAD} called allreduce.noname.0 at {__file__}:" in message

        def same_line(rank: int, engine: Engine) -> float:
            return _value(_allreduce(engine, float(rank), None))

        # The same line on every rank is no mismatch, and the ranks stay paired.
        assert job.run(same_line) == [3.0] * SIZE
    finally:
        job.close()


# -- the rules, as pure functions ----------------------------------------------------------


def _meta(rank: int, shape: tuple[int, ...] = (2,), **fields: object) -> RequestMeta:
    meta = RequestMeta(
        "noname.4", "allreduce.noname.4", OpType.ALLREDUCE, 0, rank, "float32", (shape,)
    )
    return meta._replace(**fields)


def test_a_placeholder_is_reported_before_any_mismatch() -> None:
    metas = [_meta(0), _meta(1, dtype="", shapes=(), failure="TypeError: bad"), _meta(2, (3,))]
    response = build_response(metas, (0, 1, 2), ())
    assert response.error == "allreduce.noname.4: rank 1 failed its local checks: TypeError: bad"


def test_every_failed_rank_is_named() -> None:
    metas = [_meta(0, failure="ValueError: a"), _meta(1), _meta(2, failure="ValueError: b")]
    response = build_response(metas, (0, 1, 2), ())
    assert response.error == (
        "allreduce.noname.4: rank 0 failed its local checks: ValueError: a; "
        "rank 2 failed its local checks: ValueError: b"
    )


def test_sites_are_compared_only_where_recorded() -> None:
    same = [_meta(0, site="a.py:1"), _meta(1, site="a.py:1"), _meta(2)]
    assert build_response(same, (0, 1, 2), ()).error is None
    apart = [_meta(0, site="a.py:1"), _meta(1, site="a.py:1"), _meta(2, site="b.py:7")]
    error = build_response(apart, (0, 1, 2), ()).error
    assert error is not None and "rank 0 called allreduce.noname.4 at a.py:1" in error
    assert "rank 2 called allreduce.noname.4 at b.py:7" in error
