"""``baguahvdrun --gloo``: the ranks as child processes of the launcher, joined by gloo.

No mpirun: the launcher picks a free TCP port, starts ``-np`` copies of the command on this
machine with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT) and the rank variables ``horovodrun --gloo`` sets
(HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK,
HOROVOD_CROSS_SIZE), and rank 0's ``hvd.init()`` hosts the job's TCP store on that port (the
launcher never imports torch). Each line a rank writes reaches the launcher's stdout or
stderr whole, prefixed with the rank and the stream as ``horovodrun --gloo`` prefixes it
(``[<rank>]<stdout>:``, and a timestamp before it with ``--prefix-output-with-timestamp``),
so that two ranks' lines never run together; ``--no-tag-output`` passes the ranks' output
through untouched.

The children run in sessions of their own, so a signal meant for the job reaches them once:
SIGINT, SIGTERM and SIGHUP sent to the launcher are passed on to every rank. Once a rank
fails, the others get :data:`GRACE_S` seconds to end (baguahvd makes their collectives fail
at once), then SIGTERM, then SIGKILL. The exit status is the worst of the ranks' (a rank
ended by signal N counts as 128 + N).

Only this machine's slots can be used: ranks on other hosts would need a remote starter,
which ``--gloo`` does not have here (use mpirun, the default, for those).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import BinaryIO

from baguahvd.runner.hosts import Host, LaunchError, is_local
from baguahvd.runner.mpirun import rank_environment

GRACE_S = 30.0
"""Seconds the other ranks get to end by themselves after one failed."""

KILL_AFTER_S = 10.0
"""Seconds between SIGTERM and SIGKILL for ranks that outlive the grace period."""

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Variables of other launchers that would make a rank believe it runs under them.
_FOREIGN_PREFIXES = ("OMPI_COMM_WORLD_", "PMIX_", "PMI_")
_FOREIGN_NAMES = (
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "TORCHELASTIC_USE_AGENT_STORE",
)


def free_port() -> int:
    """A TCP port that nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def check_local(hosts: Sequence[Host]) -> None:
    """Raises LaunchError naming the hosts that are not this machine."""
    remote = [host.name for host in hosts if not is_local(host.name)]
    if remote:
        raise LaunchError(
            f"--gloo starts the ranks on this machine only, but the hosts include "
            f"{', '.join(remote)}; launch across machines without --gloo (mpirun), or run "
            "torchrun on each machine"
        )


def rank_environments(
    args: argparse.Namespace, env: Mapping[str, str], num_proc: int, port: int
) -> list[dict[str, str]]:
    """Each rank's environment: the options' variables (as for mpirun) plus torchrun's."""
    base = shared_environment(args, env)
    return [dict(base, **rank_variables(rank, num_proc, port)) for rank in range(num_proc)]


def shared_environment(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """What every rank's environment holds besides :func:`rank_variables`: the options'
    variables (as for mpirun), without other launchers' rank variables."""
    base, _ = rank_environment(args, env)
    for name in list(base):
        if name.startswith(_FOREIGN_PREFIXES) or name in _FOREIGN_NAMES:
            del base[name]
    base.update(
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        BAGUAHVD_CPU_BACKEND="gloo",
    )
    return base


def rank_variables(
    rank: int, num_proc: int, port: int, local_rank: int | None = None
) -> dict[str, str]:
    """The variables that make a process rank ``rank`` of ``num_proc`` meeting on the TCP
    store at ``port``: torchrun's and Horovod's. ``local_rank`` defaults to ``rank``."""
    local = rank if local_rank is None else local_rank
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(local),
        WORLD_SIZE=str(num_proc),
        LOCAL_WORLD_SIZE=str(num_proc),
        MASTER_PORT=str(port),
        **horovod_variables(rank, num_proc, local),
    )


def horovod_variables(rank: int, num_proc: int, local_rank: int | None = None) -> dict[str, str]:
    """The per-rank variables ``horovodrun --gloo`` gives a rank on a single host.

    Scripts (and Horovod's own tests) read them to learn their rank or that gloo runs the
    job; the ranks still meet on the launcher's TCP store (MASTER_ADDR/MASTER_PORT), which
    :func:`baguahvd.common.config.launch_from_env` prefers when no Horovod rendezvous
    server is named.
    """
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(num_proc),
        "HOROVOD_LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "HOROVOD_LOCAL_SIZE": str(num_proc),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
    }


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it (128 + N when signal N ended it)."""
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(
    command: Sequence[str],
    environments: Sequence[Mapping[str, str]],
    tag_output: bool = True,
    timestamp: bool = False,
) -> int:
    """Starts one process per environment and waits for all; returns the worst status.
    With ``tag_output``, every line the ranks write is prefixed (see the module docstring)."""
    children: list[subprocess.Popen[bytes]] = []
    copiers: list[threading.Thread] = []
    lock = threading.Lock()

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    pipe = subprocess.PIPE if tag_output else None
    try:
        for rank, environment in enumerate(environments):
            child = subprocess.Popen(
                list(command), env=dict(environment), start_new_session=True,
                stdout=pipe, stderr=pipe,
            )
            children.append(child)
            if tag_output:
                assert child.stdout is not None and child.stderr is not None
                for source, target, name in (
                    (child.stdout, sys.stdout.buffer, "stdout"),
                    (child.stderr, sys.stderr.buffer, "stderr"),
                ):
                    copier = threading.Thread(
                        target=copy_lines,
                        args=(source, target, f"[{rank}]<{name}>:".encode(), lock, timestamp),
                        daemon=True,
                    )
                    copier.start()
                    copiers.append(copier)
        status = wait_all(children)
        for copier in copiers:
            copier.join()
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def copy_lines(
    source: BinaryIO, target: BinaryIO, prefix: bytes, lock: threading.Lock,
    timestamp: bool = False,
) -> None:
    """Copies ``source`` to ``target`` line by line, each line prefixed and written whole
    (a last line without its newline gets one), until ``source`` ends."""
    for line in iter(source.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        stamp = time.strftime("[%a %b %d %H:%M:%S %Y]").encode() if timestamp else b""
        with lock:
            target.write(stamp + prefix + line)
            target.flush()
    source.close()


def wait_all(children: Sequence[subprocess.Popen[bytes]]) -> int:
    """Waits for every child and returns the worst status; once one has failed, the others
    get :data:`GRACE_S` seconds, then SIGTERM, then SIGKILL after :data:`KILL_AFTER_S`."""
    failed_at: float | None = None
    terminated_at: float | None = None
    while True:
        codes = [child.poll() for child in children]
        if all(code is not None for code in codes):
            return max(exit_status(code) for code in codes if code is not None)
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if failed_at is not None and terminated_at is None and now - failed_at > GRACE_S:
            terminated_at = now
            for child in children:
                if child.poll() is None:
                    child.terminate()
        if terminated_at is not None and now - terminated_at > KILL_AFTER_S:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.05)


def launch(args: argparse.Namespace, env: Mapping[str, str], hosts: Sequence[Host],
           num_proc: int) -> int:
    """Runs ``args.command`` on ``num_proc`` local ranks; returns the worst exit status.

    Raises:
        LaunchError: some host is not this machine.
    """
    check_local(hosts)
    return run_ranks(
        args.command, rank_environments(args, env, num_proc, free_port()),
        tag_output=args.tag_output, timestamp=args.prefix_output_with_timestamp,
    )
