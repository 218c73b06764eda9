"""Gradients of the blocking, differentiable collectives, against Horovod's definitions:

* allreduce / grouped_allreduce: the allreduce of the incoming gradient with the same op
  and scale factors (``Sum`` sums the ranks' gradients, ``Average`` averages them);
* allgather / grouped_allgather: this rank's rows of the gradient averaged over the ranks;
* broadcast: the averaged gradient on the root, zeros elsewhere;
* alltoall: the reverse alltoall, zeros for rows that were not sent;
* reducescatter / grouped_reducescatter: the allgather of the gradient, times the set size
  for ``Sum`` and times the scale factors.

Each rank weights its output with rank-dependent weights, so every expected gradient mixes
contributions from all ranks. Expected values are computed from ``rank`` and ``size``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import baguahvd.torch as hvd

FLOATS = [torch.float32, torch.float64]


def data(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """A leaf tensor that requires grad, different on every rank."""
    count = math.prod(shape)
    values = (torch.arange(count) * 3 + 7 * rank + salt) % 7 - 3
    return values.reshape(tuple(shape)).to(dtype).requires_grad_()


def weights(rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s loss weights: ``loss = (output * weights).sum()``, so the incoming
    gradient of the output is exactly these weights."""
    count = math.prod(shape)
    values = (torch.arange(count) * 5 + 3 * rank + 2 * salt) % 11 - 5
    return values.reshape(tuple(shape)).to(dtype)


def mean_weights(size: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0
                 ) -> torch.Tensor:
    return sum(weights(r, shape, dtype, salt).double() for r in range(size)).div(size).to(dtype)


def sum_weights(size: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0
                ) -> torch.Tensor:
    return sum(weights(r, shape, dtype, salt) for r in range(size))


# ---------------------------------------------------------------------------------------
# Allreduce


@pytest.mark.parametrize("factors", [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)], ids=str)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_allreduce_grad(dtype: torch.dtype, op_name: str, factors: tuple[float, float],
                        rank: int, size: int) -> None:
    pre, post = factors
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    shape = (3, 4)
    x = data(rank, shape, dtype)
    y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                      name=f"grad.allreduce.{dtype}.{op_name}.{pre}.{post}")
    (y * weights(rank, shape, dtype)).sum().backward()
    reduced = sum_weights(size, shape, dtype) if op == hvd.Sum else mean_weights(size, shape,
                                                                                 dtype)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, reduced * pre * post)


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_allreduce_grad_of_ones(op_name: str, size: int) -> None:
    x = torch.ones(5, requires_grad=True)
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    hvd.allreduce(x, op=op).sum().backward()
    expected = torch.full((5,), float(size) if op == hvd.Sum else 1.0)
    torch.testing.assert_close(x.grad, expected)


def test_allreduce_grad_average_flag(rank: int, size: int) -> None:
    x = data(rank, (4,), torch.float32)
    with pytest.warns(DeprecationWarning):
        y = hvd.allreduce(x, average=False, name="grad.allreduce.average_flag")
    (y * weights(rank, (4,), torch.float32)).sum().backward()
    torch.testing.assert_close(x.grad, sum_weights(size, (4,), torch.float32))


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_grouped_allreduce_grad(dtype: torch.dtype, op_name: str, rank: int, size: int) -> None:
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    shapes = [(3,), (2, 5), (1, 2, 2)]
    xs = [data(rank, s, dtype, salt=i) for i, s in enumerate(shapes)]
    ys = hvd.grouped_allreduce(xs, op=op, name=f"grad.grouped_allreduce.{dtype}.{op_name}")
    loss = sum((y * weights(rank, s, dtype, salt=i)).sum()
               for i, (y, s) in enumerate(zip(ys, shapes)))
    loss.backward()
    for i, (x, s) in enumerate(zip(xs, shapes)):
        expected = (sum_weights(size, s, dtype, salt=i) if op == hvd.Sum
                    else mean_weights(size, s, dtype, salt=i))
        torch.testing.assert_close(x.grad, expected)


def test_allreduce_grad_with_compression(rank: int, size: int) -> None:
    x = data(rank, (6,), torch.float32)
    y = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="grad.compressed")
    assert y.dtype == torch.float32
    (y * weights(rank, (6,), torch.float32)).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, sum_weights(size, (6,), torch.float32))


# ---------------------------------------------------------------------------------------
# Allgather


def _rows(rank: int, kind: str) -> int:
    return rank + 1 if kind == "rank_plus_one" else rank


@pytest.mark.parametrize("rows", ["rank_plus_one", "rank"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_allgather_grad(dtype: torch.dtype, rows: str, rank: int, size: int) -> None:
    counts = [_rows(r, rows) for r in range(size)]
    x = data(rank, (counts[rank], 3), dtype)
    y = hvd.allgather(x, name=f"grad.allgather.{dtype}.{rows}")
    assert y.shape == (sum(counts), 3)
    (y * weights(rank, y.shape, dtype)).sum().backward()
    offset = sum(counts[:rank])
    expected = mean_weights(size, y.shape, dtype)[offset : offset + counts[rank]]
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_grouped_allgather_grad(dtype: torch.dtype, rank: int, size: int) -> None:
    row_counts = [[r + 1 for r in range(size)], [2] * size, [size - r for r in range(size)]]
    xs = [data(rank, (counts[rank], 2), dtype, salt=i) for i, counts in enumerate(row_counts)]
    ys = hvd.grouped_allgather(xs, name=f"grad.grouped_allgather.{dtype}")
    loss = sum((y * weights(rank, y.shape, dtype, salt=i)).sum() for i, y in enumerate(ys))
    loss.backward()
    for i, (x, counts) in enumerate(zip(xs, row_counts)):
        offset = sum(counts[:rank])
        full = mean_weights(size, (sum(counts), 2), dtype, salt=i)
        torch.testing.assert_close(x.grad, full[offset : offset + counts[rank]])


# ---------------------------------------------------------------------------------------
# Broadcast


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_broadcast_grad(dtype: torch.dtype, rank: int, size: int) -> None:
    shape = (2, 3)
    for root in range(size):
        x = data(rank, shape, dtype, salt=root)
        y = hvd.broadcast(x, root, name=f"grad.broadcast.{dtype}.{root}")
        (y * weights(rank, shape, dtype, salt=root)).sum().backward()
        if rank == root:
            expected = mean_weights(size, shape, dtype, salt=root)
        else:
            expected = torch.zeros(shape, dtype=dtype)
        assert x.grad is not None
        torch.testing.assert_close(x.grad, expected)


# ---------------------------------------------------------------------------------------
# Alltoall


def _splits(kind: str, r: int, size: int) -> tuple[int, list[int]]:
    """(rows, splits) rank ``r`` sends; ``uneven`` leaves an unsent tail of r rows."""
    if kind == "equal":
        return 2 * size, [2] * size
    splits = [(r + j) % 3 for j in range(size)]
    return sum(splits) + r, splits


@pytest.mark.parametrize("kind", ["none", "equal", "uneven"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_alltoall_grad(dtype: torch.dtype, kind: str, rank: int, size: int) -> None:
    plans = [_splits("equal" if kind == "none" else kind, r, size) for r in range(size)]
    rows, splits = plans[rank]
    x = data(rank, (rows, 2), dtype)
    name = f"grad.alltoall.{dtype}.{kind}"
    if kind == "none":
        y = hvd.alltoall(x, name=name)
    else:
        y, received = hvd.alltoall(x, splits, name=name)
        assert not received.requires_grad
    (y * weights(rank, y.shape, dtype)).sum().backward()
    # Rows x[off:off+splits[j]] went to rank j, which put them after the rows of lower ranks.
    expected = torch.zeros(rows, 2, dtype=dtype)
    for j in range(size):
        received_rows_j = sum(plans[q][1][j] for q in range(size))
        w_j = weights(j, (received_rows_j, 2), dtype)
        position = sum(plans[q][1][j] for q in range(rank))
        offset = sum(splits[:j])
        expected[offset : offset + splits[j]] = w_j[position : position + splits[j]]
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected)


# ---------------------------------------------------------------------------------------
# Reducescatter


def _slice(total: torch.Tensor, me: int, size: int) -> torch.Tensor:
    rows = total.shape[0]
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    return total[sum(counts[:me]) : sum(counts[: me + 1])]


def _reducescatter_grad(size: int, rows: int, dtype: torch.dtype, op: int, pre: float,
                        post: float, salt: int = 0) -> torch.Tensor:
    """Horovod's gradient: allgather of the ranks' incoming gradients, x size for Sum."""
    gathered = torch.cat([_slice(weights(r, (rows, 3), dtype, salt), r, size)
                          for r in range(size)])
    factor = pre * post * (size if op == hvd.Sum else 1)
    return gathered * factor


@pytest.mark.parametrize("factors", [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)], ids=str)
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", [torch.float16, *FLOATS], ids=str)
def test_reducescatter_grad(dtype: torch.dtype, op_name: str, factors: tuple[float, float],
                            rank: int, size: int) -> None:
    pre, post = factors
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    rows = 2 * size + 1  # rank 0 gets an extra row
    x = data(rank, (rows, 3), dtype)
    y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post,
                          name=f"grad.reducescatter.{dtype}.{op_name}.{pre}.{post}")
    # Each rank weights its own slice with the matching slice of its weights.
    (y * _slice(weights(rank, (rows, 3), dtype), rank, size)).sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, _reducescatter_grad(size, rows, dtype, op, pre, post))


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_grouped_reducescatter_grad(op_name: str, rank: int, size: int) -> None:
    op = hvd.Sum if op_name == "Sum" else hvd.Average
    row_counts = [size, 2 * size + 1, 1]
    xs = [data(rank, (rows, 3), torch.float64, salt=i) for i, rows in enumerate(row_counts)]
    ys = hvd.grouped_reducescatter(xs, op=op, name=f"grad.grouped_reducescatter.{op_name}")
    loss = sum((y * _slice(weights(rank, (rows, 3), torch.float64, salt=i), rank, size)).sum()
               for i, (y, rows) in enumerate(zip(ys, row_counts)))
    loss.backward()
    for i, (x, rows) in enumerate(zip(xs, row_counts)):
        expected = _reducescatter_grad(size, rows, torch.float64, op, 1.0, 1.0, salt=i)
        torch.testing.assert_close(x.grad, expected)


def test_chained_collectives_grad(rank: int, size: int) -> None:
    """A graph through several collectives: allgather -> allreduce -> broadcast."""
    x = data(rank, (2, 2), torch.float64)
    gathered = hvd.allgather(x, name="grad.chain.allgather")
    summed = hvd.allreduce(gathered, op=hvd.Sum, name="grad.chain.allreduce")
    out = hvd.broadcast(summed, 0, name="grad.chain.broadcast")
    w = weights(rank, out.shape, torch.float64)
    (out * w).sum().backward()
    # broadcast: root 0 gets the mean of the weights, others zero; allreduce(Sum) sums that
    # over ranks (only root is non-zero); allgather averages over ranks, then takes our rows.
    g_broadcast = mean_weights(size, out.shape, torch.float64)
    g_allreduce = g_broadcast  # the sum of [mean, 0, 0, ...]
    g_allgather = g_allreduce  # identical on every rank, so the average is itself
    torch.testing.assert_close(x.grad, g_allgather[2 * rank : 2 * rank + 2])


# ---------------------------------------------------------------------------------------
# Non-differentiable variants on tensors that require grad (parameters, say)


def test_in_place_variants_on_leaves_that_require_grad(rank: int, size: int) -> None:
    param = torch.full((3,), float(rank), requires_grad=True)
    assert hvd.allreduce_(param, op=hvd.Average, name="grad.leaf.allreduce_") is param
    torch.testing.assert_close(param.detach(), torch.full((3,), sum(range(size)) / size))
    assert param.requires_grad and param.grad_fn is None
    params = [torch.full((2,), float(rank), requires_grad=True) for _ in range(3)]
    hvd.grouped_allreduce_(params, op=hvd.Sum, prescale_factor=2.0, name="grad.leaf.grouped")
    for p in params:
        torch.testing.assert_close(p.detach(), torch.full((2,), 2.0 * sum(range(size))))
        assert p.grad_fn is None
    hvd.synchronize(hvd.broadcast_async_(param, size - 1, name="grad.leaf.broadcast_"))
    torch.testing.assert_close(param.detach(), torch.full((3,), sum(range(size)) / size))


def test_async_outputs_are_not_part_of_a_graph(rank: int, size: int) -> None:
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    outputs = [
        hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name="grad.async.allreduce")),
        hvd.synchronize(hvd.broadcast_async(x, 0, name="grad.async.broadcast")),
        hvd.synchronize(hvd.allgather_async(x, name="grad.async.allgather")),
        *hvd.synchronize(hvd.grouped_allreduce_async([x, x * 2], op=hvd.Sum,
                                                      name="grad.async.grouped")),
    ]
    for out in outputs:
        assert out.grad_fn is None and not out.requires_grad
    total = float(sum(range(1, size + 1)))
    torch.testing.assert_close(outputs[0], torch.full((2,), total))
    torch.testing.assert_close(outputs[1], torch.ones(2))
    torch.testing.assert_close(outputs[4], torch.full((2,), 2 * total))


def test_blocking_outputs_join_a_graph_only_where_a_gradient_flows(rank: int, size: int) -> None:
    total = float(sum(range(1, size + 1)))
    plain = torch.full((2,), float(rank + 1))
    leaf = torch.full((2,), float(rank + 1), requires_grad=True)
    out = hvd.allreduce(plain, op=hvd.Sum, name="grad.flow.plain")
    assert out.grad_fn is None and not out.requires_grad
    with torch.no_grad():
        out = hvd.allreduce(leaf, op=hvd.Sum, name="grad.flow.no_grad")
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, torch.full((2,), total))
    grouped = hvd.grouped_allreduce([plain, plain * 2], op=hvd.Sum, name="grad.flow.grouped")
    assert all(t.grad_fn is None and not t.requires_grad for t in grouped)
    torch.testing.assert_close(grouped[1], torch.full((2,), 2 * total))
    with torch.no_grad():
        grouped = hvd.grouped_allreduce([leaf, plain], op=hvd.Sum, name="grad.flow.grouped_ng")
    assert all(t.grad_fn is None for t in grouped)
    # A tensor that requires grad still gets its node, mixed with one that does not.
    out = hvd.allreduce(leaf, op=hvd.Sum, name="grad.flow.leaf")
    assert out.grad_fn is not None
    grouped = hvd.grouped_allreduce([plain, leaf], op=hvd.Sum, name="grad.flow.mixed")
    assert all(t.grad_fn is not None for t in grouped)
    (out.sum() + grouped[1].sum()).backward()
    assert leaf.grad is not None
    torch.testing.assert_close(leaf.grad, torch.full((2,), 2.0 * size))
