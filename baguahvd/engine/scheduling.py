"""What the engine thread asks of the operating system's scheduler: to be woken on time.

The engine thread computes little, but every step of a collective waits on one of its
wake-ups (a submission, a poll of the other ranks, a transfer that ended). Where the
training threads keep every core busy, as ranks sharing a machine's cores do, a wake-up can
wait for a whole scheduler slice of one of them. Both settings here are per thread, need no
privilege, and leave the thread's share of the CPU unchanged; where the kernel lacks them
nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import struct

logger = logging.getLogger(__name__)

TIMER_SLACK_NS = 1
"""The engine thread's timer slack: Linux rounds short sleeps up by 50 us by default, which
is most of a small collective's latency."""

SLICE_NS = 100_000
"""The scheduler slice the engine thread requests (Linux 6.12 and later, whose EEVDF
scheduler takes a fair thread's ``sched_runtime`` as its slice; the default is 0.7-3 ms).
A thread with a shorter slice gets an earlier deadline, so its wake-ups preempt a training
thread instead of waiting for that thread's slice to end. On the emulated 2-host cluster
(``benchmarks/bucket_timeline.py``, two ranks on two cores) the first gradient bucket
started 1.0-6.2 ms after the later rank handed it over with the default slice, 1.1-2.6 ms
with this one (two alternated pairs of runs,
``benchmarks/results/bucket_timeline/wakeups/timeline_1gbit_slice_ab.txt``)."""

_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "riscv64": 274, "ppc64le": 355, "s390x": 345}
"""``sched_setattr``'s system call number per machine (``sched_getattr`` is the next)."""

_SCHED_OTHER = 0
_ATTR = struct.Struct("IIQiIQQQ")
"""``struct sched_attr`` as of its first version (48 bytes): size, policy, flags, nice,
priority, runtime, deadline, period."""


def prompt_wakeups() -> None:
    """Tightens the calling thread's timer slack and shortens its scheduler slice, where
    the kernel supports it (the engine thread calls it once, as it starts)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_timerslack = 29
        libc.prctl(pr_set_timerslack, TIMER_SLACK_NS, 0, 0, 0)
        number = _SCHED_SETATTR.get(platform.machine())
        if number is not None:
            _shorten_slice(libc, number, SLICE_NS)
    except (OSError, AttributeError):  # not Linux: no prctl, no sched_setattr
        pass


def _shorten_slice(libc: ctypes.CDLL, setattr_number: int, slice_ns: int) -> bool:
    """Sets the calling thread's slice to ``slice_ns`` when it runs under the default
    policy with a longer one, keeping its nice value; returns whether it did."""
    current = ctypes.create_string_buffer(_ATTR.size)
    if libc.syscall(setattr_number + 1, 0, current, _ATTR.size, 0) != 0:
        return False
    _, policy, _, nice, _, runtime, _, _ = _ATTR.unpack(current.raw)
    if policy != _SCHED_OTHER or (runtime and runtime <= slice_ns):
        return False
    wanted = _ATTR.pack(_ATTR.size, _SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0)
    if libc.syscall(setattr_number, 0, ctypes.c_char_p(wanted), 0) != 0:
        logger.debug("the engine thread keeps its scheduler slice (errno %d)",
                     ctypes.get_errno())
        return False
    return True
