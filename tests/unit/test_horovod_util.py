"""``horovod.common.util`` under the shim: Horovod's helpers with Horovod's behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from baguahvd.common import capabilities
from baguahvd.compat import common_util as util
from baguahvd.compat.aliases import shim_path


@pytest.mark.parametrize(
    ("length", "parts", "expected"),
    [
        (10, 3, [4, 3, 3]),
        (9, 3, [3, 3, 3]),
        (2, 4, [1, 1, 0, 0]),
        (0, 2, [0, 0]),
    ],
)
def test_split_list_keeps_order_and_balances(length: int, parts: int, expected: list[int]) -> None:
    items = list(range(length))
    pieces = util.split_list(items, parts)
    assert [len(p) for p in pieces] == expected
    assert [x for piece in pieces for x in piece] == items


def test_num_rank_is_power_2() -> None:
    assert [n for n in range(0, 17) if util.num_rank_is_power_2(n)] == [1, 2, 4, 8, 16]


def test_env_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUAHVD_TEST_KEEP", "old")
    monkeypatch.delenv("BAGUAHVD_TEST_NEW", raising=False)
    with util.env(BAGUAHVD_TEST_KEEP=5, BAGUAHVD_TEST_NEW="x"):
        assert os.environ["BAGUAHVD_TEST_KEEP"] == "5"
        assert os.environ["BAGUAHVD_TEST_NEW"] == "x"
    assert os.environ["BAGUAHVD_TEST_KEEP"] == "old"
    assert "BAGUAHVD_TEST_NEW" not in os.environ


def test_env_restores_after_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BAGUAHVD_TEST_NEW", raising=False)
    with pytest.raises(KeyError), util.env(BAGUAHVD_TEST_NEW="1"):
        raise KeyError("inside")
    assert "BAGUAHVD_TEST_NEW" not in os.environ


def test_check_extension_accepts_torch_only() -> None:
    util.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", __file__, "mpi_lib_v2")
    with pytest.raises(ImportError, match="horovod.tensorflow has not been built"):
        util.check_extension("horovod.tensorflow", "HOROVOD_WITH_TENSORFLOW", __file__, "mpi_lib")
    assert util.extension_available("torch")
    assert not util.extension_available("tensorflow")
    assert not util.gpu_available("mxnet")


def test_built_queries_answer_like_capabilities() -> None:
    assert util.mpi_built(verbose=True) == capabilities.mpi_built()
    assert util.gloo_built() == capabilities.gloo_built()
    assert util.nccl_built() == capabilities.nccl_built()
    assert util.cuda_built() == capabilities.cuda_built()
    assert (util.ddl_built(), util.ccl_built(), util.rocm_built()) == (False, False, False)


def test_average_backwards_compatibility() -> None:
    ops = types.SimpleNamespace(Average="avg", Sum="sum")
    resolve = util.get_average_backwards_compatibility_fun(ops)
    assert resolve(None, None) == "avg"
    assert resolve("max", None) == "max"
    with pytest.warns(DeprecationWarning):
        assert resolve(None, False) == "sum"
    with pytest.raises(ValueError, match="supersedes average"):
        resolve("sum", True)


def test_version_comparison() -> None:
    assert util.is_version_greater_equal_than("2.13.0", "2.1.0")
    assert not util.is_version_greater_equal_than("1.9.1+cpu", "1.10.0")
    with pytest.raises(ValueError, match="major"):
        util.is_version_greater_equal_than("2.13", "2.1.0")
    assert util.is_iterable([1]) and not util.is_iterable(3)


def test_every_horovod_module_path_resolves_under_the_shim() -> None:
    code = (
        "from horovod.common.util import env, gpu_available, split_list, "
        "num_rank_is_power_2, check_extension, mpi_built, nccl_built\n"
        "from horovod.torch.mpi_ops import size, rank, local_rank, Average, synchronize, "
        "init, is_initialized, global_process_set, add_process_set, ProcessSet\n"
        "from horovod.torch.mpi_ops import _basics\n"
        "from horovod.common.exceptions import HorovodInternalError\n"
        "from horovod.runner import run\n"
        "from horovod.runner.util.threads import in_thread, on_event\n"
        "import horovod\n"
        "assert horovod.run is run\n"
        "print('resolved', split_list([1, 2, 3], 2))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim_path(), os.getcwd()]))
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "resolved [[1, 2], [3]]" in result.stdout
