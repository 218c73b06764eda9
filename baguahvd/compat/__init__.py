"""Modules that exist to mirror Horovod's module paths, and the machinery that maps them.

- :mod:`~baguahvd.compat.aliases`: the import shim's alias finder (``horovod.torch.*`` and
  ``horovod.common.*`` answered with baguahvd's modules) and :func:`shim_path`;
- :mod:`~baguahvd.compat.common_util`: ``horovod.common.util``;
- :mod:`~baguahvd.compat.runner_threads`: ``horovod.runner.util.threads``.

Nothing in baguahvd's own layers below the launcher imports them.
"""
