"""The API before ``init()``, a single-process job, and the API after ``shutdown()``.

Every check runs in a fresh ``python -c`` process, so module state (and MPI, which can be
initialised only once per process) starts clean. Each script asserts with ``pytest.raises``
and prints ``OK`` at the end.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.jobs import run_one_rank

_PRELUDE = """
from baguahvd.common.exceptions import NOT_INITIALIZED_MESSAGE, SHUT_DOWN_MESSAGE
"""


def _run(body: str, **env: str) -> None:
    result = run_one_rank(_PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n", **env)
    if not result.stdout.rstrip().endswith("OK"):
        pytest.fail(f"no OK at the end\n--- stdout\n{result.stdout}\n--- stderr\n"
                    f"{result.stderr}", pytrace=False)


def test_before_init_and_a_failed_init() -> None:
    _run(
        """
        import os
        import re
        import sys

        # Importing baguahvd does not start MPI.
        assert "mpi4py.MPI" not in sys.modules
        assert hvd.is_initialized() is False
        message = re.escape(NOT_INITIALIZED_MESSAGE)
        assert NOT_INITIALIZED_MESSAGE == "Horovod has not been initialized; use hvd.init()."
        for query in (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank,
                      hvd.cross_size, hvd.is_homogeneous, hvd.mpi_threads_supported):
            with pytest.raises(ValueError, match=message):
                query()
        x = torch.ones(3)
        collectives = [
            lambda: hvd.allreduce(x),
            lambda: hvd.allreduce_(x),
            lambda: hvd.allreduce_async(x),
            lambda: hvd.grouped_allreduce([x]),
            lambda: hvd.allgather(x),
            lambda: hvd.broadcast(x, 0),
            lambda: hvd.broadcast_async_(x, 0),
            lambda: hvd.alltoall(x),
            lambda: hvd.reducescatter(x),
            lambda: hvd.barrier(),
            lambda: hvd.join(),
        ]
        for call in collectives:
            with pytest.raises(hvd.HorovodInternalError, match=message):
                call()
        # Horovod's topology queries raise ValueError and its collectives
        # HorovodInternalError; the collectives' error is both.
        with pytest.raises(ValueError):
            hvd.allreduce(x)
        with pytest.raises(ValueError, match=message):
            hvd.add_process_set([0])
        # Capability queries work before init.
        assert hvd.mpi_built() is True
        assert hvd.gloo_built() is True
        assert hvd.ccl_built() is False
        assert isinstance(hvd.nccl_built(), int)
        # Process sets answer None until registered.
        process_set = hvd.ProcessSet([0])
        assert process_set.size() is None and process_set.rank() is None
        assert process_set.included() is None
        assert hvd.global_process_set.size() is None
        assert hvd.synchronize(0) is None
        assert "mpi4py.MPI" not in sys.modules

        # A bad setting fails init() before anything starts; fixed, init() succeeds.
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "lots"
        with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
            hvd.init()
        assert hvd.is_initialized() is False
        del os.environ["HOROVOD_FUSION_THRESHOLD"]
        hvd.init()
        assert hvd.is_initialized()
        # Dynamic process sets were not enabled.
        with pytest.raises(ValueError, match="Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow "
                                             "adding process sets after Horovod initialization."):
            hvd.add_process_set([0])
        with pytest.raises(ValueError, match="Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow "
                                             "removing process sets after Horovod"):
            hvd.remove_process_set(hvd.ProcessSet([0]))
        """
    )


def test_optimizers_and_helpers_need_init() -> None:
    _run(
        """
        import re

        message = re.escape(NOT_INITIALIZED_MESSAGE)
        model = torch.nn.Linear(3, 2)
        for options in ({}, {"op": hvd.Adasum}, {"algorithm": "bytegrad"},
                        {"algorithm": "decentralized"}):
            with pytest.raises(ValueError, match=message):
                hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    named_parameters=model.named_parameters(), **options,
                )
        for call in (
            lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0),
            lambda: hvd.broadcast_optimizer_state(
                torch.optim.SGD(model.parameters(), lr=0.1), root_rank=0),
            lambda: hvd.broadcast_object(1),
            lambda: hvd.allgather_object(1),
            lambda: hvd.SyncBatchNorm(3)(torch.randn(4, 3)),
            lambda: hvd.elastic.ElasticSampler(list(range(8))),
        ):
            with pytest.raises(ValueError, match=message):
                call()
        """
    )


def test_single_process_job_then_shutdown() -> None:
    _run(
        """
        import re

        hvd.init(process_sets="dynamic")
        assert hvd.is_initialized()
        assert (hvd.size(), hvd.rank()) == (1, 0)
        assert (hvd.local_size(), hvd.local_rank()) == (1, 0)
        assert (hvd.cross_size(), hvd.cross_rank()) == (1, 0)
        assert hvd.is_homogeneous() is True
        hvd.init()  # a second call is a no-op

        x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
        assert torch.equal(hvd.allreduce(x), x)
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x)
        assert torch.equal(hvd.allreduce(x, op=hvd.Max), x)
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                         postscale_factor=0.5), x)
        assert torch.equal(hvd.allreduce(x, op=hvd.Adasum), x)
        ints = torch.tensor([3, -3, 5], dtype=torch.int32)
        assert hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.5).tolist() == [1, -1, 2]
        y = x.clone()
        assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, x)
        grouped = hvd.grouped_allreduce([x, 2 * x])
        assert len(grouped) == 2
        assert torch.equal(grouped[0], x) and torch.equal(grouped[1], 2 * x)
        assert torch.equal(hvd.allgather(x), x)
        assert torch.equal(hvd.broadcast(x, 0), x)
        assert torch.equal(hvd.alltoall(x), x)
        received, splits = hvd.alltoall(x, splits=[2])
        assert torch.equal(received, x[:2]) and splits.tolist() == [2]
        assert torch.equal(hvd.reducescatter(x), x)
        half = torch.tensor([1.0, 2.5], dtype=torch.float16)
        assert torch.equal(hvd.allreduce(half), half)
        handle = hvd.allreduce_async(x, name="single")
        assert torch.equal(hvd.synchronize(handle), x)
        assert hvd.synchronize(handle) is None
        hvd.barrier()
        assert hvd.join() == 0
        assert hvd.broadcast_object({"a": 1}) == {"a": 1}
        assert hvd.allgather_object([1, 2]) == [[1, 2]]
        # Gradients flow through the single-rank collectives.
        w = torch.ones(3, requires_grad=True)
        hvd.allreduce(w * 2, op=hvd.Sum).sum().backward()
        assert torch.equal(w.grad, torch.full((3,), 2.0))
        # Mismatches cannot happen, but argument errors still surface.
        with pytest.raises(ValueError, match="is not supported"):
            hvd.allreduce(torch.zeros(2, dtype=torch.bool))
        # With one rank the odd set of Horovod's suite is empty; it must still work.
        empty = hvd.add_process_set([])
        assert empty.size() == 0 and empty.included() is False
        with pytest.raises(ValueError, match="Rank 0 is not a member"):
            hvd.allreduce(torch.ones(1), process_set=empty)
        # A set of every rank duplicates the global set.
        with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
            hvd.add_process_set([0])
        assert hvd.remove_process_set(empty)
        assert hvd.remove_process_set(empty) is False
        assert hvd.mpi_threads_supported() is True

        hvd.shutdown()
        assert hvd.is_initialized() is False
        message = re.escape(SHUT_DOWN_MESSAGE)
        assert "has been shut down" in SHUT_DOWN_MESSAGE
        for call in (
            lambda: hvd.allreduce(x),
            lambda: hvd.allreduce_async_(x),
            lambda: hvd.allgather(x),
            lambda: hvd.broadcast(x, 0),
            lambda: hvd.alltoall(x),
            lambda: hvd.reducescatter(x),
            lambda: hvd.barrier(),
            lambda: hvd.join(),
        ):
            with pytest.raises(hvd.HorovodInternalError, match=message):
                call()
        hvd.shutdown()  # a second call is harmless
        # The topology queries are gone with the job.
        with pytest.raises(ValueError, match=re.escape(NOT_INITIALIZED_MESSAGE)):
            hvd.rank()
        """
    )


def test_mpi_threads_disable() -> None:
    _run(
        """
        hvd.init()
        assert hvd.mpi_threads_supported() is False
        assert torch.equal(hvd.allreduce(torch.ones(2)), torch.ones(2))
        """,
        HOROVOD_MPI_THREADS_DISABLE="1",
    )
