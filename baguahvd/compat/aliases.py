"""Lets unmodified Horovod scripts run on baguahvd.

The folder returned by :func:`shim_path` (``baguahvd/_shim``) holds a package named
``horovod``. Put on
``PYTHONPATH`` (``baguahvdrun --as-horovod`` does it for every rank), it makes
``import horovod.torch as hvd`` load ``baguahvd.torch``. Nothing here is on ``sys.path`` by
default, so an installed Horovod is never shadowed unless the user asks for it.

The shim's ``horovod.torch`` is a thin module that re-exports ``baguahvd.torch``. Every other
module under ``horovod.torch`` and ``horovod.common`` is an alias: :class:`AliasFinder` answers
``import horovod.torch.mpi_ops`` with the very module object ``baguahvd.torch.mpi_ops``, so
classes and exceptions are identical under both names (``except
horovod.common.exceptions.HorovodInternalError`` catches baguahvd's error). Aliases are
resolved when first imported, so a module that baguahvd does not have fails with the usual
``ModuleNotFoundError`` only when a script asks for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

HOROVOD_API_VERSION = "0.28.1"
"""The Horovod release whose API baguahvd mirrors; the shim reports it as ``__version__``."""

_ALIASED_PREFIXES = (
    ("horovod.torch.", "baguahvd.torch."),
    ("horovod.common.", "baguahvd.common."),
)
_ALIASED_PACKAGES = {"horovod.common": "baguahvd.common"}
_MOVED_MODULES = {
    "horovod.common.basics": "baguahvd.runtime.runtime",
    "horovod.common.elastic": "baguahvd.torch.elastic.base",
    "horovod.common.process_sets": "baguahvd.runtime.process_sets",
    "horovod.common.util": "baguahvd.compat.common_util",
}
"""Horovod's ``common`` modules whose baguahvd counterparts live elsewhere: in a higher
layer, or in :mod:`baguahvd.compat` where only Horovod's path needs them."""


def shim_path() -> str:
    """Returns the folder to prepend to ``PYTHONPATH`` so that ``horovod`` means baguahvd.

    It is located on disk, not imported: the ``horovod`` package inside it sits above
    everything else in baguahvd, while this module is imported by the launcher.
    """
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package_root, "_shim")


def alias_target(fullname: str) -> str | None:
    """Returns the baguahvd module that the Horovod module ``fullname`` stands for.

    Args:
        fullname: a dotted module name such as ``"horovod.torch.mpi_ops"``.

    Returns:
        The baguahvd module name, or ``None`` when ``fullname`` is not aliased (the shim's own
        ``horovod`` and ``horovod.torch`` packages, and anything outside Horovod).
    """
    if fullname in _ALIASED_PACKAGES:
        return _ALIASED_PACKAGES[fullname]
    if fullname in _MOVED_MODULES:
        return _MOVED_MODULES[fullname]
    for horovod_prefix, baguahvd_prefix in _ALIASED_PREFIXES:
        if fullname.startswith(horovod_prefix):
            return baguahvd_prefix + fullname[len(horovod_prefix) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads a Horovod module name as the already existing baguahvd module."""

    def __init__(self, target: str) -> None:
        self._target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # The import system keeps the target's own __spec__/__name__ (it only fills in missing
        # attributes) and registers the object under the Horovod name as well.
        return importlib.import_module(self._target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the target module was executed when it was imported."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """Meta path finder that maps ``horovod.torch.*`` and ``horovod.common*`` to baguahvd."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """Returns an aliasing spec when baguahvd has the module ``fullname`` stands for."""
        target_name = alias_target(fullname)
        if target_name is None:
            return None
        try:
            target_spec = importlib.util.find_spec(target_name)
        except (ImportError, ValueError):
            return None
        if target_spec is None:
            return None
        return importlib.util.spec_from_loader(
            fullname,
            _AliasLoader(target_name),
            is_package=target_spec.submodule_search_locations is not None,
        )


def install_aliases() -> None:
    """Puts :class:`AliasFinder` first on ``sys.meta_path``; calling it again does nothing.

    It must come before the path finder: otherwise ``horovod.common.exceptions`` would be
    found in ``baguahvd/common`` (the aliased package's ``__path__``) and executed a second
    time as a separate module with separate exception classes.
    """
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
