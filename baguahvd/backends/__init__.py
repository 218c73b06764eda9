"""Communication backends: the only place that talks to MPI (mpi4py) or NCCL (CuPy)."""

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
