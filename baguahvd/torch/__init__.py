"""Horovod's ``horovod.torch`` API: change ``import horovod.torch as hvd`` to
``import baguahvd.torch as hvd``."""

from baguahvd.common.capabilities import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    mpi_built,
    nccl_built,
    rocm_built,
)
from baguahvd.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.state import runtime as _runtime
from baguahvd.torch import elastic as elastic
from baguahvd.torch.averaging import averaged_state_dict
from baguahvd.torch.compression import Compression
from baguahvd.torch.distributed_optimizer import DistributedOptimizer
from baguahvd.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from baguahvd.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from baguahvd.torch.sync_batch_norm import SyncBatchNorm

init = _runtime.init
shutdown = _runtime.shutdown
is_initialized = _runtime.is_initialized
size = _runtime.size
rank = _runtime.rank
local_size = _runtime.local_size
local_rank = _runtime.local_rank
cross_size = _runtime.cross_size
cross_rank = _runtime.cross_rank
is_homogeneous = _runtime.is_homogeneous
mpi_enabled = _runtime.mpi_enabled
gloo_enabled = _runtime.gloo_enabled
mpi_threads_supported = _runtime.mpi_threads_supported
add_process_set = _runtime.add_process_set
remove_process_set = _runtime.remove_process_set


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "Product",
    "ProcessSet",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "averaged_state_dict",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
