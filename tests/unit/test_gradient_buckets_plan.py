"""The bucket plan and the views of one process: no ranks needed."""

from __future__ import annotations

import pytest
import torch

from baguahvd.backends import memory
from baguahvd.torch.buckets import (
    BREAK_GAP_S,
    BREAK_MIN_BYTES,
    SMALL_BUCKET_BYTES,
    GradientBucket,
    _fill_before_accumulating,
    adopt,
    bucket_name,
    bucket_threshold,
    can_bucket,
    layout_with_groups,
    plan_buckets,
    readiness_breaks,
)


def test_buckets_follow_the_order_per_key_within_the_threshold() -> None:
    order = ["a", "b", "c", "d", "e"]
    keys = {"a": "f32", "b": "f64", "c": "f32", "d": "f32", "e": "f64"}
    sizes = {"a": 40, "b": 80, "c": 40, "d": 40, "e": 80}
    assert plan_buckets(order, keys, sizes, 100) == [["a", "c"], ["b"], ["d"], ["e"]]
    assert plan_buckets(order, keys, sizes, 1000) == [["a", "c", "d"], ["b", "e"]]


def test_a_parameter_above_the_threshold_and_no_threshold_make_single_buckets() -> None:
    keys = dict.fromkeys("abc", 0)
    sizes = {"a": 10, "b": 500, "c": 10}
    assert plan_buckets("abc", keys, sizes, 100) == [["a"], ["b"], ["c"]]
    assert plan_buckets("abc", keys, {"a": 1, "b": 1, "c": 1}, 0) == [["a"], ["b"], ["c"]]


def test_a_gradient_due_late_starts_a_bucket_once_the_open_one_is_worth_sending() -> None:
    # An MLP's backward: the last layer's gradients, then layer 4's (large), then layer 2's
    # bias a long while later, with its weight.
    order = ["6.bias", "6.weight", "4.bias", "4.weight", "2.bias", "2.weight", "0.bias"]
    times = [0.0, 0.0001, 0.007, 0.0071, 0.022, 0.0221, 0.03]
    assert readiness_breaks(order, times) == ["4.bias", "2.bias", "0.bias"]
    assert readiness_breaks(order, [0.0] * len(order)) == []
    keys = dict.fromkeys(order, "f32")
    big = BREAK_MIN_BYTES * 4
    sizes = {"6.bias": 40, "6.weight": 40_000, "4.bias": 4_000, "4.weight": big,
             "2.bias": 8_000, "2.weight": big, "0.bias": 8_000}
    breaks = readiness_breaks(order, times)
    # Without the breaks, layer 2's bias would join (and hold back) the first bucket.
    assert plan_buckets(order, keys, sizes, 10 * big) == [order]
    assert plan_buckets(order, keys, sizes, 10 * big, breaks) == [
        ["6.bias", "6.weight", "4.bias", "4.weight"], ["2.bias", "2.weight"], ["0.bias"],
    ]
    # A bucket holding less than BREAK_MIN_BYTES takes the late gradient all the same.
    small = dict.fromkeys(order, 1_000)
    assert plan_buckets(order, keys, small, 10 * big, breaks) == [order]
    assert BREAK_GAP_S <= 0.007 - 0.0001


def test_a_small_bucket_takes_the_next_parameter_past_the_threshold() -> None:
    # The benchmark's MLP at a 10 MiB threshold: layer 2's bias, due late, starts a bucket
    # that its 16 MiB weight would otherwise leave alone (one collective for 8 KB).
    mib = 1 << 20
    order = ["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]
    keys = dict.fromkeys(order, "f32")
    sizes = {"4.bias": 4_096, "4.weight": 8 * mib, "2.bias": 8_192, "2.weight": 16 * mib,
             "0.bias": 8_192, "0.weight": 8 * mib}
    assert plan_buckets(order, keys, sizes, 10 * mib, ["2.bias"]) == [
        ["4.bias", "4.weight"], ["2.bias", "2.weight"], ["0.bias", "0.weight"],
    ]
    # Not past a bucket of SMALL_BUCKET_BYTES, nor one of a sixteenth of the threshold.
    sizes["2.bias"] = SMALL_BUCKET_BYTES
    assert plan_buckets(order, keys, sizes, 10 * mib, ["2.bias"]) == [
        ["4.bias", "4.weight"], ["2.bias"], ["2.weight"], ["0.bias", "0.weight"],
    ]
    assert plan_buckets("abc", dict.fromkeys("abc", 0), {"a": 5, "b": 200, "c": 5}, 100) == [
        ["a", "b"], ["c"],
    ]
    assert plan_buckets("abc", dict.fromkeys("abc", 0), {"a": 5, "b": 200, "c": 5}, 0) == [
        ["a"], ["b"], ["c"],
    ]


def test_which_parameters_can_be_views() -> None:
    assert can_bucket(torch.zeros(3, 4))
    assert can_bucket(torch.zeros(3, dtype=torch.bfloat16))
    assert not can_bucket(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert not can_bucket(torch.zeros(4, 3).t())
    assert not can_bucket(torch.zeros(0))
    assert not can_bucket(torch.zeros(3, dtype=torch.int64))


def test_groups_become_buckets_when_they_can() -> None:
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    d, e = torch.zeros(2), torch.zeros(2)
    names = {a: "a", b: "b", c: "c", d: "d", e: "e"}
    params = {name: p for p, name in names.items()}
    # d is not bucketable (absent from the agreed order): its group stays grouped.
    layout = layout_with_groups(["e", "a", "b", "c"], params, [(a, b), (c, d)], names, 1 << 20)
    assert layout == [["e"], ["a", "b"]]


def test_views_share_the_buffer_and_adopt_what_grad_holds() -> None:
    p, q = torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)
    q.grad = torch.ones(4)
    bucket = GradientBucket(3, ["p", "q"], [p, q])
    assert bucket.name == bucket_name(3, ["p", "q"]) == "DistributedOptimizer.bucket.3[p,q]"
    bucket.attach()
    assert p.grad is bucket.views[0] and q.grad is bucket.views[1]
    assert bucket.buffer.tolist() == [0.0] * 6 + [1.0] * 4
    (p.sum() * 2).backward()  # autograd accumulates into the view
    assert bucket.buffer[:6].tolist() == [2.0] * 6
    p.grad = torch.full((2, 3), 5.0)  # replaced behind the bucket's back
    adopt(p, bucket.views[0])
    assert p.grad is bucket.views[0] and bucket.buffer[:6].tolist() == [5.0] * 6
    p.grad = None
    adopt(p, bucket.views[0])
    assert bucket.buffer[:6].tolist() == [0.0] * 6


def test_fill_hands_out_zeroed_views_to_the_members_without_a_gradient() -> None:
    p, q, r = (torch.zeros(2, requires_grad=True) for _ in range(3))
    bucket = GradientBucket(0, ["p", "q", "r"], [p, q, r])
    bucket.attach()
    bucket.buffer.fill_(9.0)  # last step's gradients
    for x in (p, q, r):
        x.grad = None  # zero_grad()
    bucket.fill()
    assert [x.grad is view for x, view in zip((p, q, r), bucket.views)] == [True] * 3
    assert bucket.buffer.tolist() == [0.0] * 6
    # q keeps its accumulated view, r holds a gradient of its own, p has none: only p's
    # view is zeroed, and r's gradient stays r's until it is adopted.
    bucket.buffer.fill_(3.0)
    p.grad, r.grad = None, torch.full((2,), 7.0)
    bucket.fill()
    assert p.grad is bucket.views[0] and q.grad is bucket.views[1]
    assert r.grad is not bucket.views[2] and r.grad.tolist() == [7.0, 7.0]
    assert bucket.buffer.tolist() == [0.0, 0.0, 3.0, 3.0, 3.0, 3.0]
    bucket.fill()  # nothing missing: nothing changes
    assert bucket.buffer.tolist() == [0.0, 0.0, 3.0, 3.0, 3.0, 3.0]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_backward_fills_the_bucket_through_the_accumulators_pre_hook(mode: str) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    bucket = GradientBucket(0, ["p"], [p])
    bucket.attach()
    # Buckets are built in synchronize(), which step() may run under either mode.
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        accumulator, handle = _fill_before_accumulating(p, bucket)  # held: keeps the hook
    p.grad = None
    bucket.buffer.fill_(5.0)
    (p * 2).sum().backward()
    assert p.grad is bucket.views[0] and p.grad.tolist() == [2.0, 2.0, 2.0]
    handle.remove()
    p.grad = None
    (p * 2).sum().backward()
    assert p.grad is not bucket.views[0]


def test_buckets_are_held_to_the_bucket_size_below_the_fusion_threshold() -> None:
    mib = 1 << 20
    assert bucket_threshold(128 * mib, 10 * mib) == 10 * mib
    assert bucket_threshold(4 * mib, 10 * mib) == 4 * mib
    assert bucket_threshold(0, 10 * mib) == 0  # fusion disabled: one parameter per bucket


def test_cpu_buckets_from_the_huge_page_size_on_live_on_zeroed_huge_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_MADVISE",
                        lambda address, length, advice: advised.append((address, length)) or 0)
    count = memory.BUFFER_HUGE_MIN_BYTES // 4
    small = GradientBucket(0, ["s"], [torch.zeros(count - 1, requires_grad=True)])
    assert advised == []  # below the size: an ordinary tensor
    p, q = torch.zeros(count // 2, requires_grad=True), torch.zeros(count // 2 + 1)
    large = GradientBucket(1, ["p", "q"], [p, q])
    [(address, length)] = advised
    assert address == large.buffer.data_ptr() and address % (2 << 20) == 0
    assert length == 2 << 20
    for bucket in (small, large):
        assert bucket.buffer.dtype == torch.float32 and not bucket.buffer.any()
