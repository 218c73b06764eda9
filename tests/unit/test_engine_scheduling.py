"""The engine thread's requests to the scheduler (``baguahvd.engine.scheduling``): a short
slice under the default policy, its nice value kept, other policies left alone. Each check
runs in a thread of its own, as the settings are per thread."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Callable
from typing import Any

import pytest

from baguahvd.engine import scheduling

NUMBER = scheduling._SCHED_SETATTR.get(platform.machine())

pytestmark = pytest.mark.skipif(
    NUMBER is None or not hasattr(os, "sched_setscheduler"),
    reason="sched_setattr is known here for Linux on x86_64, aarch64, riscv64, ppc64le, s390x",
)


def _attr() -> tuple[int, ...]:
    """The calling thread's ``struct sched_attr``."""
    assert NUMBER is not None
    buffer = ctypes.create_string_buffer(scheduling._ATTR.size)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(NUMBER + 1, 0, buffer, scheduling._ATTR.size, 0) == 0
    return scheduling._ATTR.unpack(buffer.raw)


def _in_thread(body: Callable[[], Any]) -> Any:
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(body())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return results[0]


def _slices_supported() -> bool:
    """Whether this kernel keeps a fair thread's requested slice (Linux 6.12 and later)."""

    def probe() -> int:
        scheduling.prompt_wakeups()
        return _attr()[5]

    return _in_thread(probe) == scheduling.SLICE_NS


def test_the_engine_thread_gets_a_short_slice_and_keeps_its_nice_value() -> None:
    if not _slices_supported():
        pytest.skip("this kernel does not take a fair thread's slice (Linux < 6.12)")

    def body() -> tuple[tuple[int, ...], int]:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 3)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        scheduling.prompt_wakeups()
        return _attr(), nice

    attr, nice = _in_thread(body)
    assert attr[1] == 0 and attr[5] == scheduling.SLICE_NS
    assert attr[3] == nice
    # Only the calling thread changed.
    assert _attr()[5] != scheduling.SLICE_NS


def test_another_policy_and_a_shorter_slice_are_left_alone() -> None:
    if not _slices_supported():
        pytest.skip("this kernel does not take a fair thread's slice (Linux < 6.12)")
    libc = ctypes.CDLL(None, use_errno=True)
    assert NUMBER is not None

    def batch() -> tuple[int, ...]:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        assert not scheduling._shorten_slice(libc, NUMBER, scheduling.SLICE_NS)
        return _attr()

    assert _in_thread(batch)[1] == os.SCHED_BATCH

    def shorter() -> tuple[bool, tuple[int, ...]]:
        assert scheduling._shorten_slice(libc, NUMBER, scheduling.SLICE_NS)
        return scheduling._shorten_slice(libc, NUMBER, 2 * scheduling.SLICE_NS), _attr()

    changed, attr = _in_thread(shorter)
    assert not changed and attr[5] == scheduling.SLICE_NS
