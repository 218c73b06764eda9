"""``baguahvdrun`` and ``python -m baguahvd.run``: the launcher's entry point.

The launcher lives in :mod:`baguahvd.runner`; see :mod:`baguahvd.runner.cli` for its flags.
"""

import sys

from baguahvd.runner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
