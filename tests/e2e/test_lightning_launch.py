"""``python train.py`` with ``Trainer(strategy="baguahvd", devices=2)`` and no launcher:
Lightning's subprocess launcher starts the second rank, the two ranks meet on gloo through
torchrun's variables (no MPI), and both end with the same trained weights."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from tests.support import jobs

pytest.importorskip("lightning.pytorch")

SCRIPT = jobs.ROOT / "tests" / "support" / "lightning_self_launch.py"
TIMEOUT_S = 180

pytestmark = pytest.mark.parallel


def test_python_train_py_starts_its_ranks_and_trains_them_alike(tmp_path: pathlib.Path) -> None:
    (result,) = jobs.run_commands([[sys.executable, str(SCRIPT), str(tmp_path)]], tmp_path,
                                  TIMEOUT_S, [{}])
    assert result.returncode == 0, result.stdout[-5000:]
    saved = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for rank, state in enumerate(saved):
        assert (state["rank"], state["size"]) == (rank, 2), result.stdout[-5000:]
        assert (state["global_rank"], state["world_size"]) == (rank, 2)
        assert state["gloo"]
        assert torch.equal(state["gathered"][rank], state["weights"])
    assert torch.equal(saved[0]["weights"], saved[1]["weights"])
