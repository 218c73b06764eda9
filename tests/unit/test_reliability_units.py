"""Reliability and observability parts that need no MPI: end-of-job notices, the stall
inspector's reports, the watchdog's liveness checks, the timeline file and the log lines.

The multi-rank behaviour (a stall, a failing or killed rank) is in
``tests/e2e/test_reliability.py``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from baguahvd.common.config import Config
from baguahvd.common.exceptions import (
    SHUT_DOWN_MESSAGE,
    HorovodInternalError,
    PeerFailureError,
    ShutDownError,
    StallError,
)
from baguahvd.common.logging_setup import TRACE, _RankFormatter, configure
from baguahvd.engine.lifecycle.watchdog import Watchdog, is_gone, process_identity
from baguahvd.engine.messages import OpType, RequestMeta
from baguahvd.engine.negotiation.stall import StallInspector
from baguahvd.engine.notices import Notice, NoticeKind, describe_exception, first_notice
from baguahvd.engine.process_sets import ProcessSetState
from baguahvd.engine.requests import Request
from baguahvd.engine.timeline import Timeline
from tests.support.jobs import run_one_rank

# ---------------------------------------------------------------------------------------
# Notices: how the end of a job is named on every rank


def test_failures_win_over_stalls_and_shutdowns_then_the_lowest_rank() -> None:
    shutdown = Notice(NoticeKind.SHUTDOWN, 0)
    stall = Notice(NoticeKind.STALL, 0, "stalled")
    failure_2 = Notice(NoticeKind.FAILURE, 2, "ValueError: b")
    failure_1 = Notice(NoticeKind.FAILURE, 1, "ValueError: a")
    assert first_notice([None, shutdown, stall, failure_2, failure_1]) == failure_1
    assert first_notice([shutdown, stall]) == stall
    assert first_notice([None, None]) is None


def test_a_failure_becomes_a_peer_failure_error_with_rank_and_reason() -> None:
    error = Notice(NoticeKind.FAILURE, 1, "ValueError: boom").error(own_rank=0)
    assert isinstance(error, PeerFailureError)
    assert isinstance(error, ShutDownError) and isinstance(error, HorovodInternalError)
    assert (error.rank, error.reason) == (1, "ValueError: boom")
    assert str(error).startswith("rank 1 failed: ValueError: boom")
    assert "has been shut down" in str(error)


def test_a_peer_shutdown_names_the_rank_but_ones_own_does_not() -> None:
    notice = Notice(NoticeKind.SHUTDOWN, 1)
    assert str(notice.error(own_rank=0)) == f"{SHUT_DOWN_MESSAGE} (rank 1 shut down)"
    assert str(notice.error(own_rank=1)) == SHUT_DOWN_MESSAGE
    assert not notice.abnormal


def test_a_stall_becomes_a_stall_error_naming_tensors_and_ranks() -> None:
    notice = Notice(NoticeKind.STALL, 0, "stalled: allreduce.x", (("allreduce.x", (1, 2)),))
    error = notice.error(own_rank=2)
    assert isinstance(error, StallError) and isinstance(error, HorovodInternalError)
    assert error.missing == {"allreduce.x": [1, 2]}
    assert "stalled: allreduce.x" in str(error)
    assert notice.abnormal


def test_describe_exception_names_type_message_and_place() -> None:
    try:
        raise ValueError("bad batch")
    except ValueError as exc:
        text = describe_exception(exc)
    assert text.startswith("ValueError: bad batch (at ")
    assert "test_reliability_units.py" in text
    assert describe_exception(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert len(describe_exception(RuntimeError("x" * 10_000))) == 2000


# ---------------------------------------------------------------------------------------
# Stall inspector


def _meta(name: str, rank: int, process_set_id: int = 0) -> RequestMeta:
    return RequestMeta(key=name, name=name, op=OpType.ALLREDUCE,
                       process_set_id=process_set_id, rank=rank)


def _sets(size: int) -> dict[int, ProcessSetState]:
    return {0: ProcessSetState(0, tuple(range(size)), None),
            1: ProcessSetState(1, (0, 2), None)}


def test_stall_report_uses_horovods_words_and_lists_missing_ranks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inspector = StallInspector(warning_s=2.0, shutdown_s=0.0, disabled=False)
    table = {
        (0, "allreduce.a"): {0: _meta("allreduce.a", 0)},
        (0, "allreduce.b"): {1: _meta("allreduce.b", 1), 2: _meta("allreduce.b", 2)},
        (1, "allreduce.c"): {2: _meta("allreduce.c", 2, 1)},
        (0, "allreduce.fresh"): {0: _meta("allreduce.fresh", 0)},
    }
    for ident in table:
        inspector.seen(ident, 100.0 if ident[1] != "allreduce.fresh" else 109.0)
    with caplog.at_level(logging.WARNING, logger="baguahvd.engine"):
        assert inspector.check(table, _sets(3), joined=(), now=110.0) is None
    (record,) = caplog.records
    report = record.getMessage()
    assert report.startswith(
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset "
        "of ranks and are waiting for remainder of ranks for more than 2 seconds."
    )
    assert "\nMissing ranks:\n0: [allreduce.b, allreduce.c]\n1: [allreduce.a]\n" \
           "2: [allreduce.a]\n" in report
    assert "allreduce.a: [1, 2]" in report and "allreduce.c: [0]" in report
    assert "allreduce.fresh" not in report
    # Reported again only after another warning period.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="baguahvd.engine"):
        inspector.check(table, _sets(3), joined=(), now=111.0)
        assert not caplog.records
        inspector.check(table, _sets(3), joined=(), now=112.5)
        assert len(caplog.records) == 1


def test_stall_past_the_shutdown_time_returns_a_notice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inspector = StallInspector(warning_s=1.0, shutdown_s=5.0, disabled=False)
    table = {(0, "allreduce.a"): {0: _meta("allreduce.a", 0)},
             (0, "allreduce.b"): {1: _meta("allreduce.b", 1)}}
    inspector.seen((0, "allreduce.a"), 0.0)
    inspector.seen((0, "allreduce.b"), 4.0)
    assert inspector.check(table, _sets(2), joined=(), now=4.5) is None
    with caplog.at_level(logging.ERROR, logger="baguahvd.engine"):
        notice = inspector.check(table, _sets(2), joined=(), now=5.5)
    assert notice is not None and notice.kind == NoticeKind.STALL
    assert notice.missing == (("allreduce.a", (1,)),)
    assert "allreduce.a waits for ranks [1]" in notice.text
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in notice.text
    report = caplog.records[-1].getMessage()
    assert "\n1!: [allreduce.a]" in report and "\n0: [allreduce.b]" in report
    assert report.endswith('One or more rank (marked by "!") is stalled for longer than 5 '
                           "seconds. Will shutdown.")


def test_joined_ranks_are_not_missing() -> None:
    inspector = StallInspector(warning_s=1.0, shutdown_s=2.0, disabled=False)
    table = {(0, "allreduce.a"): {0: _meta("allreduce.a", 0)}}
    inspector.seen((0, "allreduce.a"), 0.0)
    assert inspector.check(table, _sets(2), joined=[1], now=10.0) is None


def test_shutdown_time_below_the_warning_time_turns_shutdown_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="baguahvd.engine"):
        inspector = StallInspector(warning_s=60.0, shutdown_s=5.0, disabled=False)
    assert inspector.shutdown_s == 0.0
    assert "will not shutdown" in caplog.text


def test_cached_requests_waiting_too_long_are_invalidated() -> None:
    inspector = StallInspector(warning_s=2.0, shutdown_s=0.0, disabled=False)
    old, new = Request(_meta("a", 0), [], None), Request(_meta("b", 0), [], None)
    old.submitted, new.submitted = 10.0, 11.5
    assert inspector.stale_cache_waits({3: old, 7: new}, now=12.5) == [3]


def test_disabled_inspector_never_checks() -> None:
    inspector = StallInspector(warning_s=1.0, shutdown_s=2.0, disabled=True)
    assert not inspector.due(time.monotonic())
    enabled = StallInspector(warning_s=1.0, shutdown_s=2.0, disabled=False)
    now = time.monotonic()
    assert enabled.due(now) and not enabled.due(now + 0.1) and enabled.due(now + 1.0)


# ---------------------------------------------------------------------------------------
# Watchdog


def test_a_dead_process_is_gone_and_a_live_one_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = _identity_of(child.pid)
        assert not is_gone(child.pid, ident)
        child.kill()
        # Not yet reaped: a zombie counts as gone.
        deadline = time.monotonic() + 10
        while not is_gone(child.pid, ident) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_gone(child.pid, ident)
    finally:
        child.kill()
        child.wait()
    assert is_gone(child.pid, ident)
    # A pid now used by another process (different start time) is gone too.
    me = process_identity()
    assert not is_gone(me[0], me[1])
    assert is_gone(me[0], me[1] + 1) or me[1] == 0


def _identity_of(pid: int) -> int:
    from baguahvd.engine.lifecycle.watchdog import _start_time

    return _start_time(pid)


def test_the_watchdog_looks_for_alarms_while_the_engine_makes_progress() -> None:
    # The engine thread may sit in a collective that a failed peer never joins: only the
    # watchdog can then pick up that peer's alarm, so it looks every tick, stuck or not.
    polls: list[float] = []
    failures: list[tuple[int, str]] = []
    cycles = iter(range(1_000_000))
    watchdog = Watchdog(0, [process_identity()], lambda: next(cycles),
                        lambda rank, why: failures.append((rank, why)), timeout_s=0.0,
                        poll=lambda: polls.append(time.monotonic()))
    watchdog.start()
    deadline = time.monotonic() + 10
    while len(polls) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    watchdog.stop()
    assert len(polls) >= 3 and not failures


def test_a_failing_alarm_check_does_not_stop_the_watchdog(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("MPI is gone")

    ticks: list[int] = []

    def progress() -> int:
        ticks.append(1)
        return len(ticks)

    watchdog = Watchdog(0, [process_identity()], progress, lambda rank, why: None,
                        timeout_s=0.0, poll=broken)
    with caplog.at_level(logging.ERROR, logger="baguahvd.engine"):
        watchdog.start()
        deadline = time.monotonic() + 10
        while len(ticks) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        watchdog.stop()
    # Looked once, then went on watching the cycles without it.
    assert calls == [1] and len(ticks) >= 4
    assert "failed to look for alarms" in caplog.text


# ---------------------------------------------------------------------------------------
# Timeline


def load_trace(path: Path) -> list[dict[str, Any]]:
    """Parses a timeline, closing an array that a killed writer left open."""
    text = path.read_text().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events: list[dict[str, Any]] = json.loads(text)
    return events


def _names(events: list[dict[str, Any]]) -> list[str]:
    return [e.get("name", "") for e in events]


def test_timeline_file_is_valid_json_while_it_grows_and_after_stop(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    timeline = Timeline()
    timeline.start(str(path), mark_cycles=True)
    name = "allreduce.grad"
    timeline.cycle_started()
    timeline.negotiation_started(name, OpType.ALLREDUCE)
    timeline.rank_ready(name, 0)
    timeline.rank_ready(name, 1)
    timeline.queued(name, OpType.ALLREDUCE)
    time.sleep(0.3)
    # Mid-run, after a flush: already a complete JSON array.
    events = json.loads(path.read_text())
    assert "NEGOTIATE_ALLREDUCE" in _names(events)
    timeline.phase(name, "MEMCPY_IN_FUSION_BUFFER")
    timeline.phase(name, "MPI_ALLREDUCE")
    timeline.phase(name, "MEMCPY_OUT_FUSION_BUFFER")
    timeline.done(name, {"dtype": "float32", "shape": "[[4]]"})
    timeline.stop()
    events = json.loads(path.read_text())
    names = _names(events)
    for activity in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER",
                     "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER", "CYCLE_START", "0", "1"):
        assert activity in names, activity
    assert events[0]["args"]["start_time_since_epoch_in_micros"] > 1.6e15
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": name}} in events
    # Every begin has its end, in order, on the tensor's row.
    phases = [e["ph"] for e in events if e.get("pid") == 1 and e["ph"] in "BE"]
    assert phases.count("B") == phases.count("E") == 6
    assert events[-1]["ph"] == "E" and events[-1]["args"]["dtype"] == "float32"
    stamps = [e["ts"] for e in events if "ts" in e]
    assert stamps == sorted(stamps)


def test_a_truncated_timeline_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    timeline = Timeline()
    timeline.start(str(path))
    timeline.queued("allreduce.x", OpType.ALLREDUCE)
    timeline.done("allreduce.x")
    timeline.stop()
    text = path.read_text()
    cut = text.rstrip().rstrip("]").rstrip() + ",\n"
    (tmp_path / "cut.json").write_text(cut)
    assert load_trace(tmp_path / "cut.json") == json.loads(text)


def test_restarting_the_timeline_starts_a_new_file(tmp_path: Path) -> None:
    timeline = Timeline()
    timeline.start(str(tmp_path / "a.json"))
    timeline.queued("allreduce.x", OpType.ALLREDUCE)
    timeline.start(str(tmp_path / "b.json"))
    timeline.queued("allreduce.y", OpType.ALLREDUCE)
    timeline.done("allreduce.y")
    timeline.close()
    first = json.loads((tmp_path / "a.json").read_text())
    second = json.loads((tmp_path / "b.json").read_text())
    assert any(e.get("args", {}).get("name") == "allreduce.x" for e in first)
    assert not any(e.get("args", {}).get("name") == "allreduce.x" for e in second)
    assert any(e.get("args", {}).get("name") == "allreduce.y" for e in second)
    # Stopped: nothing is recorded, and stopping twice is harmless.
    timeline.queued("allreduce.z", OpType.ALLREDUCE)
    timeline.stop()
    assert not timeline.active


def test_bagua_activity_wraps_the_collective(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    timeline = Timeline()
    timeline.start(str(path))
    name = "alltoall.bagua.bytegrad.bucket0.alltoall"
    timeline.queued(name, OpType.ALLTOALL, "BAGUA_BYTEGRAD")
    # The activity comes from the request, not from the name.
    timeline.queued("allreduce.bagua.bytegrad.other", OpType.ALLREDUCE)
    timeline.phase(name, "MPI_ALLTOALL")
    timeline.done(name)
    timeline.stop()
    begins = [e["name"] for e in json.loads(path.read_text()) if e["ph"] == "B"]
    assert begins == ["BAGUA_BYTEGRAD", "ALLTOALL", "QUEUE", "ALLREDUCE", "QUEUE", "MPI_ALLTOALL"]


def test_step_window_records_only_between_the_steps(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    timeline = Timeline(start_step=2, end_step=3)
    try:
        timeline.start(str(path))
        parameter = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([parameter], lr=0.1)
        for step in range(5):
            name = f"allreduce.step{step}"
            timeline.queued(name, OpType.ALLREDUCE)
            timeline.done(name)
            parameter.grad = torch.ones(2)
            optimizer.step()
        timeline.stop()
    finally:
        timeline.close()
    rows = {e["args"]["name"] for e in json.loads(path.read_text())
            if e.get("name") == "process_name" and "name" in e.get("args", {})}
    assert rows == {"allreduce.step2"}


# ---------------------------------------------------------------------------------------
# Logging


def _record(level: int, message: str = "hello") -> logging.LogRecord:
    record = logging.LogRecord("baguahvd.engine", level, "/x/stall.py", 42, message, None,
                               None)
    record.module = "stall"
    record.created = 1_700_000_000.123456
    return record


def test_log_lines_have_horovods_shape_with_the_rank() -> None:
    line = _RankFormatter(rank=3, hide_time=False).format(_record(logging.WARNING))
    assert line.endswith(".123456: W rank 3 stall.py:42] hello")
    assert line.startswith("[20")
    hidden = _RankFormatter(rank=3, hide_time=True).format(_record(logging.WARNING))
    assert hidden == "[W rank 3 stall.py:42] hello"
    letters = [_RankFormatter(0, True).format(_record(level))[1]
               for level in (TRACE, logging.DEBUG, logging.INFO, logging.WARNING,
                             logging.ERROR, logging.CRITICAL)]
    assert letters == ["T", "D", "I", "W", "E", "F"]


@pytest.mark.parametrize(("level", "expected"), [
    ("trace", TRACE), ("debug", logging.DEBUG), ("info", logging.INFO),
    ("warning", logging.WARNING), ("error", logging.ERROR), ("fatal", logging.CRITICAL),
])
def test_log_level_names(level: str, expected: int) -> None:
    logger = logging.getLogger("baguahvd")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    try:
        configure(rank=0, level=level, hide_time=True)
        assert logger.level == expected
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]


def test_config_reads_the_reliability_settings() -> None:
    config = Config.from_env({
        "HOROVOD_LOG_LEVEL": "Trace",
        "HOROVOD_LOG_HIDE_TIME": "1",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0",
        "BAGUAHVD_TIMELINE_START_STEP": "10",
        "BAGUAHVD_TIMELINE_END_STEP": "12",
        "BAGUAHVD_PEER_TIMEOUT_SECONDS": "30",
        "BAGUAHVD_EXIT_TIMEOUT_SECONDS": "5",
    })
    assert (config.log_level, config.log_hide_time) == ("trace", True)
    assert config.stall_shutdown_time_s == 0.0
    assert (config.timeline_start_step, config.timeline_end_step) == (10, 12)
    assert (config.peer_timeout_s, config.exit_timeout_s) == (30.0, 5.0)
    defaults = Config.from_env({})
    assert (defaults.peer_timeout_s, defaults.exit_timeout_s) == (600.0, 30.0)
    with pytest.raises(ValueError, match="HOROVOD_LOG_LEVEL"):
        Config.from_env({"HOROVOD_LOG_LEVEL": "loud"})


# ---------------------------------------------------------------------------------------
# The timeline API in a one-rank job (fresh processes: MPI starts once per process)


def test_start_timeline_needs_init_and_the_variable() -> None:
    run_one_rank(
        """
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use "
                                             r"hvd.init\\(\\).$"):
            hvd.start_timeline("t.json")
        with pytest.raises(ValueError, match="has not been initialized"):
            hvd.stop_timeline()
        hvd.init()
        with pytest.raises(ValueError, match=r"^Set HOROVOD_TIMELINE=DYNAMIC to enable "
                                             r"dynamic timeline usage.$"):
            hvd.start_timeline("t.json")
        """
    )


def test_one_rank_job_writes_the_timeline(tmp_path: Path) -> None:
    fixed = tmp_path / "from_env.json"
    dynamic = tmp_path / "dynamic.json"
    run_one_rank(
        f"""
        hvd.init()
        hvd.allreduce(torch.ones(3), name="from_env")
        hvd.stop_timeline()
        hvd.start_timeline({str(dynamic)!r}, mark_cycles=True)
        hvd.grouped_allreduce([torch.ones(3), torch.ones(2)], name="grouped")
        hvd.allgather(torch.ones(2), name="gathered")
        hvd.shutdown()
        """,
        HOROVOD_TIMELINE=str(fixed),
    )
    assert "allreduce.from_env" in fixed.read_text()
    text = dynamic.read_text()
    for part in ("grouped_allreduce.grouped", "allgather.gathered", "MPI_ALLGATHER",
                 "MEMCPY_IN_FUSION_BUFFER", "start_time_since_epoch_in_micros"):
        assert part in text, part
    json.loads(text)


def test_the_watchdog_names_the_neighbour_that_died_first() -> None:
    # Rank 2 dies; rank 1 notices, reports and ends (MPI_Abort) before this rank's watchdog
    # has waited out its second: the report must still name rank 2, not rank 1.
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = process_identity()
        identities = [me, [first.pid, _identity_of(first.pid), me[2]],
                      [second.pid, _identity_of(second.pid), me[2]]]
        failures: list[tuple[int, str]] = []
        watchdog = Watchdog(0, identities, lambda: 0,
                            lambda rank, why: failures.append((rank, why)), timeout_s=0.0)
        second.kill()
        second.wait()
        watchdog.start()
        time.sleep(0.5)  # the watchdog has seen rank 2 gone, not yet stuck for a second
        first.kill()
        first.wait()
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.02)
        watchdog.stop()
        assert [rank for rank, _ in failures] == [2], failures
        assert f"pid {second.pid}" in failures[0][1]
    finally:
        for child in (first, second):
            child.kill()
            child.wait()


def test_the_watchdog_names_a_gone_neighbour_at_once_only_once_a_collective_failed() -> None:
    # A neighbour that is gone while no collective of this rank failed may have ended
    # normally: it is named only after a second without progress. Once a collective failed
    # (gloo: the neighbour's connection closed), at once. The clock moves 10 ms a tick.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = process_identity()
        identities = [me, [child.pid, _identity_of(child.pid), me[2]]]
        child.kill()
        child.wait()
        ticks = iter(range(10**9))
        failed: list[bool] = []
        failures: list[int] = []
        watchdog = Watchdog(0, identities, lambda: 0, lambda rank, why: failures.append(rank),
                            timeout_s=0.0, failed=lambda: bool(failed),
                            clock=lambda: 0.01 * next(ticks))
        watchdog.start()
        time.sleep(0.5)
        assert failures == []
        failed.append(True)
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.02)
        watchdog.stop()
        assert failures == [1]
    finally:
        child.kill()
        child.wait()
