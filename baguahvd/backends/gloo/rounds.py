"""The rounds of an in-process elastic job (``baguahvdrun --gloo --elastic``), as the ranks
read them: the round file and the wait for a round (the protocol is
:mod:`baguahvd.common.elastic_protocol`'s).

Two waits use it. A survivor of a failure or a host change waits for the round after the
one it left (:mod:`baguahvd.torch.elastic.rounds`). A process started for a lost slot
while the survivors went on without it waits in ``hvd.init()`` (:func:`await_admission`),
before the launch variables are read, for the first round that names it: it says that it
is ready, and the launcher forms that round once the survivors reach a commit.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable, MutableMapping

from baguahvd.common import elastic_protocol as protocol
from baguahvd.common.exceptions import HorovodInternalError

logger = logging.getLogger("baguahvd")

POLL_S = 0.02
"""How often a waiting rank reads the round file."""

DEFAULT_TIMEOUT_S = 600.0
"""A survivor's wait for the next round when the launcher did not say (``--elastic-timeout``)."""


class RoundTimeoutError(HorovodInternalError):
    """No new round of the elastic job came within ``--elastic-timeout`` seconds, or the
    launcher is gone: the message names the round waited for."""


def read_round(folder: str) -> dict[str, object] | None:
    """The current round's record, or None while there is none (the launcher replaces the
    file atomically, so a record read is whole)."""
    try:
        with open(os.path.join(folder, protocol.ROUND_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def wait_for_round(
    folder: str,
    launch: int,
    after: int,
    timeout_s: float | None,
    clock: Callable[[], float] = time.monotonic,
    launcher_alive: Callable[[], bool] = lambda: True,
) -> dict[str, object]:
    """Waits for a round of ``launch`` numbered above ``after`` and returns its record.

    Args:
        folder: the job's elastic folder.
        launch: the launch index (``BAGUAHVD_ELASTIC_RESTART``).
        after: the newest round that does not do.
        timeout_s: seconds to wait at most; None waits as long as ``launcher_alive()``.
        clock: the time, in seconds.
        launcher_alive: whether the launcher still runs.

    Raises:
        RoundTimeoutError: no such round came in time, or the launcher is gone.
    """
    deadline = None if timeout_s is None else clock() + timeout_s
    while True:
        record = read_round(folder)
        if record is not None and record.get("launch") == launch:
            number = record.get("round")
            if isinstance(number, int) and number > after:
                return record
        if deadline is not None and clock() >= deadline:
            raise RoundTimeoutError(
                f"waited {timeout_s:g} s (--elastic-timeout) for round {after + 1} of launch "
                f"{launch} of the elastic job in {folder}, but baguahvdrun did not form it; "
                "is the launcher still running?"
            )
        if not launcher_alive():
            raise RoundTimeoutError(
                f"waited for round {after + 1} of launch {launch} of the elastic job in "
                f"{folder}, but baguahvdrun, which forms it, has ended"
            )
        time.sleep(POLL_S)


def take_round(env: MutableMapping[str, str], record: dict[str, object], worker: str) -> bool:
    """Puts the launcher variables ``record`` gives ``worker`` into ``env`` (as a rank
    started for that round gets them) and the round's number; False, changing nothing, when
    the round does not name the worker (it was left out)."""
    members = record.get("workers")
    variables = members.get(worker) if isinstance(members, dict) else None
    if not isinstance(variables, dict):
        return False
    env.update({str(name): str(value) for name, value in variables.items()})
    env[protocol.ROUND_ENV] = str(record["round"])
    return True


def _warm_up() -> None:
    """Imports what a training script's first optimizer imports (torch's dynamo, seconds
    of imports), so that the running ranks do not wait for it once this process joins."""
    try:
        importlib.import_module("torch._dynamo")
    except ImportError:
        pass  # an older torch: its optimizers do not import it either


def await_admission(env: MutableMapping[str, str] | None = None) -> None:
    """In a process started to join the running ranks later (:data:`~baguahvd.common.
    elastic_protocol.JOIN_ENV`): imports what the script is about to need, says that it
    is ready, waits for the first round that names it and takes that round's variables
    into ``env`` (``os.environ``), so that ``hvd.init()`` starts the engine in it. Does
    nothing in any other process.

    A round that does not name it is not for it: it waits on (the launcher names a
    waiting process once it is ready, or stops it).

    Raises:
        RoundTimeoutError: the launcher ended before such a round came.
    """
    env = os.environ if env is None else env
    if env.get(protocol.JOIN_ENV, "") != "1":
        return
    folder = env[protocol.ELASTIC_DIR_ENV]
    worker = env[protocol.WORKER_ENV]
    launch = int(env.get(protocol.RESTART_ENV, "0") or 0)
    current = int(env.get(protocol.ROUND_ENV, "0") or 0)
    launcher = os.getppid()
    _warm_up()
    ready = os.path.join(folder, f"{protocol.READY_PREFIX}{launch}.{worker}")
    with open(ready, "w", encoding="utf-8"):
        pass
    logger.info("ready to join the running job; waiting for a round that takes this process")
    while True:
        record = wait_for_round(
            folder, launch, current, None, launcher_alive=lambda: os.getppid() == launcher
        )
        current = int(record["round"])  # type: ignore[call-overload]
        if take_round(env, record, worker):
            del env[protocol.JOIN_ENV]
            logger.info("joining round %d of launch %d", current, launch)
            return
