"""Horovod's timeline in a multi-rank job: rank 0 writes a Chrome trace with Horovod's
activity names; the other ranks accept the calls and write nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

# Read at init(), as Horovod's own suite does.
os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")

import baguahvd.torch as hvd  # noqa: E402
from baguahvd.algorithms import ByteGradAlgorithm  # noqa: E402
from baguahvd.runtime.runtime import runtime  # noqa: E402
from baguahvd.torch.algorithms.optimizer import make_algorithm_optimizer  # noqa: E402


def _load(path: Path) -> list[dict[str, Any]]:
    text = path.read_text().rstrip()
    if not text.endswith("]"):  # a writer killed mid-write; Chrome accepts it too
        text = text.rstrip(",") + "]"
    events: list[dict[str, Any]] = json.loads(text)
    return events


def _rows(events: list[dict[str, Any]]) -> dict[str, int]:
    """Tensor name -> its pid in the trace."""
    return {e["args"]["name"]: e["pid"] for e in events
            if e.get("name") == "process_name" and "name" in e.get("args", {})}


def _activities(events: list[dict[str, Any]], pid: int) -> list[str]:
    return [e["name"] for e in events if e.get("pid") == pid and e["ph"] == "B"]


def test_timeline_records_horovods_activities(rank: int, size: int, tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    # Otherwise a faster rank's first request can reach rank 0 before its timeline starts.
    hvd.barrier()
    for _ in range(3):  # negotiated in full, then answered from the response cache
        hvd.allreduce(torch.ones(8), name="tl.grad")
    hvd.grouped_allreduce([torch.ones(4), torch.ones(3)], name="tl.group")
    hvd.allgather(torch.ones(2, 2), name="tl.gather")
    hvd.broadcast(torch.ones(2), 0, name="tl.bcast")
    hvd.stop_timeline()
    hvd.barrier()
    if rank != 0:
        assert not path.exists()
        return
    text = path.read_text()
    for part in ("allreduce.tl.grad", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE",
                 "MPI_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER",
                 "NEGOTIATE_ALLGATHER", "MPI_ALLGATHER", "MPI_BROADCAST",
                 "start_time_since_epoch_in_micros", "CYCLE_START"):
        assert part in text, part
    events = json.loads(text)  # stopped: a complete array
    rows = _rows(events)
    grad = rows["allreduce.tl.grad"]
    # The first negotiation ticks once per rank.
    ticks = {e["name"] for e in events if e.get("pid") == grad and e["ph"] == "X"}
    assert ticks == {str(r) for r in range(size)}
    assert _activities(events, grad).count("ALLREDUCE") == 3
    assert "MEMCPY_IN_FUSION_BUFFER" in _activities(events, rows["grouped_allreduce.tl.group"])
    for name, pid in rows.items():
        phases = [e["ph"] for e in events if e.get("pid") == pid and e["ph"] in "BE"]
        assert phases.count("B") == phases.count("E"), name


def test_large_tensors_skip_the_fusion_buffer(rank: int, size: int, tmp_path: Path) -> None:
    # The big tensor has the data plane's unfused size (2 MiB over MPI); 4 KB ones do not.
    engine = runtime.engine
    assert engine is not None
    comm = engine.process_sets[0].comm
    assert comm is not None and comm.unfused_bytes is not None
    unfused = comm.unfused_bytes
    path = tmp_path / "unfused.json"
    big, small = torch.full((unfused // 4,), float(rank + 1)), torch.full((1024,), float(rank))
    hvd.start_timeline(str(path))
    hvd.barrier()
    for _ in range(3):  # a burst: one cycle, with the two small tensors fused
        inputs = [big.clone(), small.clone(), small.clone()]
        handles = [hvd.allreduce_async_(t, name=f"unfused.{i}", op=hvd.Average)
                   for i, t in enumerate(inputs)]
        big_out, *small_out = [hvd.synchronize(h) for h in handles]
        assert torch.all(big_out == (size + 1) / 2)
        for out in small_out:
            assert torch.all(out == (size - 1) / 2)
    hvd.stop_timeline()
    hvd.barrier()
    if rank != 0:
        return
    events = _load(path)
    rows = _rows(events)
    activities = _activities(events, rows["allreduce.unfused.0"])
    assert activities.count("ALLREDUCE") == 3 and "MEMCPY_IN_FUSION_BUFFER" not in activities
    assert "MEMCPY_IN_FUSION_BUFFER" in _activities(events, rows["allreduce.unfused.1"])


def test_unnamed_calls_answered_from_the_cache_show_their_own_names(
    rank: int, size: int, tmp_path: Path
) -> None:
    # A recurring burst of unnamed calls runs from the cache under the responses agreed for
    # the first burst; the timeline still draws each call under its own name.
    path = tmp_path / "unnamed.json"
    hvd.start_timeline(str(path))
    hvd.barrier()
    for _ in range(3):
        tensors = [torch.full((4,), float(rank + i)) for i in range(5)]
        handles = [hvd.allreduce_async_(t, op=hvd.Sum) for t in tensors]
        for i, handle in enumerate(handles):
            assert torch.all(hvd.synchronize(handle) == float(sum(range(size)) + size * i))
    hvd.stop_timeline()
    hvd.barrier()
    if rank != 0:
        return
    events = _load(path)
    rows = _rows(events)
    numbers = sorted(
        int(name.rsplit(".", 1)[1]) for name in rows if name.startswith("allreduce.noname.")
    )
    last = numbers[-1]
    assert numbers[-15:] == list(range(last - 14, last + 1)), numbers
    for name in (f"allreduce.noname.{number}" for number in numbers[-15:]):
        activities = _activities(events, rows[name])
        assert "QUEUE" in activities and "ALLREDUCE" in activities, (name, activities)


def test_timeline_shows_the_bagua_algorithm(rank: int, size: int, tmp_path: Path) -> None:
    path = tmp_path / "bagua.json"
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = make_algorithm_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        ByteGradAlgorithm(hierarchical=False),
    )
    hvd.start_timeline(str(path))
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
    hvd.stop_timeline()
    hvd.barrier()
    if rank != 0:
        return
    events = _load(path)
    bagua = [name for name in _rows(events) if ".bagua.bytegrad." in name]
    assert bagua, _rows(events)
    for name in bagua:
        activities = _activities(events, _rows(events)[name])
        # After the negotiation, the algorithm's activity wraps the collective.
        op = name.split(".", 1)[0].upper()
        assert "BAGUA_BYTEGRAD" in activities and op in activities, (name, activities)
        assert activities.index("BAGUA_BYTEGRAD") + 1 == activities.index(op), (name,
                                                                               activities)


def test_start_timeline_twice_and_stop_twice(rank: int, tmp_path: Path) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    hvd.start_timeline(str(first))
    hvd.allreduce(torch.ones(2), name="tl.first")
    hvd.start_timeline(str(second))
    hvd.allreduce(torch.ones(2), name="tl.second")
    hvd.stop_timeline()
    hvd.stop_timeline()
    hvd.barrier()
    if rank == 0:
        before, after = json.loads(first.read_text()), json.loads(second.read_text())
        assert "ALLREDUCE" in _activities(before, _rows(before)["allreduce.tl.first"])
        # (Faster ranks' requests for tl.second may reach the first file's negotiation.)
        assert "ALLREDUCE" in _activities(after, _rows(after)["allreduce.tl.second"])
        assert "allreduce.tl.first" not in _rows(after)
