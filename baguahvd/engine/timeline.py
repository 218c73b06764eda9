"""Horovod's timeline: what happened to every collective, as a Chrome trace.

Rank 0 writes one JSON array of trace events (open it in ``chrome://tracing`` or Perfetto).
Each tensor name is a "process" of the trace; its rows show Horovod's activities:

* ``NEGOTIATE_<OP>`` while rank 0 waits for every member to submit it (a tick per rank
  that submits; for requests answered from the response cache, from rank 0's own
  submission until every member has announced it);
* ``<OP>`` (``ALLREDUCE``, ``ALLGATHER``...) from the agreement until the result is in
  place, with the sub-activities ``QUEUE`` (behind other collectives of the same cycle),
  ``MEMCPY_IN_FUSION_BUFFER``, ``MPI_<OP>`` or ``NCCL_<OP>`` and
  ``MEMCPY_OUT_FUSION_BUFFER``;
* ``BAGUA_<ALGORITHM>`` (e.g. ``BAGUA_BYTEGRAD``) around the collectives that a Bagua
  algorithm issues (requests submitted inside the engine's ``activity`` block);
* with ``HOROVOD_TIMELINE_MARK_CYCLES``, a global ``CYCLE_START`` mark at every cycle that
  negotiated or ran something (idle cycles, a thousand a second, are left out).

The file stays valid JSON while it grows: a writer thread appends the events every 100 ms
and ends the array with ``]`` each time, overwriting that bracket at the next write. A
process killed mid-write can leave a truncated last write; Chrome's trace viewer accepts a
missing closing bracket, and readers can append ``]`` (after dropping a trailing comma)
as the tests do.

Recording can be limited to a window of optimizer steps (``BAGUAHVD_TIMELINE_START_STEP``
and ``BAGUAHVD_TIMELINE_END_STEP``): a step is one ``step()`` call of any torch optimizer
in rank 0's process.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from baguahvd.engine.messages import OpType

logger = logging.getLogger("baguahvd.engine")

_FLUSH_INTERVAL_S = 0.1
_TAIL = "\n]\n"


def negotiate_activity(op: OpType) -> str:
    return f"NEGOTIATE_{op.label}"


def transport_activity(op: OpType, device: str) -> str:
    """``MPI_ALLREDUCE`` or ``NCCL_ALLREDUCE``: the library that moves the data."""
    return f"{'MPI' if device == 'CPU' else 'NCCL'}_{op.label}"


class _TraceFile:
    """A JSON array of events on disk that a background thread appends to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._body_end = 0
        self._empty = True
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="baguahvd-timeline", daemon=True
        )
        self._thread.start()

    def put(self, event: dict[str, Any]) -> None:
        self._pending.append(event)

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        self._file.close()

    def _loop(self) -> None:
        while not self._closing.wait(_FLUSH_INTERVAL_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        events = []
        while self._pending:
            events.append(self._pending.popleft())
        if not events and not self._empty:
            return
        body = ",\n".join(json.dumps(event, separators=(", ", ": ")) for event in events)
        try:
            if self._empty:
                self._file.write("[\n" + body)
                self._empty = False
            else:
                self._file.seek(self._body_end)
                if body:
                    self._file.write(",\n" + body)
            self._body_end = self._file.tell()
            self._file.write(_TAIL)
            self._file.flush()
        except OSError as exc:
            logger.error("could not write the timeline %s: %s", self.path, exc)
            self._closing.set()


class _StepCounter:
    """Counts optimizer steps through torch's global step hooks. An optimizer whose
    ``step()`` calls its base class's (wrapped too) counts once."""

    def __init__(self) -> None:
        self.steps = 0
        self._depth = 0
        self._hooks = [
            register_optimizer_step_pre_hook(self._enter),
            register_optimizer_step_post_hook(self._leave),
        ]

    def _enter(self, *_: Any) -> None:
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.steps += 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class Timeline:
    """Rank 0's trace of the collectives (see module docstring). Thread-safe: the engine
    thread records, user threads start and stop it and run single-member collectives.

    Args:
        start_step: record once this many optimizer steps have completed.
        end_step: stop recording at this many completed steps; 0 never.
    """

    def __init__(self, start_step: int = 0, end_step: int = 0) -> None:
        self._lock = threading.Lock()
        self._file: _TraceFile | None = None
        self.mark_cycles = False
        self._start_step = start_step
        self._end_step = end_step
        self._steps = _StepCounter() if start_step > 0 or end_step > 0 else None
        self._origin = 0.0
        self._pids: dict[str, int] = {}
        self._open: dict[str, list[str]] = {}
        """Per tensor, the activities begun and not yet ended, outermost first."""

    # -- control --------------------------------------------------------------------------

    def start(self, path: str, mark_cycles: bool = False) -> None:
        """Starts writing ``path`` (closing a file being written)."""
        trace = _TraceFile(os.fspath(path))
        with self._lock:
            previous, self._file = self._file, trace
            self.mark_cycles = mark_cycles
            self._origin = time.perf_counter()
            self._pids.clear()
            self._open.clear()
            trace.put({
                "name": "process_name",
                "ph": "M",
                "pid": 0,
                "args": {"start_time_since_epoch_in_micros": int(time.time() * 1e6)},
            })
            trace.put(
                {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}
            )
        if previous is not None:
            previous.close()

    def stop(self) -> None:
        """Ends the array and closes the file; a later :meth:`start` opens a new one."""
        with self._lock:
            trace, self._file = self._file, None
            self._open.clear()
        if trace is not None:
            trace.close()

    def close(self) -> None:
        """Stops and forgets the step hooks (at engine shutdown)."""
        self.stop()
        if self._steps is not None:
            self._steps.remove()
            self._steps = None

    @property
    def recording(self) -> bool:
        """Whether events are written now: a file is open and the step window is open."""
        if self._file is None:
            return False
        if self._steps is None:
            return True
        steps = self._steps.steps
        return steps >= self._start_step and (self._end_step == 0 or steps < self._end_step)

    @property
    def active(self) -> bool:
        """Whether a file is open (cheap test before building events)."""
        return self._file is not None

    # -- events, by what happens to a tensor ------------------------------------------------

    def negotiation_started(self, name: str, op: OpType) -> None:
        with self._lock:
            if name not in self._open and self.recording:
                self._begin(name, negotiate_activity(op))

    def rank_ready(self, name: str, rank: int) -> None:
        with self._lock:
            if self._file is not None and name in self._open:
                self._file.put(
                    {"ph": "X", "name": str(rank), "ts": self._now(), "dur": 0,
                     "pid": self._pid(name)}
                )

    def negotiation_ended(self, name: str, op: OpType) -> None:
        with self._lock:
            stack = self._open.get(name)
            if stack and stack[-1] == negotiate_activity(op):
                self._end(name)

    def queued(self, name: str, op: OpType, activity: str | None = None) -> None:
        """The collective is agreed and waits for its turn in the cycle; ``activity`` (the
        request's, e.g. ``BAGUA_BYTEGRAD``) is drawn around it."""
        with self._lock:
            stack = self._open.get(name)
            if stack is None:
                if not self.recording:
                    return
            elif stack and stack[-1] == negotiate_activity(op):
                self._end(name)
            if activity is not None:
                self._begin(name, activity)
            self._begin(name, op.label)
            self._begin(name, "QUEUE")

    def phase(self, name: str, activity: str) -> None:
        """Ends the tensor's current sub-activity and begins ``activity``."""
        with self._lock:
            stack = self._open.get(name)
            if not stack:
                return
            if _is_sub_activity(stack[-1]):
                self._end(name)
            self._begin(name, activity)

    def done(self, name: str, args: dict[str, Any] | None = None) -> None:
        """Ends every open activity of ``name``; ``args`` go on the collective's end."""
        with self._lock:
            stack = self._open.get(name)
            while stack:
                last = len(stack) == 1
                self._end(name, args if last else None)
                stack = self._open.get(name)

    def cycle_started(self) -> None:
        with self._lock:
            if self.mark_cycles and self._file is not None and self.recording:
                self._file.put({"name": "CYCLE_START", "ph": "i", "ts": self._now(), "s": "g"})

    # -- helpers (lock held) --------------------------------------------------------------

    def _now(self) -> int:
        return int((time.perf_counter() - self._origin) * 1e6)

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None and self._file is not None:
            pid = self._pids[name] = len(self._pids) + 1
            self._file.put(
                {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
            )
            self._file.put(
                {"name": "process_sort_index", "ph": "M", "pid": pid,
                 "args": {"sort_index": pid}}
            )
        return pid or 0

    def _begin(self, name: str, activity: str) -> None:
        if self._file is None:
            return
        pid = self._pid(name)
        self._file.put({"ph": "B", "name": activity, "ts": self._now(), "pid": pid})
        self._open.setdefault(name, []).append(activity)

    def _end(self, name: str, args: dict[str, Any] | None = None) -> None:
        stack = self._open.get(name)
        if not stack:
            return
        stack.pop()
        if not stack:
            del self._open[name]
        if self._file is None:
            return
        event: dict[str, Any] = {"ph": "E", "ts": self._now(), "pid": self._pid(name)}
        if args:
            event["args"] = args
        self._file.put(event)


_SUB_ACTIVITIES = ("QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER")


def _is_sub_activity(activity: str) -> bool:
    return activity in _SUB_ACTIVITIES or activity.startswith(("MPI_", "NCCL_"))
