"""``horovod.runner`` for scripts that launch from Python: ``horovod.runner.run(func, ...)``."""

from baguahvd.runner.api import RunError, run

__all__ = ["RunError", "run"]
