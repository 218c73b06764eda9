"""``baguahvdrun --gloo``: the ranks' environments, local hosts only, exit statuses, and
a real launch of small commands (no torch needed)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from baguahvd.common.config import launch_from_env
from baguahvd.runner import cli, local_gloo
from baguahvd.runner.hosts import Host, LaunchError


def test_rank_environments() -> None:
    args = cli.parse_args(["-np", "2", "--gloo", "--fusion-threshold-mb", "1", "-x", "A=b",
                           "python", "t.py"])
    parent = {"PATH": "/bin", "OMPI_COMM_WORLD_SIZE": "4", "HOROVOD_RANK": "3"}
    envs = local_gloo.rank_environments(args, parent, 2, 12345)
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1")]
    assert [(e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1")]
    for env in envs:
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        # What horovodrun --gloo tells each rank, for scripts that read it.
        assert env["HOROVOD_SIZE"] == env["HOROVOD_LOCAL_SIZE"] == "2"
        assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("0", "1")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "12345")
        assert env["BAGUAHVD_CPU_BACKEND"] == "gloo"
        assert env["HOROVOD_FUSION_THRESHOLD"] == str(1024 * 1024) and env["A"] == "b"
        # Another launcher's variables would make the rank think it runs under it.
        assert "OMPI_COMM_WORLD_SIZE" not in env
        assert env["PATH"] == "/bin"


def test_ranks_meet_on_the_launchers_store() -> None:
    envs = local_gloo.rank_environments(cli.parse_args(["-np", "2", "--gloo", "python"]), {}, 2, 7)
    launch = launch_from_env(envs[1])
    assert launch.launcher == "torchrun"
    assert (launch.rank, launch.size, launch.store_port) == (1, 2, 7)


def test_remote_hosts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LaunchError, match="node7"):
        local_gloo.check_local([Host("localhost", 1), Host("node7", 1)])
    assert cli.main(["-np", "2", "--gloo", "-H", "node7:2", "python", "t.py"]) == 2
    assert "this machine only" in capsys.readouterr().err
    assert cli.main(["-np", "2", "--gloo", "--elastic", "--min-np", "1", "-H", "node7:2",
                     "python"]) == 2


def test_exit_status() -> None:
    assert local_gloo.exit_status(0) == 0
    assert local_gloo.exit_status(3) == 3
    assert local_gloo.exit_status(-signal.SIGKILL) == 128 + signal.SIGKILL


def test_worst_status_wins(tmp_path: Path) -> None:
    script = "import os, sys; sys.exit(int(os.environ['RANK']) * 3)"
    envs = local_gloo.rank_environments(
        cli.parse_args(["-np", "3", "--gloo", "python"]), {}, 3, 1
    )
    assert local_gloo.run_ranks([sys.executable, "-c", script], envs) == 6


def test_a_failed_rank_ends_the_others_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_gloo, "GRACE_S", 0.2)
    script = "import os, sys, time; os.environ['RANK'] == '0' and sys.exit(5); time.sleep(60)"
    envs = local_gloo.rank_environments(
        cli.parse_args(["-np", "2", "--gloo", "python"]), {}, 2, 1
    )
    started = time.monotonic()
    assert local_gloo.run_ranks([sys.executable, "-c", script], envs) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 20


def test_each_ranks_lines_arrive_whole_and_tagged(capfd: pytest.CaptureFixture[str]) -> None:
    # Two ranks writing halves of lines at once: every line arrives whole, tagged with its
    # rank and stream as horovodrun --gloo tags it; a last line without newline gets one.
    script = (
        "import os, sys, time\n"
        "rank = os.environ['RANK']\n"
        "for i in range(20):\n"
        "    sys.stdout.write(f'rank {rank} '); sys.stdout.flush(); time.sleep(0.001)\n"
        "    sys.stdout.write(f'line {i}\\n'); sys.stdout.flush()\n"
        "sys.stderr.write(f'last {rank}')\n"
    )
    environments = [dict(os.environ, RANK=str(rank)) for rank in range(2)]
    status = local_gloo.run_ranks([sys.executable, "-c", script], environments)
    out, err = capfd.readouterr()
    assert status == 0
    lines = out.splitlines()
    for rank in range(2):
        mine = [line for line in lines if line.startswith(f"[{rank}]<stdout>:")]
        assert mine == [f"[{rank}]<stdout>:rank {rank} line {i}" for i in range(20)]
    assert len(lines) == 40
    assert sorted(err.splitlines()) == ["[0]<stderr>:last 0", "[1]<stderr>:last 1"]


def test_untagged_output_passes_through(capfd: pytest.CaptureFixture[str]) -> None:
    environments = [dict(os.environ, RANK=str(rank)) for rank in range(2)]
    # One write per line: with unbuffered output print() writes the text and the newline
    # apart, and the two ranks' pieces may interleave on the way through.
    status = local_gloo.run_ranks(
        [sys.executable, "-c", "import sys; sys.stdout.write('plain\\n')"], environments,
        tag_output=False,
    )
    assert status == 0 and capfd.readouterr().out.splitlines() == ["plain", "plain"]
