"""Stand-in for the ``lightning_bagua`` package, backed by baguahvd: a script's
``from lightning_bagua import BaguaStrategy`` (or ``from lightning_bagua.strategy import
BaguaStrategy``) gets :class:`baguahvd.lightning.BaguaStrategy`, and importing it registers
``Trainer(strategy="bagua")`` in every installed Lightning package.

Only on ``sys.path`` when the user asked for it, as the ``horovod`` stand-in beside it
(``baguahvdrun --as-horovod``, ``BAGUAHVD_AS_HOROVOD=1`` or
``PYTHONPATH=$(baguahvdrun --shim-path)``); an installed lightning_bagua is used otherwise.
"""

from baguahvd.lightning import BaguaStrategy

__all__ = ["BaguaStrategy"]
