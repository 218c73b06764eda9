"""The lifecycle (``baguahvd.engine.lifecycle.states``): the transition table, and how an
abort is announced."""

from __future__ import annotations

import logging

import pytest

from baguahvd.engine.lifecycle.states import (
    ABNORMAL_STATES,
    RUNNING_STATES,
    Event,
    State,
    transition,
)


def test_every_state_answers_every_event() -> None:
    for state in State:
        for event in Event:
            assert isinstance(transition(state, event), State)


def test_cycles_alternate_while_running_and_change_nothing_once_stopped() -> None:
    assert transition(State.IDLE, Event.BEGIN_CYCLE) is State.NEGOTIATING
    assert transition(State.NEGOTIATING, Event.END_CYCLE) is State.IDLE
    for state in set(State) - RUNNING_STATES:
        assert transition(state, Event.BEGIN_CYCLE) is state
        assert transition(state, Event.END_CYCLE) is state


def test_stopping_only_gets_worse() -> None:
    for state in RUNNING_STATES:
        assert transition(state, Event.STOP) is State.STOPPED
        assert transition(state, Event.FAIL) is State.FAILED
        assert transition(state, Event.LOSE_MPI) is State.STUCK
    assert transition(State.STOPPED, Event.FAIL) is State.FAILED
    assert transition(State.FAILED, Event.STOP) is State.FAILED
    assert transition(State.FAILED, Event.LOSE_MPI) is State.STUCK
    assert transition(State.STUCK, Event.FAIL) is State.STUCK
    for state in ABNORMAL_STATES:
        for event in (Event.STOP, Event.FAIL):
            assert transition(state, event) in ABNORMAL_STATES


def test_leaving_is_final() -> None:
    for state in State:
        assert transition(state, Event.LEAVE) is State.LEAVING
    for event in Event:
        assert transition(State.LEAVING, event) is State.LEAVING


def test_an_abort_is_logged_with_the_transport_that_ends_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from baguahvd.backends.gloo.control import GlooControlPlane
    from baguahvd.backends.mpi.control import MPIControlPlane
    from baguahvd.engine.lifecycle.states import Lifecycle

    codes: list[int] = []

    class Control:
        abort_name = GlooControlPlane.abort_name

        def abort(self, code: int) -> None:
            codes.append(code)

    lifecycle = Lifecycle(0, 2, Control(), 1.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="baguahvd"):
        lifecycle.abort("rank 1 was lost")
    assert codes == [1]
    assert "ending the job with a gloo abort" in caplog.text
    assert "MPI_Abort" not in caplog.text
    assert MPIControlPlane.abort_name == "MPI_Abort"
