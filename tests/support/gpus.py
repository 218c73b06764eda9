"""The GPU a rank of a parallel test drives."""

from __future__ import annotations

import pytest
import torch

import baguahvd.torch as hvd


def rank_gpu() -> torch.device:
    """This rank's GPU (local_rank), selected as Horovod's scripts pin it; skips the test
    without a GPU, without CuPy's NCCL, or with fewer GPUs than ranks on the node."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not hvd.nccl_built():
        pytest.skip("needs CuPy with NCCL (pip install baguahvd[cuda12])")
    if torch.cuda.device_count() < hvd.local_size():
        pytest.skip(f"needs {hvd.local_size()} GPUs on this node")
    torch.cuda.set_device(hvd.local_rank())
    return torch.device("cuda", hvd.local_rank())
