"""Where device communicators come from (``baguahvd.engine.execution.dispatch``): the
factory the engine was given, once per set."""

from __future__ import annotations

import pytest

from baguahvd.backends.base import Communicator, SelfCommunicator
from baguahvd.common.exceptions import HorovodInternalError
from baguahvd.engine.execution.dispatch import Dispatcher
from baguahvd.engine.process_sets import ProcessSetState
from tests.fakes.world import MemoryCommunicator, World


def _dispatcher(factory: object) -> Dispatcher:
    return Dispatcher(0, {}, None, factory)  # type: ignore[arg-type]


def test_a_sets_device_communicator_is_made_once_by_the_factory() -> None:
    made: list[Communicator] = []

    def factory(comm: Communicator) -> Communicator:
        made.append(comm)
        return SelfCommunicator()

    dispatcher = _dispatcher(factory)
    data = SelfCommunicator()
    state = ProcessSetState(1, (0, 1), data)
    # A group of one needs no device communicator.
    assert dispatcher.device_comm(state, data) is data and made == []
    data_comm = _pair()
    state = ProcessSetState(1, (0, 1), data_comm)
    first = dispatcher.device_comm(state, data_comm)
    assert dispatcher.device_comm(state, data_comm) is first
    assert made == [data_comm] and state.device_comm is first


def test_without_a_factory_device_collectives_fail_with_a_reason() -> None:
    comm = _pair()
    with pytest.raises(HorovodInternalError, match="without device communicators"):
        _dispatcher(None).device_comm(ProcessSetState(1, (0, 1), comm), comm)


def _pair() -> Communicator:
    """A data communicator of two ranks (never used for data here)."""
    return MemoryCommunicator(World(2), ("pair",), (0, 1), 0)
