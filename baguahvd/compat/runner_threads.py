"""Small helpers that run functions on background threads (Horovod's ``runner.util.threads``).

Horovod's launcher, elastic driver and tests use these three calls; the shim's
``horovod.runner.util.threads`` re-exports them with the same signatures and defaults.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

_log = logging.getLogger(__name__)


def execute_function_multithreaded(
    fn: Callable[..., Any],
    args_list: Sequence[Sequence[Any]],
    block_until_all_done: bool = True,
    max_concurrent_executions: int = 1000,
) -> dict[int, Any] | None:
    """Calls ``fn(*args)`` for every entry of ``args_list`` on a pool of threads.

    Args:
        fn: the function to call.
        args_list: one argument sequence per call.
        block_until_all_done: wait for every call and return the results; otherwise start the
            threads and return ``None`` at once.
        max_concurrent_executions: the most threads running at the same time.

    Returns:
        With ``block_until_all_done``, a dict from the index in ``args_list`` to what that call
        returned; ``None`` otherwise. An exception raised by a call ends its thread (Python
        reports it there): that index, and any that thread would have run next, are missing
        from the dict.
    """
    if max_concurrent_executions < 1:
        raise ValueError(
            f"max_concurrent_executions must be at least 1, got {max_concurrent_executions}"
        )
    work: queue.Queue[tuple[int, Sequence[Any]]] = queue.Queue()
    for index, args in enumerate(args_list):
        work.put((index, args))
    results: dict[int, Any] = {}

    def worker() -> None:
        while True:
            try:
                index, args = work.get_nowait()
            except queue.Empty:
                return
            results[index] = fn(*args)

    threads = [
        in_thread(worker, daemon=True)
        for _ in range(min(max_concurrent_executions, len(args_list)))
    ]
    if not block_until_all_done:
        return None
    for thread in threads:
        thread.join()
    return results


def in_thread(
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    name: str | None = None,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Starts ``target(*args)`` on a new thread and returns the started thread.

    Args:
        target: the function to run.
        args: its positional arguments.
        name: the thread's name (default: Python's).
        daemon: whether the thread lets the interpreter exit while it runs.
        silent: swallow an exception raised by ``target`` (it is logged at debug level)
            instead of letting the thread report it.
    """
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple or list, got {type(args).__name__}")

    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise
            _log.debug("exception in thread %s", threading.current_thread().name, exc_info=True)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(
    event: threading.Event,
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    stop: threading.Event | None = None,
    check_stop_interval_s: float = 1.0,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Starts a thread that calls ``func(*args)`` once ``event`` is set.

    Args:
        event: the event to wait for.
        func: the function to call when it is set.
        args: its positional arguments.
        stop: an event that, set before ``event``, ends the thread without calling ``func``.
        check_stop_interval_s: how often ``stop`` is looked at while waiting.
        daemon: as for :func:`in_thread`.
        silent: as for :func:`in_thread`.

    Returns:
        The started thread.
    """
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple or list, got {type(args).__name__}")
    # Without a stop event there is nothing to look at while waiting.
    interval = None if stop is None else check_stop_interval_s

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    def wait_then_call() -> None:
        while not event.wait(interval):
            if stopped():
                return
        if not stopped():
            func(*args)

    return in_thread(wait_then_call, daemon=daemon, silent=silent)
