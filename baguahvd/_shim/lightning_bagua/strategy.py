"""lightning_bagua's ``strategy`` module: :class:`baguahvd.lightning.BaguaStrategy`."""

from baguahvd.lightning import BaguaStrategy

__all__ = ["BaguaStrategy"]
