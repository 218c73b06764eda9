"""Communication backends: the only place that talks to MPI (mpi4py), gloo
(torch.distributed) or NCCL (CuPy).

- :mod:`~baguahvd.backends.base`: the interfaces, ``Communicator`` (data plane) and
  ``ControlPlane`` (negotiation, alarms, exit), and the device-communicator factory type;
- :mod:`~baguahvd.backends.mpi`: MPI's data plane, control plane, topology and setup
  helpers (importing it starts MPI: call :func:`prepare_mpi` first);
- :mod:`~baguahvd.backends.gloo`: gloo's data plane, control plane, topology and store,
  for jobs started by torchrun or ``horovodrun --gloo`` (no MPI);
- :mod:`~baguahvd.backends.nccl`: NCCL through CuPy for CUDA tensors.
"""

from __future__ import annotations

import sys


def prepare_mpi(threads_disable: bool) -> None:
    """Chooses MPI's thread level before MPI starts (HOROVOD_MPI_THREADS_DISABLE).

    The engine thread makes every MPI call of baguahvd, so MPI_THREAD_SERIALIZED suffices;
    MPI_THREAD_MULTIPLE (the default) also lets user threads call MPI themselves. Has no
    effect once MPI has been initialised.
    """
    if "mpi4py.MPI" in sys.modules:
        return
    import mpi4py

    mpi4py.rc.thread_level = "serialized" if threads_disable else "multiple"
