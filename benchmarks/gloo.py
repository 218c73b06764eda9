"""torch.distributed over gloo on the ranks of an MPI job: PyTorch's own CPU collectives,
the reference that ``allreduce.py`` and ``algorithms.py`` compare baguahvd with."""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Any


def start_gloo(comm: Any) -> None:
    """Starts torch.distributed (gloo) on the ranks of ``comm`` (an mpi4py communicator).
    On the emulated cluster (EMU_NET_IF set) gloo is held to the shaped link, like MPI."""
    import torch.distributed as dist

    interface = os.environ.get("EMU_NET_IF")
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    address = None
    if comm.Get_rank() == 0:
        host = socket.gethostname()
        if interface:
            shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", interface],
                                   capture_output=True, text=True, check=True).stdout
            host = shown.split(" inet ", 1)[1].split("/", 1)[0]
        with socket.socket() as probe:
            probe.bind(("", 0))
            address = f"tcp://{host}:{probe.getsockname()[1]}"
    address = comm.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=address, rank=comm.Get_rank(),
                            world_size=comm.Get_size())
