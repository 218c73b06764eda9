"""How a user thread names a collective (``baguahvd.engine.submission.Submissions``):
unnamed requests numbered in order per process set, past the collectives this rank skipped."""

from __future__ import annotations

import threading

import pytest
import torch

from baguahvd.engine import submission
from baguahvd.engine.messages import JOIN_KEY, OpType, unnamed_number
from baguahvd.engine.submission import Submissions


def _number(submissions: Submissions, process_set_id: int = 0) -> int:
    key, display, site = submissions.name(OpType.ALLREDUCE, "allreduce", process_set_id, None)
    assert display == f"allreduce.{key}" and site == ""
    return unnamed_number(key)


def test_unnamed_requests_are_numbered_in_order_per_process_set() -> None:
    submissions = Submissions()
    assert [_number(submissions) for _ in range(3)] == [0, 1, 2]
    assert [_number(submissions, 1) for _ in range(2)] == [0, 1]
    # Named requests and joins take no number.
    assert submissions.name(OpType.ALLREDUCE, "allreduce", 0, "w") == (
        "allreduce.w", "allreduce.w", ""
    )
    assert submissions.name(OpType.JOIN, "join", 0, None)[0] == JOIN_KEY
    assert _number(submissions) == 3
    assert _number(submissions, 1) == 2


def test_the_next_unnamed_request_comes_after_the_collectives_skipped() -> None:
    submissions = Submissions()
    assert _number(submissions) == 0
    submissions.skip_unnamed(0, "noname.4")  # the others ran 1 to 4 while this rank joined
    submissions.skip_unnamed(0, "noname.2")  # an older one changes nothing
    submissions.skip_unnamed(0, "allreduce.w")  # named: ignored
    submissions.skip_unnamed(1, "noname.0")  # another set's own count
    assert [_number(submissions) for _ in range(2)] == [5, 6]
    assert _number(submissions, 1) == 1
    # A skip of a number already taken leaves the count where it is.
    submissions.skip_unnamed(0, "noname.6")
    assert _number(submissions) == 7


def _name_at_once(submissions: Submissions, skips: range) -> list[list[int]]:
    """The numbers 8 threads took, 2,000 each, naming at once while another counts
    ``skips`` as skipped (the engine thread, for a rank that joined)."""
    threads = 8
    taken: list[list[int]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)

    def name(index: int) -> None:
        start.wait()
        taken[index] += [_number(submissions) for _ in range(2_000)]

    def skip() -> None:
        start.wait()
        for number in skips:
            submissions.skip_unnamed(0, f"noname.{number}")

    workers = [threading.Thread(target=name, args=(i,)) for i in range(threads)]
    workers.append(threading.Thread(target=skip))
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    for numbers in taken:  # each thread's own in the order it named them
        assert numbers == sorted(numbers)
    return taken


def test_threads_naming_at_once_take_every_number_once() -> None:
    taken = _name_at_once(Submissions(), range(0))
    assert sorted(n for numbers in taken for n in numbers) == list(range(16_000))


def test_threads_naming_while_collectives_are_skipped_never_share_a_number() -> None:
    # A number below the skipped ones may be left out (taken just before the skip, then
    # passed over), as all of them are skipped; from the first one after, none is.
    taken = _name_at_once(Submissions(), range(100_000, 100_050))
    numbers = sorted(n for numbers in taken for n in numbers)
    assert len(set(numbers)) == len(numbers) == 16_000
    after = [n for n in numbers if n >= 100_050]
    assert after == list(range(100_050, 100_050 + len(after)))
    assert all(n < 100_000 for n in numbers[: len(numbers) - len(after)])


def test_one_tensor_requests_of_a_size_share_their_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(submission, "ONE_SHAPE", {})
    monkeypatch.setattr(submission, "_ONE_SHAPE_MAX", 3)
    first = submission.describe_tensors([torch.ones(4, 2)], "allreduce")
    again = submission.describe_tensors([torch.zeros(4, 2)], "allreduce")
    assert first == ("float32", ((4, 2),), "CPU")
    assert again[1] is first[1] and type(first[1][0]) is tuple
    assert submission.describe_tensors([torch.ones(())], "allreduce")[1] == ((),)
    # A job whose sizes keep changing empties the table rather than growing it.
    for length in range(1, 10):
        assert submission.describe_tensors([torch.ones(length)], "allreduce")[1] == ((length,),)
        assert len(submission.ONE_SHAPE) <= 3
