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
state comes from rank 0, a survivor, by that sync. One started while the survivors went
on without it first waits in ``hvd.init()`` for the round that takes it in
(:func:`baguahvd.backends.gloo.rounds.await_admission`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

from baguahvd.backends.gloo.rounds import (
    DEFAULT_TIMEOUT_S,
    RoundTimeoutError,
    take_round,
    wait_for_round,
)
from baguahvd.common import elastic_protocol as protocol

logger = logging.getLogger(__name__)

__all__ = ["RoundTimeoutError", "in_process", "joins_running_job", "rejoin"]


def in_process(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank recovers in place (started by ``baguahvdrun --gloo --elastic``)."""
    env = os.environ if env is None else env
    return bool(env.get(protocol.WORKER_ENV, "").strip() and env.get(protocol.ELASTIC_DIR_ENV))


def joins_running_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank was started to fill a slot of a running job (round after 0)."""
    env = os.environ if env is None else env
    return in_process(env) and int(env.get(protocol.ROUND_ENV, "0") or 0) > 0


def _request(folder: str, launch: int, round_number: int, worker: str) -> None:
    name = f"{protocol.ROUND_REQUEST_PREFIX}{launch}.{round_number}.{worker}"
    with open(os.path.join(folder, name), "w", encoding="utf-8"):
        pass


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
    timeout_s = float(env.get(protocol.ROUND_TIMEOUT_ENV, "") or DEFAULT_TIMEOUT_S)
    current = int(env.get(protocol.ROUND_ENV, "0") or 0)
    shutdown()
    while True:
        _request(folder, launch, current, worker)
        record = wait_for_round(folder, launch, current, timeout_s, clock)
        current = int(record["round"])  # type: ignore[call-overload]
        if not take_round(env, record, worker):
            logger.info("round %d leaves worker %s out; leaving the job", current, worker)
            raise SystemExit(0)
        try:
            init()
        except ValueError as error:
            # A member of the round died before it joined: the launcher forms another.
            logger.warning("round %d could not start (%s); asking for the next", current, error)
            shutdown()
            continue
        logger.info("joined round %d of launch %d", current, launch)
        return
