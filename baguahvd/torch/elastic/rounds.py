"""In-process recovery: a rank's side of the rounds of ``baguahvdrun --gloo --elastic``.

Under ``baguahvdrun --gloo --elastic`` the ranks outlive failures and host changes. The
launcher (:mod:`baguahvd.runner.elastic.rounds`) numbers the memberships of a launch as
*rounds*, each with its own TCP store hosted by its rank 0, and publishes the current one
in :data:`~baguahvd.common.elastic_protocol.ROUND_FILE` (the protocol is that module's).
When a collective fails (``HorovodInternalError``) or a commit reports a host change
(``HostsUpdatedInterrupt``), :func:`rejoin`:

1. shuts the engine down (its communicators, NCCL ones included, go with it);
2. asks the launcher for a new round (a request file for the round it leaves);
3. waits for a round newer than the one it left, at most ``--elastic-timeout`` seconds
   (:class:`RoundTimeoutError`), and leaves the job with status 0 if the round does not
   name it (its slot was removed);
4. takes the round's launcher variables (rank, size, store address) into ``os.environ``,
   as a rank started for that round gets them, and starts the engine again. A start that
   fails (a member died before it joined) asks for the next round and waits again.

The caller (:func:`baguahvd.torch.elastic.base.run_fn`) then restores the last in-memory
commit, runs the reset callbacks and syncs every rank from rank 0. A rank started for a
round after the first (:func:`joins_running_job`) does not resume from the folder: its
state comes from rank 0, a survivor, by that sync.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping

from baguahvd.common import elastic_protocol as protocol
from baguahvd.common.exceptions import HorovodInternalError

logger = logging.getLogger(__name__)

_POLL_S = 0.02
_DEFAULT_TIMEOUT_S = 600.0

__all__ = ["RoundTimeoutError", "in_process", "joins_running_job", "rejoin"]


class RoundTimeoutError(HorovodInternalError):
    """No new round of the elastic job came within ``--elastic-timeout`` seconds: the
    launcher is gone or could not fill the job; the message names the round waited for."""


def in_process(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank recovers in place (started by ``baguahvdrun --gloo --elastic``)."""
    env = os.environ if env is None else env
    return bool(env.get(protocol.WORKER_ENV, "").strip() and env.get(protocol.ELASTIC_DIR_ENV))


def joins_running_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank was started to fill a slot of a running job (round after 0)."""
    env = os.environ if env is None else env
    return in_process(env) and int(env.get(protocol.ROUND_ENV, "0") or 0) > 0


def _read_round(folder: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(folder, protocol.ROUND_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None  # not written yet; the launcher replaces it atomically
    return record if isinstance(record, dict) else None


def _request(folder: str, launch: int, round_number: int, worker: str) -> None:
    name = f"{protocol.ROUND_REQUEST_PREFIX}{launch}.{round_number}.{worker}"
    with open(os.path.join(folder, name), "w", encoding="utf-8"):
        pass


def _wait_for_round(
    folder: str, launch: int, after: int, timeout_s: float, clock: Callable[[], float]
) -> dict[str, object]:
    deadline = clock() + timeout_s
    while True:
        record = _read_round(folder)
        if record is not None and record.get("launch") == launch:
            number = record.get("round")
            if isinstance(number, int) and number > after:
                return record
        if clock() >= deadline:
            raise RoundTimeoutError(
                f"waited {timeout_s:g} s (--elastic-timeout) for round {after + 1} of launch "
                f"{launch} of the elastic job in {folder}, but baguahvdrun did not form it; "
                "is the launcher still running?"
            )
        time.sleep(_POLL_S)


def rejoin(
    shutdown: Callable[[], None],
    init: Callable[[], None],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Leaves the current round and starts the engine in the next one (see the module
    docstring). ``shutdown`` and ``init`` stop and start the framework.

    Raises:
        RoundTimeoutError: no new round came in time.
        SystemExit: status 0, when the new round leaves this worker out.
    """
    env = os.environ
    folder = env[protocol.ELASTIC_DIR_ENV]
    worker = env[protocol.WORKER_ENV]
    launch = int(env.get(protocol.RESTART_ENV, "0") or 0)
    timeout_s = float(env.get(protocol.ROUND_TIMEOUT_ENV, "") or _DEFAULT_TIMEOUT_S)
    current = int(env.get(protocol.ROUND_ENV, "0") or 0)
    shutdown()
    while True:
        _request(folder, launch, current, worker)
        record = _wait_for_round(folder, launch, current, timeout_s, clock)
        current = int(record["round"])  # type: ignore[call-overload]
        members = record.get("workers")
        variables = members.get(worker) if isinstance(members, dict) else None
        if not isinstance(variables, dict):
            logger.info("round %d leaves worker %s out; leaving the job", current, worker)
            raise SystemExit(0)
        env.update({str(name): str(value) for name, value in variables.items()})
        env[protocol.ROUND_ENV] = str(current)
        try:
            init()
        except ValueError as error:
            # A member of the round died before it joined: the launcher forms another.
            logger.warning("round %d could not start (%s); asking for the next", current, error)
            shutdown()
            continue
        logger.info("joined round %d of launch %d", current, launch)
        return
