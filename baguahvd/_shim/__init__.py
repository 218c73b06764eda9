"""The folder that stands in for Horovod: it holds a package named ``horovod``.

Nothing here is imported by baguahvd itself. :func:`baguahvd.compat.aliases.shim_path` returns
this folder, which ``baguahvdrun --as-horovod`` puts first on the ranks' ``PYTHONPATH``; the
machinery (the alias finder) lives in :mod:`baguahvd.compat.aliases`.
"""
