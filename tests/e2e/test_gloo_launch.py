"""Jobs on the gloo transport: the digits example launched by torchrun, by ``baguahvdrun
--gloo`` and the way ``horovodrun --gloo`` launches (its variables and an HTTP rendezvous
server of the same protocol, served here), each training across two processes and ending
with the same weights on both; and modules of ``tests/parallel`` run on gloo at two ranks.
"""

from __future__ import annotations

import http.server
import os
import pathlib
import shutil
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.support import jobs

TIMEOUT_S = 240
DIGITS = ["tests/e2e/gloo_digits.py"]
EXAMPLE_ARGS = ["--epochs", "2", "--log-interval", "0"]
PARALLEL_ON_GLOO = (
    "test_smoke.py", "test_allreduce.py", "test_allgather_broadcast.py", "test_errors.py",
    "test_lifecycle.py", "test_alltoall_reducescatter.py", "test_objects.py",
    "test_process_sets.py",
)
"""The ``tests/parallel`` modules that also run on gloo here (the others need mpirun's
variables, an mpi4py communicator or more time than this suite gives them)."""


def check_trained_alike(out: pathlib.Path, ranks: int = 2) -> None:
    """Every rank ran on gloo in a job of ``ranks`` and ended with rank 0's weights."""
    saved = [torch.load(out / f"rank.{r}.pt") for r in range(ranks)]
    for rank, state in enumerate(saved):
        assert state["facts"] == {
            "rank": rank, "size": ranks, "local_rank": rank, "local_size": ranks,
            "gloo_enabled": True, "mpi_enabled": False,
        }
        for name, weight in saved[0]["weights"].items():
            assert torch.equal(state["weights"][name], weight), name
    initial = saved[0]["weights"]
    assert any(w.abs().sum() > 0 for w in initial.values())


def assert_ok(result: object) -> None:
    __tracebackhide__ = True
    returncode = result.returncode
    if returncode != 0:
        pytest.fail(f"exit {returncode}\n{result.stdout}\n"
                    f"{getattr(result, 'stderr', '')}", pytrace=False)


def torchrun() -> list[str]:
    beside = pathlib.Path(sys.executable).parent / "torchrun"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun(tmp_path: pathlib.Path) -> None:
    command = [*torchrun(), "--nproc-per-node", "2", *DIGITS, str(tmp_path), *EXAMPLE_ARGS]
    # torchrun keeps its logs in a torchelastic_* folder under the temporary directory and
    # never removes it: give it the test's own.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    [result] = jobs.run_commands([command], jobs.ROOT, TIMEOUT_S, [{"TMPDIR": str(scratch)}])
    assert_ok(result)
    assert "test accuracy" in result.stdout
    check_trained_alike(tmp_path)


def test_baguahvdrun_gloo(tmp_path: pathlib.Path) -> None:
    command = jobs.launcher_command(
        ["--gloo", "-np", "2", sys.executable, *DIGITS, str(tmp_path), *EXAMPLE_ARGS]
    )
    [result] = jobs.run_commands([command], jobs.ROOT, TIMEOUT_S, [{}])
    assert_ok(result)
    check_trained_alike(tmp_path)


class _KeyValueHandler(http.server.BaseHTTPRequestHandler):
    """horovodrun's rendezvous protocol: PUT and GET of ``/<scope>/<key>``."""

    values: dict[str, bytes]

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        self.values[self.path] = self.rfile.read(length)
        self._answer(200, b"")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        value = self.values.get(self.path)
        self._answer(404, b"") if value is None else self._answer(200, value)

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def rendezvous_server() -> Iterator[tuple[int, dict[str, bytes]]]:
    handler = type("Handler", (_KeyValueHandler,), {"values": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler.values
    finally:
        server.shutdown()
        server.server_close()


def test_horovodrun_gloo_variables(
    tmp_path: pathlib.Path, rendezvous_server: tuple[int, dict[str, bytes]]
) -> None:
    port, values = rendezvous_server
    envs = [
        {
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2",
            "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": "2",
            "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
            "HOROVOD_HOSTNAME": "localhost",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "lo",
        }
        for rank in range(2)
    ]
    command = [sys.executable, *DIGITS, str(tmp_path), *EXAMPLE_ARGS]
    results = jobs.run_commands([command, command], jobs.ROOT, TIMEOUT_S, envs)
    for result in results:
        assert_ok(result)
    check_trained_alike(tmp_path)
    # Rank 0 published its store through the server.
    assert list(values) == ["/baguahvd/tcp_store"]


def test_several_ranks_never_train_alone(tmp_path: pathlib.Path) -> None:
    # torchrun's variables, but MPI forced: MPI finds a job of one.
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "BAGUAHVD_CPU_BACKEND": "mpi"}
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"):
        assert name not in os.environ
    command = [sys.executable, "-c", "import baguahvd.torch as hvd; hvd.init()"]
    [result] = jobs.run_commands([command], jobs.ROOT, 60, [env])
    assert result.returncode != 0
    assert "say this job has 2 ranks" in result.stdout
    assert "RANK, WORLD_SIZE" in result.stdout


@pytest.mark.parallel
@pytest.mark.parametrize("module", PARALLEL_ON_GLOO)
def test_parallel_on_gloo(module: str) -> None:
    command = jobs.launcher_command(
        ["--gloo", "-np", "2", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-x", "--timeout", "120", f"tests/parallel/{module}"]
    )
    [result] = jobs.run_commands(
        [command], jobs.ROOT, TIMEOUT_S, [{jobs.PARALLEL_WORKER_ENV: "1"}]
    )
    assert_ok(result)


FAILING_RANK = """
import os, signal, sys, time, torch, baguahvd.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(2), name="warm")
if hvd.rank() == 1:
    if sys.argv[1] == "raise":
        raise RuntimeError("boom on rank 1")
    os.kill(os.getpid(), signal.SIGKILL)
try:
    for i in range(200):
        hvd.allreduce(torch.ones(2), name=f"step.{i}")
        time.sleep(0.05)
except hvd.HorovodInternalError as error:
    print(f"rank 0 saw: {error}", flush=True)
    raise
"""


@pytest.mark.parametrize(
    ("how", "seen"),
    [("raise", "rank 1 failed: RuntimeError: boom on rank 1"),
     ("kill", "rank 1 failed: its process")],
)
def test_a_failed_rank_is_named_on_the_others(tmp_path: pathlib.Path, how: str,
                                              seen: str) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING_RANK)
    command = jobs.launcher_command(["--gloo", "-np", "2", sys.executable, str(script), how])
    [result] = jobs.run_commands([command], jobs.ROOT, 120, [{}])
    assert result.returncode != 0
    assert f"rank 0 saw: {seen}" in result.stdout, result.stdout[-3000:]
