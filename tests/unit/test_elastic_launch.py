"""``baguahvdrun --elastic``: the relaunch loop against a scripted fake ``mpirun``, its
helpers, and one real job whose rank dies once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from baguahvd.common import elastic_protocol as protocol
from baguahvd.runner import cli, elastic
from baguahvd.runner.hosts import Host, same_host

REPO = Path(__file__).resolve().parents[2]

# Runs one step of the queue in FAKE_MPIRUN_STEPS and appends what it was given (and, with
# "wait_for_notice", the host notice it waited for, as a rank would) to FAKE_MPIRUN_LOG.
FAKE_MPIRUN = """\
import json, os, sys, time
steps_path = os.environ["FAKE_MPIRUN_STEPS"]
with open(steps_path) as handle:
    steps = json.load(handle)
step = steps.pop(0) if steps else {}
with open(steps_path, "w") as handle:
    json.dump(steps, handle)
record = {
    "argv": sys.argv[1:],
    "env": {k: v for k, v in os.environ.items() if "ELASTIC" in k},
}
for path, text in step.get("write", {}).items():
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)
if step.get("wait_for_notice"):
    notice = os.path.join(os.environ["BAGUAHVD_ELASTIC_DIR"], "hosts.json")
    mine = int(os.environ["BAGUAHVD_ELASTIC_HOSTS_VERSION"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(notice) as handle:
                seen = json.load(handle)
        except OSError:
            seen = None
        if seen is not None and seen["version"] > mine:
            record["notice"] = seen
            break
        time.sleep(0.02)
if step.get("signal_launcher"):
    os.kill(os.getppid(), step["signal_launcher"])
time.sleep(step.get("sleep", 0))
with open(os.environ["FAKE_MPIRUN_LOG"], "a") as handle:
    handle.write(json.dumps(record) + "\\n")
sys.stderr.write(step.get("stderr", ""))
sys.exit(step.get("status", 0))
"""


class FakeMpirun:
    """A scripted ``mpirun``: each launch takes the next step of a queue."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "mpirun"
        self.path.write_text(f"#!{sys.executable}\n{FAKE_MPIRUN}")
        self.path.chmod(0o755)
        self.steps_file = folder / "steps.json"
        self.log_file = folder / "launches.jsonl"
        self.steps_file.write_text("[]")

    def script(self, *steps: dict[str, Any] | int) -> None:
        queue = [{"status": step} if isinstance(step, int) else step for step in steps]
        self.steps_file.write_text(json.dumps(queue))

    def launches(self) -> list[dict[str, Any]]:
        if not self.log_file.exists():
            return []
        return [json.loads(line) for line in self.log_file.read_text().splitlines()]


@pytest.fixture(autouse=True)
def _plain_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for name in ("BAGUAHVD_AS_HOROVOD", "HOROVOD_AS_HOROVOD", "BAGUAHVD_ELASTIC_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeMpirun:
    mpirun = FakeMpirun(tmp_path)
    monkeypatch.setattr(cli, "find_mpirun", lambda env: str(mpirun.path))
    monkeypatch.setattr(cli, "probe_mpirun", lambda path: 5)
    monkeypatch.setenv("FAKE_MPIRUN_STEPS", str(mpirun.steps_file))
    monkeypatch.setenv("FAKE_MPIRUN_LOG", str(mpirun.log_file))
    monkeypatch.setenv(elastic.POLL_SECONDS_ENV, "0.05")
    # The job folders the launcher makes (and keeps after a failure) land in the test's own.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return mpirun


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def kept_directory(err: str) -> Path:
    match = re.search(r"kept the job's elastic state in (\S+);", err)
    assert match, err
    return Path(match.group(1))


# --- restarts -------------------------------------------------------------------------------


def test_failed_launch_is_restarted_with_the_same_folder(
    fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script(1, 1, 0)
    assert cli.main(["--elastic", "-np", "2", "python", "train.py"]) == 0
    launches = fake.launches()
    assert [launch["env"][protocol.RESTART_ENV] for launch in launches] == ["0", "1", "2"]
    folders = {launch["env"][protocol.ELASTIC_DIR_ENV] for launch in launches}
    assert len(folders) == 1
    for launch in launches:
        argv, env = launch["argv"], launch["env"]
        assert env[protocol.ELASTIC_ENV] == "1" and env[protocol.HOSTS_VERSION_ENV] == "0"
        exported = [argv[i + 1] for i, word in enumerate(argv) if word == "-x"]
        for name in (
            protocol.ELASTIC_ENV,
            protocol.ELASTIC_DIR_ENV,
            protocol.RESTART_ENV,
            protocol.HOSTS_VERSION_ENV,
        ):
            assert name in exported
        assert option(argv, "-np") == "2" and option(argv, "-H") == "localhost:2"
        assert argv[-2:] == ["python", "train.py"]
    err = capsys.readouterr().err
    assert "baguahvdrun: launch 1 on localhost:2 (2 ranks)\n" in err
    assert "launch 1 failed with status 1; relaunching (restart 1 of 3)" in err
    assert "baguahvdrun: launch 2 (restart 1 of 3) on localhost:2 (2 ranks)\n" in err
    assert "launch 3 (restart 2 of 3)" in err
    assert not os.path.exists(folders.pop()), "the temporary folder is removed after success"


def test_gives_up_after_max_restarts_with_the_job_status(
    fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script(3, 3, 3, 0)
    assert cli.main(["--elastic", "--max-restarts", "2", "-np", "1", "python"]) == 3
    assert len(fake.launches()) == 3
    err = capsys.readouterr().err
    assert "launch 3 failed with status 3; giving up after 2 restarts (--max-restarts 2)" in err
    folder = kept_directory(err)
    assert folder.is_dir() and str(folder) == fake.launches()[0]["env"][protocol.ELASTIC_DIR_ENV]
    folder.rmdir()


def test_no_restart_at_all(fake: FakeMpirun) -> None:
    fake.script(9, 0)
    assert cli.main(["--elastic", "--max-restarts", "0", "-np", "1", "python"]) == 9
    assert len(fake.launches()) == 1


def test_resize_exit_is_not_a_failure(fake: FakeMpirun, capsys: pytest.CaptureFixture[str]) -> None:
    fake.script(protocol.RESIZE_EXIT_CODE, protocol.RESIZE_EXIT_CODE, 1, 0)
    assert cli.main(["--elastic", "--max-restarts", "1", "-np", "2", "python"]) == 0
    assert len(fake.launches()) == 4
    err = capsys.readouterr().err
    assert "launch 1 stopped for a host change (status 75); relaunching on the new hosts" in err
    assert "launch 2 (hosts changed) on localhost:2" in err
    assert "launch 4 (restart 1 of 1)" in err


def test_reset_limit_counts_every_relaunch(
    fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script(protocol.RESIZE_EXIT_CODE, 1, 0)
    assert cli.main(["--elastic", "--reset-limit", "1", "-np", "2", "python"]) == 1
    assert len(fake.launches()) == 2
    assert "launch 2 failed with status 1; not relaunching: --reset-limit 1 reached" in (
        capsys.readouterr().err
    )


def test_checkpoint_dir_is_created_kept_and_cleared_of_old_notices(
    fake: FakeMpirun, tmp_path: Path
) -> None:
    folder = tmp_path / "state" / "job"
    fake.script(0)
    assert cli.main(["--checkpoint-dir", str(folder), "--elastic", "-np", "1", "python"]) == 0
    assert folder.is_dir()
    assert fake.launches()[0]["env"][protocol.ELASTIC_DIR_ENV] == str(folder)
    (folder / protocol.HOSTS_NOTICE_FILE).write_text('{"version": 7}')
    (folder / "commit.pt").write_text("state")
    fake.script(0)
    assert cli.main(["--checkpoint-dir", str(folder), "--elastic", "-np", "1", "python"]) == 0
    assert not (folder / protocol.HOSTS_NOTICE_FILE).exists()
    assert (folder / "commit.pt").read_text() == "state"


def test_sigterm_is_forwarded_and_ends_the_job(fake: FakeMpirun) -> None:
    fake.script({"signal_launcher": int(signal.SIGTERM), "sleep": 30}, 0)
    assert cli.main(["--elastic", "-np", "1", "python"]) == 128 + signal.SIGTERM
    assert fake.launches() == [], "the fake mpirun was killed before it logged anything"
    assert json.loads(fake.steps_file.read_text()) == [{"status": 0}], "no relaunch"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler is restored"


# --- hosts ----------------------------------------------------------------------------------


def test_hostfile_is_read_again_before_every_launch(fake: FakeMpirun, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    fake.script({"status": 1, "write": {str(hostfile): "localhost slots=2\nnode2 slots=2\n"}}, 0)
    assert cli.main(["--elastic", "--hostfile", str(hostfile), "python"]) == 0
    first, second = (launch["argv"] for launch in fake.launches())
    assert (option(first, "-H"), option(first, "-np")) == ("localhost:2", "2")
    assert (option(second, "-H"), option(second, "-np")) == ("localhost:2,node2:2", "4")


def test_discovery_changes_are_announced_to_the_ranks(
    fake: FakeMpirun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\nnode2\n")
    script = executable(tmp_path / "discover", f"#!/bin/sh\ncat {hosts}\n")
    resize = protocol.RESIZE_EXIT_CODE
    fake.script(
        {
            "write": {str(hosts): "localhost:2\nnode2\nnode3\n"},
            "wait_for_notice": True,
            "status": resize,
        },
        {"write": {str(hosts): "localhost:2\nnode3\n"}, "wait_for_notice": True, "status": resize},
        {
            "write": {str(hosts): "localhost:1\nnode4:3\n"},
            "wait_for_notice": True,
            "status": resize,
        },
        0,
    )
    argv = ["--host-discovery-script", script, "--slots-per-host", "2", "--max-np", "5", "python"]
    assert cli.main(argv) == 0
    launches = fake.launches()
    assert [launch["env"][protocol.HOSTS_VERSION_ENV] for launch in launches] == [
        "0",
        "1",
        "2",
        "3",
    ]
    assert [launch["env"][protocol.RESTART_ENV] for launch in launches] == ["0", "1", "2", "3"]
    assert [launch["notice"] for launch in launches[:3]] == [
        {"version": 1, "hosts": [["localhost", 2], ["node2", 2], ["node3", 2]], "result": "added"},
        {"version": 2, "hosts": [["localhost", 2], ["node3", 2]], "result": "removed"},
        {"version": 3, "hosts": [["localhost", 1], ["node4", 3]], "result": "mixed"},
    ]
    assert [
        (option(launch["argv"], "-H"), option(launch["argv"], "-np")) for launch in launches
    ] == [
        ("localhost:2,node2:2", "4"),
        ("localhost:2,node2:2,node3:2", "5"),
        ("localhost:2,node3:2", "4"),
        ("localhost:1,node4:3", "4"),
    ]
    assert (
        "hosts added: now localhost:2,node2:2,node3:2 (hosts version 1)" in capsys.readouterr().err
    )


def test_discovery_failure_while_running_keeps_the_hosts(
    fake: FakeMpirun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    script = executable(tmp_path / "discover", f"#!/bin/sh\ncat {hosts}\n")
    fake.script({"write": {str(hosts): "error: no cluster\n"}, "sleep": 0.4, "status": 1}, 0)
    assert cli.main(["--host-discovery-script", script, "python"]) == 0
    err = capsys.readouterr().err
    assert "warning: --host-discovery-script" in err and "printed 'error: no cluster'" in err
    assert "keeping the hosts localhost:2" in err
    assert option(fake.launches()[1]["argv"], "-H") == "localhost:2"


def test_discovery_failure_before_the_first_launch_is_an_error(
    fake: FakeMpirun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = executable(tmp_path / "discover", "#!/bin/sh\necho down >&2\nexit 4\n")
    assert cli.main(["--host-discovery-script", script, "python"]) == 1
    assert "exited with status 4: down" in capsys.readouterr().err
    assert fake.launches() == []


def test_min_np_waits_for_slots(fake: FakeMpirun, tmp_path: Path) -> None:
    counter = tmp_path / "calls"
    script = executable(
        tmp_path / "discover",
        f"#!/bin/sh\necho x >> {counter}\n"
        f"if [ $(wc -l < {counter}) -lt 3 ]; then echo localhost:1; else echo localhost:3; fi\n",
    )
    fake.script(0)
    argv = ["--host-discovery-script", script, "--min-np", "2", "--elastic-timeout", "20"]
    assert cli.main([*argv, "python"]) == 0
    assert option(fake.launches()[0]["argv"], "-np") == "3"


def test_min_np_times_out_with_the_numbers(
    fake: FakeMpirun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = executable(tmp_path / "discover", "#!/bin/sh\necho localhost:1\n")
    argv = ["--host-discovery-script", script, "--min-np", "2", "--elastic-timeout", "0.3"]
    assert cli.main([*argv, "python"]) == 1
    err = capsys.readouterr().err
    assert (
        "error: --min-np 2 needs at least 2 slots but only 1 available (localhost:1) after "
        "waiting 0.3 s (--elastic-timeout)"
    ) in err
    assert fake.launches() == []
    kept_directory(err).rmdir()


def test_failed_host_is_left_out_for_the_cooldown(
    fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    report = (
        "--------------------------------------------------------------------------\n"
        "prterun noticed that process rank 3 with PID 4242 on node node2 exited on\n"
        "signal 9 (Killed).\n"
    )
    fake.script({"status": 137, "stderr": report}, 0)
    argv = ["--elastic", "-H", "node1:2,node2:2", "--min-np", "2"]
    assert cli.main([*argv, "--blacklist-cooldown-range", "30", "60", "python"]) == 0
    first, second = (launch["argv"] for launch in fake.launches())
    assert (option(first, "-H"), option(first, "-np")) == ("node1:2,node2:2", "4")
    assert (option(second, "-H"), option(second, "-np")) == ("node1:2", "2")
    err = capsys.readouterr().err
    assert report in err, "mpirun's stderr reaches the user unchanged"
    assert re.search(r"leaving host node2 out for \d+\.\d s", err)

    fake.script({"status": 137, "stderr": report}, 0)
    assert cli.main([*argv, "python"]) == 0
    assert option(fake.launches()[-1]["argv"], "-H") == "node1:2,node2:2", "no cooldown range"


def test_failed_nodes_in_open_mpi_reports() -> None:
    open_mpi_5 = (
        "prterun noticed that process rank 1 with PID 29917 on node vm exited on\n"
        "signal 9 (Killed).\n"
    )
    assert elastic.failed_nodes(open_mpi_5) == ["vm"]
    open_mpi_4 = (
        "mpirun noticed that process rank 0 with PID 0 on node gpu-7.cluster exited on "
        "signal 11 (Segmentation fault).\n"
        "mpirun noticed that process rank 2 with PID 0 on node\ngpu-9.\n"
    )
    assert elastic.failed_nodes(open_mpi_4) == ["gpu-7.cluster", "gpu-9"]
    lost = (
        "ORTE has lost communication with a remote daemon.\n  Remote daemon: [[1,0],2] on node n3\n"
    )
    assert elastic.failed_nodes(lost) == ["n3"]
    exit_code = "   Process name: [prterun-vm-29998@1,1]\n   Exit code:    3\n"
    assert elastic.failed_nodes(exit_code) == []


def test_same_host() -> None:
    assert same_host("node1", "node1.cluster")
    assert same_host("localhost", "127.0.0.1")
    assert not same_host("node1", "node2")


def test_parse_discovered_hosts() -> None:
    parse = elastic.parse_discovered_hosts
    assert parse("a\n\n b:3 \na:2\n", 4, "s") == [Host("a", 6), Host("b", 3)]
    assert parse("", 1, "s") == []
    for garbage in ("a b\n", "a:0\n", "a:x\n", "Traceback (most recent call last):\n"):
        with pytest.raises(elastic.HostDiscoveryError, match="expected one 'host'"):
            parse(garbage, 1, "--host-discovery-script 's'")


def test_host_change() -> None:
    def hosts(text: str) -> list[Host]:
        return elastic.parse_discovered_hosts(text, 1, "s")

    assert elastic.host_change(hosts("a:2"), hosts("a:3")) == protocol.HOSTS_ADDED
    assert elastic.host_change(hosts("a\nb"), hosts("b")) == protocol.HOSTS_REMOVED
    assert elastic.host_change(hosts("a"), hosts("b")) == protocol.HOSTS_MIXED


@pytest.mark.parametrize(
    ("total", "first", "num_proc", "min_np", "max_np", "size"),
    [
        (4, True, 2, 2, None, 2),
        (4, False, 2, 2, None, 4),
        (8, False, 2, 2, 6, 6),
        (8, True, None, 1, 6, 6),
        (3, True, 4, 2, None, 3),
        (1, False, 2, 2, None, None),
        (0, True, None, 1, None, None),
    ],
)
def test_launch_size(
    total: int,
    first: bool,
    num_proc: int | None,
    min_np: int,
    max_np: int | None,
    size: int | None,
) -> None:
    assert (
        elastic.launch_size(total, first=first, num_proc=num_proc, min_np=min_np, max_np=max_np)
        == size
    )


# --- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--min-np", "2"], "--min-np"),
        (["--max-np", "2"], "--max-np"),
        (["--slots-per-host", "2"], "--slots-per-host"),
        (["--max-restarts", "5"], "--max-restarts"),
        (["--reset-limit", "5"], "--reset-limit"),
        (["--elastic-timeout", "5"], "--elastic-timeout"),
        (["--blacklist-cooldown-range", "1", "2"], "--blacklist-cooldown-range"),
        (["--checkpoint-dir", "ckpt"], "--checkpoint-dir"),
    ],
)
def test_elastic_flags_need_elastic(
    flags: list[str], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["-np", "2", *flags, "python"]) == 2
    assert f"error: {name} only applies to elastic jobs; add --elastic" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--elastic", "python"], "-np/--num-proc is required"),
        (["--elastic", "-np", "3", "--max-np", "2", "python"], "-np 3 is larger than --max-np 2"),
        (["--elastic", "-np", "1", "--min-np", "2", "python"], "-np 1 is smaller than --min-np 2"),
        (["--elastic", "--min-np", "3", "--max-np", "2", "-H", "a:4", "python"], "larger than"),
        (["--elastic", "-np", "1", "--max-restarts", "-1", "python"], "at least 0"),
        (["--elastic", "-np", "3", "-H", "a:2", "python"], "needs 3 slots"),
        (["--elastic", "-np", "1", "--blacklist-cooldown-range", "5", "1", "python"], "MIN <="),
        (["--host-discovery-script", "d", "-H", "a", "python"], "replaces -H/--hosts"),
        (["--elastic", "-np", "1"], "no command"),
    ],
)
def test_bad_elastic_requests(
    argv: list[str], message: str, fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert fake.launches() == []


def test_poll_seconds_must_be_positive(
    fake: FakeMpirun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(elastic.POLL_SECONDS_ENV, "0")
    assert cli.main(["--elastic", "-np", "1", "python"]) == 2
    assert "BAGUAHVD_ELASTIC_POLL_SECONDS='0' is not a positive number" in capsys.readouterr().err


def test_without_elastic_mpirun_is_still_execed(
    fake: FakeMpirun, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: calls.append(list(argv)))
    assert cli.main(["-np", "2", "python"]) == 0
    assert len(calls) == 1 and fake.launches() == []
    assert "HOROVOD_ELASTIC" not in calls[0]


# --- a real job -----------------------------------------------------------------------------


@pytest.mark.parallel
def test_real_job_survives_a_killed_rank(tmp_path: Path) -> None:
    program = tmp_path / "die_once.py"
    program.write_text(
        "import os, signal\n"
        "if os.environ['BAGUAHVD_ELASTIC_RESTART'] == '0' and "
        "os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "print('rank', os.environ['OMPI_COMM_WORLD_RANK'], 'of launch',\n"
        "      os.environ['BAGUAHVD_ELASTIC_RESTART'], flush=True)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), env.get("PYTHONPATH", "")) if part
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "baguahvd.run",
            "--elastic",
            "-np",
            "2",
            sys.executable,
            str(program),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stderr.count("baguahvdrun: launch ") == 3, output  # 2 launches, 1 failure
    assert "launch 1 failed with status 137; relaunching (restart 1 of 3)" in output
    assert "launch 2 (restart 1 of 3) on localhost:2 (2 ranks)" in output
    for line in ("rank 0 of launch 1", "rank 1 of launch 1"):
        assert line in result.stdout, output
    assert "rank 1 of launch 0" not in result.stdout, output


OPEN_MPI_NOT_STARTED = (
    "--------------------------------------------------------------------------\n"
    "prterun was unable to launch the specified application as it could not\n"
    "access an executable:\n\n   Executable: /no/such/program\n   Node: vm\n\n"
    "while attempting to start process rank 0.\n"
)


def test_program_that_cannot_start_is_not_relaunched(
    fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script({"status": 183, "stderr": OPEN_MPI_NOT_STARTED}, 0)
    assert cli.main(["--elastic", "-np", "2", "/no/such/program"]) == 183
    assert len(fake.launches()) == 1
    assert "could not start the program; not relaunching" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (OPEN_MPI_NOT_STARTED, True),
        ("mpirun could not find an executable named prog\n", True),
        ("prterun noticed that process rank 1 with PID 7 on node vm exited on signal 9", False),
        ("", False),
    ],
)
def test_program_not_started(text: str, expected: bool) -> None:
    assert elastic.program_not_started(text) is expected


# --- failures while starting up -------------------------------------------------------------

IMPORT_FAILURE = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 3, in <module>\n'
    "    import missing_module\n"
    "ModuleNotFoundError: No module named 'missing_module'\n"
    "--------------------------------------------------------------------------\n"
    "prterun detected that one or more processes exited with non-zero status, thus causing\n"
    "the job to be terminated.\n"
)


def test_failure_repeating_before_training_is_not_relaunched_again(
    fake: FakeMpirun, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script(
        {"status": 1, "stderr": IMPORT_FAILURE}, {"status": 1, "stderr": IMPORT_FAILURE}, 0
    )
    assert cli.main(["--elastic", "--max-restarts", "5", "-np", "2", "python", "t.py"]) == 1
    assert len(fake.launches()) == 2
    err = capsys.readouterr().err
    assert (
        "launch 2 failed with status 1 before any rank started training, with the same error "
        "as the launch before: ModuleNotFoundError: No module named 'missing_module'; "
        "not relaunching"
    ) in err


def test_failure_after_training_started_is_relaunched(
    fake: FakeMpirun, tmp_path: Path
) -> None:
    folder = tmp_path / "job"
    mark = str(folder / protocol.TRAINING_MARK_FILE)
    crash = {"status": 1, "stderr": "RuntimeError: lost the link\n"}
    fake.script(crash, dict(crash, write={mark: ""}), crash, 0)
    argv = ["--elastic", "--checkpoint-dir", str(folder), "-np", "2", "python", "t.py"]
    assert cli.main(argv) == 0
    # The second launch trained, so the third one's identical error is not a repeat of a
    # start-up failure; the mark is removed before every launch.
    assert len(fake.launches()) == 4
    assert not os.path.exists(mark)


def test_different_start_up_errors_are_relaunched(fake: FakeMpirun) -> None:
    fake.script(
        {"status": 1, "stderr": "OSError: [Errno 5] Input/output error\n"},
        {"status": 1, "stderr": "ConnectionResetError: peer went away\n"},
        0,
    )
    assert cli.main(["--elastic", "-np", "2", "python", "t.py"]) == 0
    assert len(fake.launches()) == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (IMPORT_FAILURE, "ModuleNotFoundError: No module named 'missing_module'"),
        ("[1,0]<stderr>:ValueError: bad batch\n", "ValueError: bad batch"),
        ("baguahvd.torch.elastic.CommitError: commit-3.h.pt is damaged\n",
         "baguahvd.torch.elastic.CommitError: commit-3.h.pt is damaged"),
        ("KeyboardInterrupt\nKilled\n", "KeyboardInterrupt"),
        ("prterun noticed that process rank 1 exited on signal 9 (Killed).\n", None),
    ],
)
def test_last_exception(text: str, expected: str | None) -> None:
    assert elastic.last_exception(text) == expected
