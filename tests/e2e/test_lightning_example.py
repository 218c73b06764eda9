"""examples/lightning_digits.py with each Lightning package: ``lightning.pytorch`` under
``baguahvdrun -np 2`` and ``pytorch_lightning`` started as ``python ... --devices 2`` (Lightning
starts the second rank). Both train to the plain digits example's accuracy and print on
rank 0 only; the first writes one checkpoint per epoch."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

from tests.support import jobs

pytest.importorskip("lightning.pytorch")
pytest.importorskip("pytorch_lightning")

EXAMPLE = jobs.ROOT / "examples" / "lightning_digits.py"
TIMEOUT_S = 240
EPOCHS = 5
RANK_0 = r"^\[1,0\]<stdout>: ?"
"""baguahvdrun's tag of rank 0's lines, as horovodrun's."""
ACCURACY = re.compile(RANK_0 + r"test accuracy: (\d\.\d{4})$", re.MULTILINE)
MIN_ACCURACY = 0.9
"""examples/pytorch_digits.py reaches 0.9389 in 5 epochs on two ranks; so does this example
(the same model, data, sampler seed and learning rate)."""

pytestmark = pytest.mark.parallel


def test_lightning_digits_reaches_the_plain_examples_accuracy(tmp_path: pathlib.Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    args = ["-np", "2", sys.executable, str(EXAMPLE), "--epochs", str(EPOCHS),
            "--no-progress-bar", "--checkpoint-dir", str(checkpoints), "--package", "lightning"]
    result = jobs.run_launcher(args, tmp_path, TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    found = ACCURACY.findall(result.stdout)
    # Printed once, by rank 0 (the tag says which rank wrote it).
    assert len(found) == 1 and result.stdout.count("test accuracy") == 1, output[-5000:]
    assert float(found[0]) >= MIN_ACCURACY, output[-5000:]
    for epoch in range(1, EPOCHS + 1):
        by_rank_0 = re.findall(rf"{RANK_0}Epoch {epoch}: test loss", result.stdout, re.MULTILINE)
        assert len(by_rank_0) == 1 and result.stdout.count(f"Epoch {epoch}: test loss") == 1
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"checkpoint-epoch={epoch}.ckpt" for epoch in range(EPOCHS)
    ]


def test_pytorch_lightning_digits_started_by_python_reaches_the_same_accuracy(
    tmp_path: pathlib.Path,
) -> None:
    command = [sys.executable, str(EXAMPLE), "--epochs", str(EPOCHS), "--no-progress-bar",
               "--package", "pytorch_lightning", "--devices", "2"]
    (result,) = jobs.run_commands([command], tmp_path, TIMEOUT_S, [{}])
    assert result.returncode == 0, result.stdout[-5000:]
    found = re.findall(r"^test accuracy: (\d\.\d{4})$", result.stdout, re.MULTILINE)
    assert len(found) == 1, result.stdout[-5000:]
    assert float(found[0]) >= MIN_ACCURACY, result.stdout[-5000:]
    for epoch in range(1, EPOCHS + 1):
        assert result.stdout.count(f"Epoch {epoch}: test loss") == 1, result.stdout[-5000:]
