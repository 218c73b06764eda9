"""``baguahvdrun --elastic``: run the job again after a failure or a host change.

An elastic job is a loop of ordinary ``mpirun`` launches. Every rank of every launch learns
where to commit its state and which launch it belongs to from the variables of
:mod:`baguahvd.common.elastic_protocol`, so a relaunched job resumes from its last commit.
The loop ends when a launch succeeds; a launch that fails is started again while
``--max-restarts`` allows, and one whose ranks stopped because the host set changed
(status :data:`~baguahvd.common.elastic_protocol.RESIZE_EXIT_CODE`) is started again at
once on the new hosts. ``--reset-limit`` bounds the relaunches of both kinds.

The hosts come from ``-H`` (fixed), ``--hostfile`` (read again before every launch) or
``--host-discovery-script`` (run before every launch, and every second while one runs; a
change is announced to the ranks in the notice file). Unlike ``horovodrun``, which leaves a
failed host out for good, a host is left out only with ``--blacklist-cooldown-range``, and
then for a while: relaunching on the same hosts is the normal way to recover here.

The launcher's own messages go to stderr with a ``baguahvdrun:`` prefix, like those of
:mod:`baguahvd.runner.cli`.

Under ``--gloo`` a launch is a pool of local ranks that recover in place instead, meeting
in rounds (:mod:`.rounds`); a launch is relaunched only when all of its ranks are lost.

Modules, each importing only those before it: :mod:`.settings` (the checked flags and the
errors), :mod:`.discovery` (the discovery script and host changes), :mod:`.launcher` (the
relaunch loop), :mod:`.rounds` (in-process recovery of gloo jobs).
"""

from baguahvd.runner.elastic.discovery import (
    DISCOVERY_TIMEOUT_SECONDS,
    discover_hosts,
    host_change,
    parse_discovered_hosts,
)
from baguahvd.runner.elastic.launcher import (
    ElasticLauncher,
    failed_nodes,
    last_exception,
    program_not_started,
)
from baguahvd.runner.elastic.settings import (
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_MAX_RESTARTS,
    POLL_SECONDS_ENV,
    ElasticError,
    ElasticSettings,
    HostDiscoveryError,
    NotEnoughSlotsError,
    launch_size,
)

__all__ = [
    "DEFAULT_ELASTIC_TIMEOUT",
    "DEFAULT_MAX_RESTARTS",
    "DISCOVERY_TIMEOUT_SECONDS",
    "POLL_SECONDS_ENV",
    "ElasticError",
    "ElasticLauncher",
    "ElasticSettings",
    "HostDiscoveryError",
    "NotEnoughSlotsError",
    "discover_hosts",
    "failed_nodes",
    "host_change",
    "last_exception",
    "launch_size",
    "parse_discovered_hosts",
    "program_not_started",
]
