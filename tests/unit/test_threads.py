"""``horovod.runner.util.threads`` under the shim: thread helpers with Horovod's signatures."""

from __future__ import annotations

import threading

import pytest

from baguahvd.compat.runner_threads import execute_function_multithreaded, in_thread, on_event


def test_in_thread_starts_a_daemon_thread_running_the_target() -> None:
    seen: list[int] = []
    thread = in_thread(seen.append, args=(7,), name="worker")
    thread.join(5)
    assert seen == [7]
    assert thread.daemon and thread.name == "worker"


def test_in_thread_silent_swallows_the_error() -> None:
    def fail() -> None:
        raise RuntimeError("boom")

    thread = in_thread(fail, silent=True)
    thread.join(5)
    assert not thread.is_alive()


def test_in_thread_rejects_args_that_are_not_a_sequence() -> None:
    with pytest.raises(ValueError, match="tuple or list"):
        in_thread(print, args="x")  # type: ignore[arg-type]


def test_on_event_calls_once_the_event_is_set() -> None:
    event = threading.Event()
    seen: list[str] = []
    thread = on_event(event, seen.append, args=("fired",))
    assert seen == []
    event.set()
    thread.join(5)
    assert seen == ["fired"]


def test_on_event_does_not_call_after_stop() -> None:
    event, stop = threading.Event(), threading.Event()
    seen: list[str] = []
    thread = on_event(
        event, seen.append, args=("fired",), stop=stop, check_stop_interval_s=0.01, daemon=False
    )
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and not thread.daemon and seen == []


def test_execute_function_multithreaded_returns_results_by_index() -> None:
    results = execute_function_multithreaded(
        lambda a, b: a * b, [(1, 2), (3, 4), (5, 6)], max_concurrent_executions=2
    )
    assert results == {0: 2, 1: 12, 2: 30}
    assert execute_function_multithreaded(pow, [(2, 3)], block_until_all_done=False) is None
