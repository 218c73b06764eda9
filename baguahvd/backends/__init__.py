"""Communication backends: the only place that talks to MPI (mpi4py) or NCCL (CuPy)."""
