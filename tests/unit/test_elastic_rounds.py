"""In-process recovery's rounds: a rank's side (:mod:`baguahvd.torch.elastic.rounds`) with
injected shutdown, init and clock, and the launcher's (:mod:`baguahvd.runner.elastic.rounds`)
with stand-in ranks that only read and write the elastic folder."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from baguahvd.backends.gloo import rounds as gloo_rounds
from baguahvd.common import elastic_protocol as protocol
from baguahvd.runner import cli
from baguahvd.runner.elastic.rounds import GlooElasticLauncher
from baguahvd.runner.elastic.settings import ElasticSettings
from baguahvd.torch.elastic import rounds


def _write_round(folder: pathlib.Path, number: int, workers: dict[str, dict[str, str]],
                 launch: int = 0) -> None:
    record = {"launch": launch, "round": number, "workers": workers}
    (folder / protocol.ROUND_FILE).write_text(json.dumps(record))


@pytest.fixture
def worker_env(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(protocol.ELASTIC_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(protocol.WORKER_ENV, "4")
    monkeypatch.setenv(protocol.RESTART_ENV, "0")
    monkeypatch.setenv(protocol.ROUND_ENV, "0")
    monkeypatch.setenv(protocol.ROUND_TIMEOUT_ENV, "5")
    monkeypatch.setenv("RANK", "2")
    # A round writes the launcher's variables (WORLD_SIZE, LOCAL_RANK, ...) into
    # os.environ: none of them may reach the tests that run after this one.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class _Framework:
    def __init__(self, failures: int = 0) -> None:
        self.calls: list[str] = []
        self.failures = failures
        self.ranks: list[str] = []

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def init(self) -> None:
        self.calls.append("init")
        self.ranks.append(os.environ["RANK"])
        if self.failures:
            self.failures -= 1
            raise ValueError("Horovod initialization failed.")


def test_only_ranks_of_a_gloo_elastic_launch_recover_in_place(worker_env: None) -> None:
    assert rounds.in_process()
    assert not rounds.joins_running_job()
    assert rounds.joins_running_job({**os.environ, protocol.ROUND_ENV: "3"})
    assert not rounds.in_process({protocol.ELASTIC_DIR_ENV: "/x"})  # mpirun's ranks


def test_a_rank_asks_for_a_round_and_takes_its_variables(
    worker_env: None, tmp_path: pathlib.Path
) -> None:
    _write_round(tmp_path, 1, {"4": {"RANK": "0", "WORLD_SIZE": "2"}})
    framework = _Framework()
    rounds.rejoin(framework.shutdown, framework.init)
    assert framework.calls == ["shutdown", "init"]
    assert (tmp_path / f"{protocol.ROUND_REQUEST_PREFIX}0.0.4").exists()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "2")
    assert os.environ[protocol.ROUND_ENV] == "1"


def test_a_rank_left_out_of_the_round_leaves_with_status_0(
    worker_env: None, tmp_path: pathlib.Path
) -> None:
    _write_round(tmp_path, 1, {"0": {"RANK": "0"}})
    framework = _Framework()
    with pytest.raises(SystemExit) as left:
        rounds.rejoin(framework.shutdown, framework.init)
    assert left.value.code == 0
    assert framework.calls == ["shutdown"]


def test_a_round_that_cannot_start_is_followed_by_the_next(
    worker_env: None, tmp_path: pathlib.Path
) -> None:
    _write_round(tmp_path, 1, {"4": {"RANK": "1"}})
    framework = _Framework(failures=1)
    original = framework.init

    def init_then_next_round() -> None:
        try:
            original()
        finally:
            _write_round(tmp_path, 2, {"4": {"RANK": "0"}})

    rounds.rejoin(framework.shutdown, init_then_next_round)
    assert framework.calls == ["shutdown", "init", "shutdown", "init"]
    assert framework.ranks == ["1", "0"]
    assert (tmp_path / f"{protocol.ROUND_REQUEST_PREFIX}0.1.4").exists()


def test_waiting_for_a_round_ends_with_a_named_error(
    worker_env: None, tmp_path: pathlib.Path
) -> None:
    _write_round(tmp_path, 7, {"4": {"RANK": "0"}}, launch=1)  # another launch's round
    now = [0.0]

    def clock() -> float:
        now[0] += 3.0
        return now[0]

    framework = _Framework()
    with pytest.raises(rounds.RoundTimeoutError, match="round 1 of launch 0"):
        rounds.rejoin(framework.shutdown, framework.init, clock=clock)
    assert framework.calls == ["shutdown"]


# A stand-in rank: records (worker, round, rank) and, in round 0, worker 1 fails with
# status 3 (with ASK, worker 0 asks for a round instead) while the others wait for the next
# round; then every rank ends with status 0.
_RANK = """
import json, os, sys, time
folder = os.environ["BAGUAHVD_ELASTIC_DIR"]
worker = os.environ["BAGUAHVD_ELASTIC_WORKER"]
started = int(os.environ["BAGUAHVD_ELASTIC_ROUND"])
with open(os.path.join(folder, "log"), "a") as log:
    log.write(f"{worker} {started} {os.environ['RANK']} {os.environ['WORLD_SIZE']} "
              f"{os.environ['LOCAL_RANK']}\\n")
if started == 0 and worker == "1" and not os.environ.get("ASK"):
    sys.exit(3)
if started == 0 and worker == "0" and os.environ.get("ASK"):
    open(os.path.join(folder, "round-request.0.0.0"), "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with open(os.path.join(folder, "round.json")) as f:
        record = json.load(f)
    if record["round"] > started or started > 0:
        break
    time.sleep(0.02)
"""


def _run_pool(tmp_path: pathlib.Path, np: int, extra: list[str], env: dict[str, str]) -> int:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_RANK))
    args = cli.parse_args([
        "-np", str(np), "--gloo", "--elastic", "--checkpoint-dir", str(tmp_path), *extra,
        sys.executable, str(script),
    ])
    full_env = {**os.environ, **env}
    settings = ElasticSettings.from_args(args, full_env)
    return GlooElasticLauncher(args, settings, full_env, mpirun="").run()


def _log(tmp_path: pathlib.Path) -> list[tuple[str, ...]]:
    return sorted(tuple(line.split()) for line in (tmp_path / "log").read_text().splitlines())


def test_a_failed_rank_is_replaced_and_the_survivors_stay(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = _run_pool(tmp_path, 3, ["--max-restarts", "1"], {})
    err = capsys.readouterr().err
    assert status == 0, err
    assert "round 1: rank 1 (status 3) failed (restart 1 of 1); 2 ranks kept, 1 started" in err
    # Workers 0 and 2 keep running (ranks 0 and 1 of round 1) and their local ranks (their
    # GPUs); worker 3 takes rank 2 and the lost worker's local rank, 1.
    assert _log(tmp_path) == [
        ("0", "0", "0", "3", "0"), ("1", "0", "1", "3", "1"), ("2", "0", "2", "3", "2"),
        ("3", "1", "2", "3", "1"),
    ]
    record = json.loads((tmp_path / protocol.ROUND_FILE).read_text())
    assert record["round"] == 1 and sorted(record["workers"]) == ["0", "2", "3"]
    assert record["workers"]["2"]["RANK"] == "1"
    assert record["workers"]["2"]["LOCAL_RANK"] == "2"
    assert record["workers"]["2"]["HOROVOD_LOCAL_RANK"] == "2"
    assert not list(tmp_path.glob(f"{protocol.ROUND_REQUEST_PREFIX}*"))


def test_a_failure_past_max_restarts_ends_the_job(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = _run_pool(tmp_path, 2, ["--max-restarts", "0"], {})
    assert status == 3
    assert "giving up after 0 restarts" in capsys.readouterr().err


def test_a_request_without_a_host_change_is_a_failure_and_keeps_every_rank(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = _run_pool(tmp_path, 2, ["--max-restarts", "1"], {"ASK": "1"})
    err = capsys.readouterr().err
    assert status == 0, err
    assert "round 1: a collective failed (restart 1 of 1); 2 ranks kept, 0 started" in err
    assert _log(tmp_path) == [("0", "0", "0", "2", "0"), ("1", "0", "1", "2", "1")]


# Stand-in ranks of a job whose survivor goes on alone: in round 0 worker 1 fails with
# status 3; worker 0 takes round 1, waits for the launcher's notice that the process started
# for the lost slot is ready (as a commit would find it), asks for a round and takes the
# next; the waiting process says it is ready and takes the first round that names it.
_SMALLER = """
import json, os, sys, time
folder = os.environ["BAGUAHVD_ELASTIC_DIR"]
worker = os.environ["BAGUAHVD_ELASTIC_WORKER"]
started = int(os.environ["BAGUAHVD_ELASTIC_ROUND"])


def log(number, variables):
    with open(os.path.join(folder, "log"), "a") as out:
        out.write(f"{worker} {number} {variables['RANK']} {variables['WORLD_SIZE']} "
                  f"{variables['LOCAL_RANK']}\\n")


def next_round(after):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(os.path.join(folder, "round.json")) as f:
            record = json.load(f)
        if record["round"] > after:
            return record
        time.sleep(0.02)
    sys.exit(9)


if os.environ.get("BAGUAHVD_ELASTIC_JOIN") == "1":
    assert "RANK" not in os.environ and os.environ["LOCAL_RANK"] == "1"
    open(os.path.join(folder, f"round-ready.0.{worker}"), "w").close()
    record = next_round(started)
    log(record["round"], record["workers"][worker])
    sys.exit(0)
log(started, os.environ)
if worker == "1":
    sys.exit(3)
record = next_round(0)
log(record["round"], record["workers"][worker])
notice = os.path.join(folder, "hosts.json")
deadline = time.monotonic() + 60
while not os.path.exists(notice) and time.monotonic() < deadline:
    time.sleep(0.02)
open(os.path.join(folder, "round-request.0.1.0"), "w").close()
record = next_round(1)
log(record["round"], record["workers"][worker])
"""


def test_survivors_go_on_alone_and_the_replacement_joins_once_ready(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_SMALLER))
    args = cli.parse_args([
        "-np", "2", "--min-np", "1", "--gloo", "--elastic", "--checkpoint-dir", str(tmp_path),
        sys.executable, str(script),
    ])
    settings = ElasticSettings.from_args(args, dict(os.environ))
    status = GlooElasticLauncher(args, settings, dict(os.environ), mpirun="").run()
    err = capsys.readouterr().err
    assert status == 0, err
    assert (
        "round 1: rank 1 (status 3) failed (restart 1 of 3); 1 ranks kept, 0 started, "
        "1 to join when ready"
    ) in err, err
    assert "round 2: 1 ranks ready to join; 1 ranks kept, 1 joined, 0 started" in err, err
    # Worker 0 trains alone in round 1 (rank 0 of 1); worker 2, started with the lost
    # worker's local rank, joins it in round 2.
    assert _log(tmp_path) == [
        ("0", "0", "0", "2", "0"), ("0", "1", "0", "1", "0"), ("0", "2", "0", "2", "0"),
        ("1", "0", "1", "2", "1"), ("2", "2", "1", "2", "1"),
    ]
    notice = json.loads((tmp_path / protocol.HOSTS_NOTICE_FILE).read_text())
    assert notice["version"] == 1 and notice["result"] == protocol.HOSTS_ADDED
    assert not list(tmp_path.glob("round-re*"))


def test_a_process_started_to_join_says_it_is_ready_and_waits_for_its_round(
    tmp_path: pathlib.Path,
) -> None:
    env = {
        protocol.ELASTIC_DIR_ENV: str(tmp_path), protocol.WORKER_ENV: "5",
        protocol.RESTART_ENV: "0", protocol.ROUND_ENV: "1", protocol.JOIN_ENV: "1",
    }
    ready = tmp_path / f"{protocol.READY_PREFIX}0.5"

    def launcher() -> None:
        while not ready.exists():
            time.sleep(0.01)
        _write_round(tmp_path, 2, {"0": {"RANK": "0"}})  # not for worker 5: it waits on
        time.sleep(0.1)
        _write_round(tmp_path, 3, {"0": {"RANK": "0"}, "5": {"RANK": "1", "WORLD_SIZE": "2"}})

    thread = threading.Thread(target=launcher)
    thread.start()
    gloo_rounds.await_admission(env)
    thread.join(timeout=10)
    assert env[protocol.ROUND_ENV] == "3" and protocol.JOIN_ENV not in env
    assert (env["RANK"], env["WORLD_SIZE"]) == ("1", "2")
    assert rounds.joins_running_job(env)
    before = dict(env)
    gloo_rounds.await_admission(env)  # a later init(): nothing to wait for
    assert env == before
