"""Stand-in for the ``horovod`` package, backed by baguahvd (see ``baguahvd.compat.aliases``).

Only on ``sys.path`` when the user asked for it (``baguahvdrun --as-horovod``,
``BAGUAHVD_AS_HOROVOD=1`` or ``PYTHONPATH=$(baguahvdrun --shim-path)``).
"""

import baguahvd as _baguahvd
from baguahvd.compat.aliases import HOROVOD_API_VERSION as _HOROVOD_API_VERSION
from baguahvd.compat.aliases import install_aliases as _install_aliases
from baguahvd.runner.api import run

__version__ = _HOROVOD_API_VERSION
__baguahvd_version__ = _baguahvd.__version__

__all__ = ["run"]

_install_aliases()
