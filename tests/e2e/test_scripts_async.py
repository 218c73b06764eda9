"""Async model averaging across a whole script's life: the averaging thread must never keep
a job from exiting, whether the script calls ``hvd.shutdown()``, aborts, or simply ends
while averaging runs (Bagua hangs there), and also when one rank ends later than the
others."""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest

from tests.support.jobs import launch

TIMEOUT_S = 120
EXIT_LATENCY_S = 15.0  # from the end of a rank's script to its last atexit handler

_TRAIN = """
import atexit
import time

import torch

END = [0.0]


def _report_exit() -> None:
    # Registered before hvd.init(), so it runs after baguahvd's own exit handler.
    print(f"EXIT_LATENCY {{time.monotonic() - END[0]:.3f}}", flush=True)


atexit.register(_report_exit)

import baguahvd.torch as hvd  # noqa: E402
from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm  # noqa: E402
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(rank)
model = torch.nn.Linear(4, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=20, warmup_steps=3)
optimizer = make_algorithm_optimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), algorithm
)


def train(seconds: float, min_rounds: int = 0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < seconds or (
        optimizer._impl.rounds < min_rounds and time.monotonic() - start < 60
    ):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(0.002)


train(0.5, min_rounds=2)
impl = optimizer._impl
assert impl.running and impl.rounds >= 2, impl.rounds
if "{how}" == "shutdown":
    for _ in range(3):
        algorithm.abort(optimizer)
        assert not impl.running
        algorithm.resume(optimizer)
        assert impl.running
        train(0.1)
# The last rank is a straggler: the others wait for it at exit, averaging meanwhile.
train(1.0 if rank == size - 1 else 0.0)
END[0] = time.monotonic()
print("TRAINING_DONE", flush=True)
if "{how}" == "shutdown":
    hvd.shutdown()
    assert not impl.running
    print("SHUT_DOWN", flush=True)
"""

_THREADS_DISABLED = """
import pytest
import torch

import baguahvd.torch as hvd
from baguahvd.torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer

hvd.init()
model = torch.nn.Linear(4, 1)
with pytest.raises(hvd.HorovodInternalError, match="MPI_THREAD_MULTIPLE"):
    make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
        AsyncModelAverageAlgorithm(),
    )
print("REFUSED", flush=True)
"""


def _script(tmp_path: pathlib.Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parallel
@pytest.mark.parametrize("how, np", [("exit", 2), ("exit", 3), ("shutdown", 3)])
def test_job_exits_promptly_while_averaging(tmp_path: pathlib.Path, how: str, np: int) -> None:
    script = _script(tmp_path, "async_exit.py", _TRAIN.format(how=how))
    result = launch([script], np, tmp_path, TIMEOUT_S)
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr}\n{output}"
    assert output.count("TRAINING_DONE") == np, output
    if how == "shutdown":
        assert output.count("SHUT_DOWN") == np, output
    latencies = [float(x) for x in re.findall(r"EXIT_LATENCY (\S+)", output)]
    assert len(latencies) == np, output
    assert max(latencies) < EXIT_LATENCY_S, output
    assert "averaging thread behind" not in output, output


@pytest.mark.parallel
def test_refused_without_mpi_thread_multiple(tmp_path: pathlib.Path) -> None:
    script = _script(tmp_path, "async_threads.py", _THREADS_DISABLED)
    result = launch([script], 2, tmp_path, TIMEOUT_S,
                    extra_env={"HOROVOD_MPI_THREADS_DISABLE": "1"})
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr}\n{output}"
    assert output.count("REFUSED") == 2, output
