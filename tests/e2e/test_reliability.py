"""Jobs that go wrong end, quickly and with the reason, instead of hanging.

Each test runs a whole script under mpirun (:func:`tests.support.jobs.launch` collects every
rank's log) and bounds the job's duration twice: a hard timeout on the launch (a hang fails
with the logs attached) and an assertion on the measured time. The scripts print markers
that the assertions look for.
"""

from __future__ import annotations

import json
import pathlib
import re
import time

import pytest

from tests.support.failing_jobs import (
    FAST_FAILURE,
    STARTUP_SLACK_S,
    joined_logs,
    run_script,
)

# ---------------------------------------------------------------------------------------
# Stalls


@pytest.mark.parallel
@pytest.mark.parametrize("cached", [False, True], ids=["negotiated", "cached"])
def test_a_rank_that_sleeps_past_the_stall_time_ends_the_job(
    tmp_path: pathlib.Path, cached: bool
) -> None:
    name = "warmup" if cached else "lonely"
    code, logs, elapsed = run_script(tmp_path, f"""
        if rank == 2:
            print("SLEEPING", flush=True)
            time.sleep(600)
        try:
            hvd.allreduce(torch.ones(2), name="{name}")
        except StallError as exc:
            print(f"STALL_ERROR {{exc.missing}}", flush=True)
            raise
        """, np=3, env={**FAST_FAILURE, "HOROVOD_LOG_HIDE_TIME": "1"})
    dump = joined_logs(logs)
    assert code != 0, dump
    assert "SLEEPING" in logs[2], dump
    for r in (0, 1):
        assert f"STALL_ERROR {{'allreduce.{name}': [2]}}" in logs[r], dump
        assert "StallError: Stalled for more than 3 seconds" in logs[r], dump
    # Rank 0 warned first, then shut down, in Horovod's words and line shape.
    assert "[W rank 0 stall.py:" in logs[0], dump
    assert "are waiting for remainder of ranks for more than 1 seconds" in logs[0], dump
    assert f"Missing ranks:\n2!: [allreduce.{name}]" in logs[0], dump
    assert 'One or more rank (marked by "!") is stalled for longer than 3 seconds. Will ' \
           "shutdown." in logs[0], dump
    # 3 s of stall, then at most 3 s for the sleeping rank to exit before MPI_Abort.
    assert "ending the job with MPI_Abort" in dump, dump
    assert elapsed < 6 + STARTUP_SLACK_S, dump


@pytest.mark.parallel
def test_mismatched_collectives_never_hang(tmp_path: pathlib.Path) -> None:
    code, logs, elapsed = run_script(tmp_path, """
        try:
            if rank == 0:
                hvd.allreduce(torch.ones(2), name="only_rank_0")
            else:
                hvd.allgather(torch.ones(2), name="only_rank_1")
        except StallError as exc:
            print(f"STALL_ERROR {sorted(exc.missing.items())}", flush=True)
            sys.exit(3)
        """, np=2, env=FAST_FAILURE)
    dump = joined_logs(logs)
    assert code != 0, dump
    expected = "STALL_ERROR [('allgather.only_rank_1', [0]), ('allreduce.only_rank_0', [1])]"
    assert expected in logs[0] and expected in logs[1], dump
    assert elapsed < 3 + STARTUP_SLACK_S, dump


# ---------------------------------------------------------------------------------------
# A rank that raises, dies, freezes or whose engine breaks


@pytest.mark.parallel
@pytest.mark.parametrize("failing", [0, 1])
def test_an_exception_on_one_rank_reaches_the_others(
    tmp_path: pathlib.Path, failing: int
) -> None:
    code, logs, elapsed = run_script(tmp_path, f"""
        if rank == {failing}:
            time.sleep(0.5)  # the others are waiting in the allreduce by now
            raise ValueError("bad batch 42")
        try:
            hvd.allreduce(torch.ones(2), name="pending")
        except PeerFailureError as exc:
            print(f"PEER_FAILURE rank={{exc.rank}} reason={{exc.reason}}", flush=True)
            print(f"MESSAGE {{exc}}", flush=True)
        # Later collectives fail the same way, at once.
        try:
            hvd.allreduce(torch.ones(2), name="later")
        except PeerFailureError as exc:
            print(f"LATER rank={{exc.rank}}", flush=True)
        """, np=3, env=FAST_FAILURE)
    dump = joined_logs(logs)
    assert code != 0, dump
    assert "ValueError: bad batch 42" in logs[failing], dump
    for r in range(3):
        if r == failing:
            continue
        assert f"PEER_FAILURE rank={failing} reason=ValueError: bad batch 42 (at " in logs[r], \
            dump
        assert f"MESSAGE rank {failing} failed: ValueError: bad batch 42" in logs[r], dump
        assert f"LATER rank={failing}" in logs[r], dump
    assert elapsed < STARTUP_SLACK_S, dump


_KILLED = """
if rank == 1:
    time.sleep(0.5)
    print(f"KILLED_AT {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    hvd.allreduce(torch.ones(2), name="pending")
except PeerFailureError as exc:
    print(f"PEER_FAILURE {time.time():.3f} rank={exc.rank} reason={exc.reason}", flush=True)
    raise
"""


@pytest.mark.parallel
@pytest.mark.parametrize("who_ends_it", ["launcher", "watchdog"])
def test_a_killed_rank_ends_the_job_in_bounded_time(
    tmp_path: pathlib.Path, who_ends_it: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = dict(FAST_FAILURE)
    if who_ends_it == "watchdog":
        # Keep Open MPI's launcher from ending the job itself: the survivors must.
        env["PRTE_MCA_state_base_recoverable"] = "1"
    code, logs, elapsed = run_script(tmp_path, _KILLED, np=3, env=env)
    ended = time.time()
    dump = joined_logs(logs)
    match = re.search(r"KILLED_AT (\d+\.\d+)", logs[1])
    assert match, dump
    death_to_end = ended - float(match.group(1))
    with capsys.disabled():
        print(f"\n[{who_ends_it}] rank death to job end: {death_to_end:.2f} s")
    if who_ends_it == "watchdog":
        for r in (0, 2):
            assert "PEER_FAILURE" in logs[r] and "rank=1" in logs[r], dump
            assert "is gone: it was killed or crashed" in logs[r], dump
        assert "ending the job with MPI_Abort" in dump, dump
    else:
        assert code != 0, dump
    assert death_to_end < 15, dump


@pytest.mark.parallel
def test_a_frozen_rank_times_out(tmp_path: pathlib.Path) -> None:
    env = {**FAST_FAILURE, "BAGUAHVD_PEER_TIMEOUT_SECONDS": "3"}
    code, logs, elapsed = run_script(tmp_path, """
        if rank == 1:
            print("FREEZING", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            hvd.allreduce(torch.ones(2), name="pending")
        except PeerFailureError as exc:
            print(f"PEER_FAILURE rank={exc.rank} reason={exc.reason}", flush=True)
            raise
        """, np=2, env=env)
    dump = joined_logs(logs)
    assert code != 0, dump
    assert "PEER_FAILURE rank=-1 reason=no negotiation cycle completed for 3 s" in logs[0], dump
    assert elapsed < 3 + STARTUP_SLACK_S, dump


@pytest.mark.parallel
@pytest.mark.parametrize("where", ["between_cycles", "mid_cycle"])
def test_an_engine_bug_does_not_leave_peers_hanging(
    tmp_path: pathlib.Path, where: str
) -> None:
    # Between cycles: admitting a request; mid-cycle: fusing what the ranks agreed on.
    stage = "admit" if where == "between_cycles" else "run"
    code, logs, elapsed = run_script(tmp_path, f"""
        from baguahvd.engine.loop import EngineLoop

        def broken(self, stage, work):
            names = [item.meta.name if stage == "admit" else item[0].meta.name for item in work]
            if stage == "{stage}" and "allreduce.poison" in names:
                raise RuntimeError("injected engine bug")

        if rank == 1:
            EngineLoop.inject_fault = broken
        try:
            hvd.allreduce(torch.ones(2), name="poison")
        except PeerFailureError as exc:
            print(f"PEER_FAILURE rank={{exc.rank}} reason={{exc.reason}}", flush=True)
            raise
        """, np=2, env=FAST_FAILURE)
    dump = joined_logs(logs)
    assert code != 0, dump
    assert "the engine stopped after an internal error" in logs[1], dump
    assert "RuntimeError: injected engine bug" in logs[1], dump
    assert "PEER_FAILURE rank=1 reason=baguahvd engine failed: RuntimeError: injected " \
           "engine bug" in logs[0], dump
    if where == "mid_cycle":
        # Rank 0's engine thread waits in a collective that rank 1 left: MPI cannot finish.
        assert "ending the job with MPI_Abort" in dump, dump
    assert elapsed < 3 + STARTUP_SLACK_S, dump


# ---------------------------------------------------------------------------------------
# A collective that fails on one rank only, while it runs

_FAILS_LOCALLY = """
from baguahvd.engine.execution import execute

original_get = execute.FusionBuffers.get
original_allgather = execute.allgather

def no_fusion_buffer(self, dtype, count, device, host=False):
    raise MemoryError("no room for a fusion buffer of %d elements" % count)

def no_allgather_output(comm, response, request):
    raise MemoryError("no room for the allgather output")

if rank == 1:
    time.sleep(0.5)  # rank 0 waits in the collective by then
    if "{where}" == "fusion_buffer":
        execute.FusionBuffers.get = no_fusion_buffer
    else:
        execute.allgather = no_allgather_output
    print(f"FAILING_AT {{time.time():.3f}}", flush=True)
try:
    if "{where}" == "fusion_buffer":
        handles = [hvd.allreduce_async(torch.ones(3), name=f"fused.{{i}}") for i in range(8)]
        for handle in handles:
            hvd.synchronize(handle)
    else:
        hvd.allgather(torch.ones(2), name="gathered")
except PeerFailureError as exc:
    print(f"PEER_FAILURE {{time.time():.3f}} rank={{exc.rank}} reason={{exc.reason}}",
          flush=True)
    raise
"""


@pytest.mark.parallel
@pytest.mark.parametrize("where", ["fusion_buffer", "allgather"])
def test_a_collective_that_fails_on_one_rank_fails_on_every_rank(
    tmp_path: pathlib.Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, logs, elapsed = run_script(tmp_path, _FAILS_LOCALLY.format(where=where), np=2,
                               env=FAST_FAILURE)
    dump = joined_logs(logs)
    assert code != 0, dump
    text = ("no room for a fusion buffer of 24 elements" if where == "fusion_buffer"
            else "no room for the allgather output")
    name = "allreduce.fused.0 (fused with 7 more)" if where == "fusion_buffer" \
        else "allgather.gathered"
    for r in (0, 1):
        assert "PEER_FAILURE" in logs[r] and f"rank=1 reason={name}: MemoryError: {text} " \
            "(at " in logs[r], dump
    # Rank 0 hears of it at once, not after BAGUAHVD_PEER_TIMEOUT_SECONDS.
    failing = re.search(r"FAILING_AT (\d+\.\d+)", logs[1])
    heard = re.search(r"PEER_FAILURE (\d+\.\d+)", logs[0])
    assert failing and heard, dump
    failed_at, heard_at = float(failing.group(1)), float(heard.group(1))
    with capsys.disabled():
        print(f"\n[{where}] failure on rank 1 to the error on rank 0: "
              f"{heard_at - failed_at:.2f} s")
    assert heard_at - failed_at < 5, dump
    assert elapsed < 5 + STARTUP_SLACK_S, dump


@pytest.mark.parallel
def test_without_mpi_threads_a_failing_collective_still_ends_the_job(
    tmp_path: pathlib.Path,
) -> None:
    # Rank 0's engine thread waits inside MPI_Allreduce, and MPI lets no other thread in to
    # hear rank 1's alarm: rank 1 ends the job after BAGUAHVD_EXIT_TIMEOUT_SECONDS.
    env = {**FAST_FAILURE, "HOROVOD_MPI_THREADS_DISABLE": "1"}
    code, logs, elapsed = run_script(tmp_path, _FAILS_LOCALLY.format(where="fusion_buffer"), np=2,
                               env=env)
    dump = joined_logs(logs)
    assert code != 0, dump
    assert "PEER_FAILURE" in logs[1] and "no room for a fusion buffer" in logs[1], dump
    assert "ending the job with MPI_Abort: ranks [0] did not acknowledge this rank's " \
           "failure within 3 s" in logs[1], dump
    assert elapsed < 3 + STARTUP_SLACK_S, dump


# ---------------------------------------------------------------------------------------
# Timeline


@pytest.mark.parallel
def test_the_timeline_of_a_killed_job_still_parses(tmp_path: pathlib.Path) -> None:
    timeline = tmp_path / "timeline.json"
    code, logs, _ = run_script(tmp_path, """
        for step in range(5):
            hvd.allreduce(torch.ones(4), name="before_kill")
        hvd.barrier()
        time.sleep(0.5)  # past the writer's next flush
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """, np=2, env={"HOROVOD_TIMELINE": str(timeline)})
    dump = joined_logs(logs)
    assert code != 0, dump
    text = timeline.read_text().rstrip()
    # Chrome's trace viewer accepts an array without its closing bracket; so do we.
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    names = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE"} <= names, names
    rows = {e["args"].get("name") for e in events if e.get("name") == "process_name"}
    assert "allreduce.before_kill" in rows, rows


@pytest.mark.parallel
def test_a_job_ended_by_a_stall_exits_non_zero_even_when_caught(tmp_path: pathlib.Path) -> None:
    code, logs, elapsed = run_script(tmp_path, """
        try:
            hvd.allreduce(torch.ones(2), name=f"only_rank_{rank}")
        except StallError:
            print("CAUGHT", flush=True)
        """, np=3, env=FAST_FAILURE)
    dump = joined_logs(logs)
    assert code == 1, dump
    for r in range(3):
        assert "CAUGHT" in logs[r], dump
        assert f"rank {r} states.py" in logs[r] and "exiting with status 1: the job was " \
            "ended by StallError: Stalled for more than 3 seconds" in logs[r], dump
    assert "MPI_Abort" not in dump, dump
