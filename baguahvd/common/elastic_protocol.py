"""The contract between ``baguahvdrun --elastic`` and the ranks it starts.

Elastic jobs survive failures and host changes by restarting: the launcher runs ``mpirun``
in a loop, and every rank resumes from the state the job last committed.

* Every rank of every launch gets :data:`ELASTIC_ENV` ``=1``, :data:`ELASTIC_DIR_ENV` (the
  folder for commits and notices, the same for every launch of a job),
  :data:`RESTART_ENV` (how many launches came before this one: ``0`` for the first) and
  :data:`HOSTS_VERSION_ENV` (the version of the host set this launch was started with).
* When the host set changes while a launch runs, the launcher writes
  ``<ELASTIC_DIR>/``:data:`HOSTS_NOTICE_FILE` atomically (a temporary file, then
  ``os.replace``) as JSON: ``{"version": v, "hosts": [["host", slots], ...],
  "result": "added" | "removed" | "mixed"}``. Versions count the changes; version ``0`` is
  the initial host set and is never written. A rank that finds a version newer than its
  :data:`HOSTS_VERSION_ENV` commits and exits with :data:`RESIZE_EXIT_CODE`.
* The launcher reads ``mpirun``'s exit status: ``0`` ends the job, :data:`RESIZE_EXIT_CODE`
  relaunches at once on the new host set without counting as a failure, anything else is a
  failure that is relaunched while ``--max-restarts`` allows.
* Before each launch the launcher removes ``<ELASTIC_DIR>/``:data:`TRAINING_MARK_FILE`; a
  rank creates it once it has restored the job's state and entered the training function.
  A failed launch without it failed while starting up (an import error, an unreadable
  commit). When two launches in a row fail that way with the same error, relaunching cannot
  help, so the launcher ends the job with that error.

In-process recovery (``baguahvdrun --gloo --elastic``): the launcher starts the ranks
itself and keeps them across failures and host changes. The ranks of one launch meet in
*rounds*, numbered from ``0``; each round has its own TCP store, hosted by its rank 0.

* Every rank also gets :data:`WORKER_ENV` (its worker id, fixed for the life of the
  process), :data:`ROUND_ENV` (the round it was started for: ``0`` for the ranks of a new
  launch, more for one started to fill a slot of a running job, which then skips resuming
  from the folder and takes its state from rank 0) and :data:`ROUND_TIMEOUT_ENV` (how long
  a rank waits for the next round).
* The launcher writes ``<ELASTIC_DIR>/``:data:`ROUND_FILE` atomically before it starts any
  rank of a round: JSON ``{"launch": l, "round": r, "workers": {"<worker id>":
  {"<variable>": "<value>", ...}}}``, the launcher variables (rank, size, store address) of
  every member. A worker missing from a round has been left out (its slot was removed) and
  ends with status 0.
* A rank whose collective failed, or that saw a host change, shuts its engine down and
  creates ``<ELASTIC_DIR>/``:data:`ROUND_REQUEST_PREFIX` ``<launch>.<round>.<worker id>``
  (empty); the launcher forms the next round when it finds a request for its current round
  or when a rank of it exits with a non-zero status, and starts ranks only for the slots no
  surviving rank fills. A rank that waits longer than :data:`ROUND_TIMEOUT_ENV` for a newer
  round raises an error naming the round it waited for.
* When a rank is lost and ``--min-np`` allows it, the survivors go on at once in a round of
  their own, and the process started for the lost slot joins later: it gets
  :data:`JOIN_ENV` ``=1`` (and no rank variables), creates
  ``<ELASTIC_DIR>/``:data:`READY_PREFIX` ``<launch>.<worker id>`` (empty) when it reaches
  ``hvd.init()``, and waits there, as long as the launcher runs, for a round that names it.
  The launcher then announces a host change (a notice whose version is one more and whose
  hosts are unchanged, ``"result": "added"``), so that the survivors ask for a new round at
  their next commit, and forms that round with the waiting processes that are ready.

The ranks own the rest of the folder (see :mod:`baguahvd.torch.elastic.store`):

* :data:`JOB_FILE` names the job: JSON ``{"job_id": "<32 hex digits>", "format": 2}``,
  created once, with ``O_CREAT | O_EXCL``, by the first rank that finds none, so exactly one
  rank's id wins; a rank that finds the file still being written waits for a whole record.
  The job id is derived from the folder alone: the launcher never writes it. Starting a
  finished job afresh replaces it atomically with a new id.
* Commit ``n`` of a host is two files: ``commit-<n>.<host>.pt`` (the payload, ``torch.save``
  of tensors and plain values, read with ``weights_only=True``) and
  ``commit-<n>.<host>.json``, its manifest, written after the payload:
  ``{"format": 2, "job_id", "host", "commit": n, "payload": "<payload name>",
  "bytes": <payload size>, "sha256": "<hex digest of the payload bytes>"}``.
  A commit counts only when its manifest matches the job id, its own name and the payload's
  size and digest.
* :data:`FINISHED_FILE` records that the training function returned:
  JSON ``{"job_id", "commit": n}``. A later run (launch ``0``) on the folder does not resume
  a finished job; see ``BAGUAHVD_ELASTIC_FINISHED``.
"""

from __future__ import annotations

from typing import Final

RESIZE_EXIT_CODE: Final = 75
"""Exit status of a rank (and so of the job) that stopped because the host set changed."""

ELASTIC_ENV: Final = "HOROVOD_ELASTIC"
"""Set to ``1`` for the ranks of an elastic job."""
ELASTIC_DIR_ENV: Final = "BAGUAHVD_ELASTIC_DIR"
"""The folder holding the job's commits and the host-change notice."""
RESTART_ENV: Final = "BAGUAHVD_ELASTIC_RESTART"
"""How many launches of the job came before this one (``0`` for the first)."""
HOSTS_VERSION_ENV: Final = "BAGUAHVD_ELASTIC_HOSTS_VERSION"
"""The version of the host set this launch was started with (``0`` for the initial set)."""

TRAINING_MARK_FILE: Final = "training.started"
"""Created in :data:`ELASTIC_DIR_ENV`'s folder by a rank that has started training."""

HOSTS_NOTICE_FILE: Final = "hosts.json"
"""Name of the host-change notice inside :data:`ELASTIC_DIR_ENV`'s folder."""
HOSTS_ADDED: Final = "added"
"""Notice ``result``: hosts or slots were added and none removed."""
HOSTS_REMOVED: Final = "removed"
"""Notice ``result``: hosts or slots were removed and none added."""
HOSTS_MIXED: Final = "mixed"
"""Notice ``result``: some hosts or slots were added and others removed."""

JOB_FILE: Final = "job.json"
"""The job's id inside :data:`ELASTIC_DIR_ENV`'s folder, written once by the ranks."""
FINISHED_FILE: Final = "finished.json"
"""Written into :data:`ELASTIC_DIR_ENV`'s folder when the training function returned."""
COMMIT_FORMAT: Final = 2
"""Version of the commit files and of :data:`JOB_FILE`."""

ROUND_FILE: Final = "round.json"
"""In-process recovery: the current round's members and their launcher variables."""
ROUND_REQUEST_PREFIX: Final = "round-request."
"""In-process recovery: prefix of a rank's request for a new round."""
WORKER_ENV: Final = "BAGUAHVD_ELASTIC_WORKER"
"""In-process recovery: the rank's worker id, the key of its entry in :data:`ROUND_FILE`."""
ROUND_ENV: Final = "BAGUAHVD_ELASTIC_ROUND"
"""In-process recovery: the round the rank was started for."""
ROUND_TIMEOUT_ENV: Final = "BAGUAHVD_ELASTIC_ROUND_TIMEOUT"
"""In-process recovery: seconds a rank waits for the next round (``--elastic-timeout``)."""
JOIN_ENV: Final = "BAGUAHVD_ELASTIC_JOIN"
"""In-process recovery: ``1`` for a process started to join the running ranks at a later
round; its ``hvd.init()`` waits for that round."""
READY_PREFIX: Final = "round-ready."
"""In-process recovery: prefix of a waiting process's notice that it is ready to join."""
