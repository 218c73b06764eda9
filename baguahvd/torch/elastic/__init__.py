"""Horovod's ``horovod.torch.elastic``: training that survives failures and host changes."""

from baguahvd.runtime.runtime import runtime as _runtime
from baguahvd.torch.elastic import sampler as sampler
from baguahvd.torch.elastic import state as state
from baguahvd.torch.elastic.base import run_fn as run_fn
from baguahvd.torch.elastic.loop import run
from baguahvd.torch.elastic.sampler import ElasticSampler
from baguahvd.torch.elastic.state import TorchState

init = _runtime.init
shutdown = _runtime.shutdown

__all__ = ["TorchState", "ElasticSampler", "run"]
