"""The examples under ``mpirun -np 2``: on baguahvd, as unmodified Horovod scripts through
the ``horovod`` shim, and on a real Horovod when one is installed.

Each run is kept short (few epochs, few iterations) so that the whole file takes about a
minute on two cores.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.support import jobs

EXAMPLES = jobs.ROOT / "examples"
DIGITS = EXAMPLES / "pytorch_digits.py"
BENCHMARK = EXAMPLES / "pytorch_synthetic_benchmark.py"
ELASTIC = EXAMPLES / "pytorch_digits_elastic.py"
TIMEOUT_S = 120
BAGUAHVD_IMPORT = "import baguahvd.torch as hvd"
HOROVOD_IMPORT = "import horovod.torch as hvd"
DIGITS_ARGS = ["--epochs", "5", "--log-interval", "0"]
BENCHMARK_ARGS = [
    "--batch-size",
    "16",
    "--num-warmup-batches",
    "2",
    "--num-batches-per-iter",
    "2",
    "--num-iters",
    "3",
]
ACCURACY = re.compile(r"^test accuracy: (\d\.\d{4})$", re.MULTILINE)
TOTAL = re.compile(r"^Total img/sec on 2 CPU\(s\): (\d+\.\d) \+-(\d+\.\d)$", re.MULTILINE)

pytestmark = pytest.mark.parallel


def run(
    script: pathlib.Path,
    args: list[str],
    tmp_path: pathlib.Path,
    extra_env: dict[str, str] | None = None,
) -> str:
    """Runs ``script`` on two ranks; returns rank 0's output, failing on any error."""
    result = jobs.launch([str(script), *args], 2, tmp_path, TIMEOUT_S, extra_env)
    if result.returncode != 0:
        pytest.fail(
            f"{script.name} failed (exit {result.returncode})\n{result.stderr}\n{result.stdout}",
            pytrace=False,
        )
    return result.logs[0]


def as_horovod_script(source: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """Copies an example with its import switched back to Horovod's."""
    text = source.read_text()
    assert text.count(BAGUAHVD_IMPORT) == 1, f"{source.name}: expected one '{BAGUAHVD_IMPORT}'"
    text = text.replace(BAGUAHVD_IMPORT, HOROVOD_IMPORT)
    text += '\nif hvd.rank() == 0:\n    print("horovod.torch from", hvd.__file__, flush=True)\n'
    copy = tmp_path / source.name
    copy.write_text(text)
    return copy


def accuracy(output: str) -> float:
    found = ACCURACY.findall(jobs.untagged(output))
    assert found, f"no 'test accuracy: ...' line in rank 0's output:\n{output[-3000:]}"
    return float(found[-1])


def assert_benchmark_output(output: str) -> None:
    for line in (
        "Model: small_cnn",
        "Batch size: 16",
        "Number of CPUs: 2",
        "Running warmup...",
        "Running benchmark...",
    ):
        assert re.search(rf"^{re.escape(line)}$", output, re.MULTILINE), (line, output)
    assert len(re.findall(r"^Iter #\d+: \d+\.\d img/sec per CPU$", output, re.MULTILINE)) == 3
    assert re.search(r"^Img/sec per CPU: \d+\.\d \+-\d+\.\d$", output, re.MULTILINE), output
    total = TOTAL.search(output)
    assert total and float(total.group(1)) > 0, output


# ---------------------------------------------------------------------------------------
# On baguahvd


def test_digits_trains_checkpoints_and_resumes(tmp_path: pathlib.Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    common = ["--log-interval", "0", "--checkpoint-dir", str(checkpoints)]
    for run_dir in ("first", "second"):
        (tmp_path / run_dir).mkdir()
    output = run(DIGITS, ["--epochs", "4", *common], tmp_path / "first")
    assert accuracy(output) >= 0.5, output[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"checkpoint-{epoch}.pt" for epoch in range(1, 5)
    ]
    # Only rank 0 shows progress and results.
    rank1 = (tmp_path / "first" / "rank.1.log").read_text(errors="replace")
    assert "test accuracy" not in rank1 and "Train Epoch" not in rank1

    output = run(DIGITS, ["--epochs", "5", "--fp16-allreduce", *common], tmp_path / "second")
    assert "resuming from epoch 4" in output
    assert "Train Epoch #4" not in output and "Train Epoch #5" in output
    assert (checkpoints / "checkpoint-5.pt").exists()
    assert accuracy(output) >= 0.85, output[-3000:]


def test_synthetic_benchmark(tmp_path: pathlib.Path) -> None:
    output = run(BENCHMARK, [*BENCHMARK_ARGS, "--algorithm", "gradient_allreduce"], tmp_path)
    assert_benchmark_output(output)
    assert "Algorithm: gradient_allreduce" in output


def test_digits_elastic_survives_kill_9(tmp_path: pathlib.Path) -> None:
    elastic_dir = tmp_path / "elastic"
    args = [
        "--elastic", "-np", "2", "--checkpoint-dir", str(elastic_dir),
        sys.executable, str(ELASTIC), "--epochs", "4", "--batches-per-commit", "5",
    ]
    with jobs.started_launcher(args, tmp_path) as job:
        # Kill rank 1 once the job has committed a few times, i.e. mid-training.
        jobs.kill_rank_after(job, 1, elastic_dir, "commit-[3-9].*.pt", TIMEOUT_S)
        output, _ = job.communicate(timeout=TIMEOUT_S)
    assert job.returncode == 0, output
    assert "launch 1 failed" in output and "restart 1 of 3" in output, output
    assert accuracy(output) >= 0.85, output[-3000:]


# ---------------------------------------------------------------------------------------
# As unmodified Horovod scripts, through the shim


def test_digits_as_horovod(tmp_path: pathlib.Path) -> None:
    script = as_horovod_script(DIGITS, tmp_path)
    shim = jobs.shim_path()
    pythonpath = os.pathsep.join([shim, str(jobs.ROOT), os.environ.get("PYTHONPATH", "")])
    # Two epochs: this run is about the API, the accuracy is checked on baguahvd above.
    args = ["--epochs", "2", "--log-interval", "5"]
    output = run(script, args, tmp_path, {"PYTHONPATH": pythonpath})
    assert accuracy(output) >= 0.3, output[-3000:]
    assert "Loss:" in output
    assert f"horovod.torch from {shim}" in output


def run_as_horovod(
    source: pathlib.Path, launcher_args: list[str], args: list[str], tmp_path: pathlib.Path
) -> str:
    """Runs ``source``, its import switched to Horovod's, through ``baguahvdrun --as-horovod``
    on two ranks; returns stdout, failing on any error."""
    script = as_horovod_script(source, tmp_path)
    args = ["--as-horovod", *launcher_args, "-np", "2", sys.executable, str(script), *args]
    result = jobs.run_launcher(args, tmp_path, TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"horovod.torch from {jobs.shim_path()}" in result.stdout
    return jobs.untagged(result.stdout)


def test_benchmark_through_baguahvdrun_as_horovod(tmp_path: pathlib.Path) -> None:
    assert_benchmark_output(run_as_horovod(BENCHMARK, [], BENCHMARK_ARGS, tmp_path))


def test_elastic_example_through_baguahvdrun_as_horovod(tmp_path: pathlib.Path) -> None:
    # Horovod's hvd.elastic API (TorchState, ElasticSampler, run) from `horovod.torch`.
    output = run_as_horovod(ELASTIC, ["--elastic"], ["--epochs", "2"], tmp_path)
    assert accuracy(output) >= 0.3, output[-3000:]


# ---------------------------------------------------------------------------------------
# On a real Horovod, when one is installed


def real_horovod_available() -> bool:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BAGUAHVD_AS_HOROVOD")}
    probe = (
        "import horovod.torch, sys; sys.exit(1 if hasattr(horovod, '__baguahvd_version__') else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, cwd=pathlib.Path("/"),
        timeout=120,
    )
    return result.returncode == 0


@pytest.mark.parametrize("example", ["digits", "benchmark"])
def test_unmodified_examples_on_real_horovod(tmp_path: pathlib.Path, example: str) -> None:
    if not real_horovod_available():
        pytest.skip("horovod.torch is not installed")
    source, args = (DIGITS, DIGITS_ARGS) if example == "digits" else (BENCHMARK, BENCHMARK_ARGS)
    script = tmp_path / source.name
    script.write_text(source.read_text().replace(BAGUAHVD_IMPORT, HOROVOD_IMPORT))
    output = run(script, args, tmp_path, {"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    if example == "digits":
        assert accuracy(output) >= 0.85, output[-3000:]
    else:
        assert_benchmark_output(output)
