"""Runs ``examples/pytorch_digits.py`` on this rank, then saves what the test compares:
the trained weights and what ``hvd`` says about the job, to ``<out>/rank.<r>.pt``.

Usage: ``python tests/e2e/gloo_digits.py OUT_DIR [example arguments...]``, under any
launcher.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

import torch

import baguahvd.torch as hvd

ROOT = pathlib.Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    sys.argv = [str(ROOT / "examples" / "pytorch_digits.py"), *sys.argv[2:]]
    example = runpy.run_path(sys.argv[0], run_name="__main__")
    facts = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "gloo_enabled": hvd.gloo_enabled(),
        "mpi_enabled": hvd.mpi_enabled(),
    }
    weights = {k: v.detach().clone() for k, v in example["model"].state_dict().items()}
    torch.save({"facts": facts, "weights": weights}, out / f"rank.{hvd.rank()}.pt")
