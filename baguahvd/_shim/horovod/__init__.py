"""Stand-in for the ``horovod`` package, backed by baguahvd (see ``baguahvd._shim``).

Only on ``sys.path`` when the user asked for it (``baguahvdrun --as-horovod``,
``BAGUAHVD_AS_HOROVOD=1`` or ``PYTHONPATH=$(baguahvdrun --shim-path)``).
"""

import baguahvd as _baguahvd
from baguahvd._shim import HOROVOD_API_VERSION as _HOROVOD_API_VERSION
from baguahvd._shim import install_aliases as _install_aliases

__version__ = _HOROVOD_API_VERSION
__baguahvd_version__ = _baguahvd.__version__

_install_aliases()
