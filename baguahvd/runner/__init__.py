"""``baguahvdrun``, the ``horovodrun``-compatible launcher, as modules in one downward order.

Each module imports only those listed before it (and ``baguahvd.common``);
the launcher talks to the ranks only through their environment and the files of
:mod:`baguahvd.common.elastic_protocol`:

- :mod:`.hosts`: ``-H`` and ``--hostfile`` parsing, slots, which names mean this machine;
- :mod:`.allocation`: the hosts of a Slurm, PBS or LSF job or of an Open MPI default host
  file (Kubeflow MPIJob), used when neither ``-H`` nor ``--hostfile`` is given;
- :mod:`.configfile`: ``--config-file``, ``horovodrun``'s YAML settings file;
- :mod:`.options`: what the tuning and multi-node options become (rank variables,
  ``mpirun`` flags, notes for options without effect);
- :mod:`.mpirun`: finding Open MPI's ``mpirun``, checking the request and building the
  command and environment of one launch;
- :mod:`.local_gloo`: ``--gloo``, the ranks as local child processes joined by gloo;
- :mod:`.elastic`: ``--elastic`` (settings, host discovery, the relaunch loop);
- :mod:`.arguments`: the argument parser, every ``horovodrun`` option and ours;
- :mod:`.cli`: :func:`main`, the ``baguahvdrun`` entry point;
- :mod:`.task` and :mod:`.api`: Horovod's Python launch API, :func:`~.api.run` (one
  function call on every rank through ``baguahvdrun``, results returned in rank order).
"""

from baguahvd.runner.cli import main

__all__ = ["main"]
