"""CPU that the background write of one commit costs, per 100 MB: the commit container
against ``torch.save`` (its zip records also take a CRC-32 of every byte), in one process.

    python benchmarks/elastic_commit_write_cpu.py [--rounds 6] [--json out.json]

Payload: the state dict of the 25.2M-parameter MLP of ``benchmarks/elastic_commit.py``
(101 MB of float32) and a few plain values. Each round writes it once with each format,
alternating which goes first, through ``CheckpointStore.write`` (the whole write: payload
hashed with SHA-256 as it is written, fsync, manifest, cleanup) in the calling thread, and
records that thread's CPU time (``time.thread_time``), the wall time and the 1-minute load
average. A second measurement per format runs the same write on a thread while the main
thread counts in a Python loop: the count's rate during the write, against its rate in
the same length of time just before, shows how long the write held the GIL (on a busy
2-core machine it also shows the competition for the cores).

Then the serialization alone, into a sink that neither hashes nor writes: ``torch.save``,
``torch.save`` with its CRC-32 turned off (a process-wide torch setting, turned off only
here, for the measurement), and the container, with the same two measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from baguahvd.torch.elastic import store as store_module
from baguahvd.torch.elastic.store import CheckpointStore

FORMATS = ("torch.save", "container")
SERIALIZERS = ("torch.save", "torch.save no CRC", "container")


def _payload() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024))
    return {"handlers": {"model": model.state_dict()}, "objects": {"step": 3, "epoch": 1}}


def _write(store: CheckpointStore, number: int, payload: Any, form: str) -> None:
    real_pack = store_module.pack
    if form == "torch.save":  # what the store wrote before the container
        store_module.pack = lambda _: None  # type: ignore[assignment]
    try:
        store.write(number, payload)
    finally:
        store_module.pack = real_pack


def _alone(store: CheckpointStore, number: int, payload: Any, form: str) -> tuple[float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    _write(store, number, payload, form)
    return time.thread_time() - cpu, time.perf_counter() - wall


def _count(seconds: float) -> int:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count


def _python_progress(store: CheckpointStore, number: int, payload: Any, form: str) -> float:
    """The main thread's counting rate while the write runs on a thread, over its rate in
    an equal time just before (1: the write never held the GIL it needed)."""
    writer = threading.Thread(target=_write, args=(store, number, payload, form))
    started = time.perf_counter()
    writer.start()
    count = 0
    while writer.is_alive():
        count += _count(0.005)
    length = time.perf_counter() - started
    writer.join()
    before = _count(length)
    return count / before if before else float("nan")


class _NullSink:
    def write(self, data: Any) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        """Nothing is buffered."""


def _serialize(payload: Any, form: str) -> None:
    if form == "container":
        packed = store_module.pack(payload)
        assert packed is not None
        packed.write_to(_NullSink())  # type: ignore[arg-type]
        return
    crc = form == "torch.save"
    torch.serialization.set_crc32_options(crc)
    try:
        torch.save(payload, _NullSink())  # type: ignore[arg-type]
    finally:
        torch.serialization.set_crc32_options(True)


def _serialization_alone(payload: Any, form: str) -> tuple[float, float]:
    cpu = time.thread_time()
    _serialize(payload, form)
    cpu = time.thread_time() - cpu
    writer = threading.Thread(target=_serialize, args=(payload, form))
    started = time.perf_counter()
    writer.start()
    count = 0
    while writer.is_alive():
        count += _count(0.002)
    length = time.perf_counter() - started
    writer.join()
    before = _count(length)
    return cpu, count / before if before else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="file for the raw figures")
    args = parser.parse_args()
    payload = _payload()
    nbytes = sum(t.nbytes for t in payload["handlers"]["model"].values())
    per_100mb = 100e6 / nbytes
    raw: dict[str, list[dict[str, float]]] = {form: [] for form in FORMATS}
    with tempfile.TemporaryDirectory(prefix="commit-write-cpu-") as folder:
        store = CheckpointStore(folder, host="bench")
        number = 0
        _write(store, 0, payload, "container")  # warm the page cache and the allocator
        for round_ in range(args.rounds):
            order = FORMATS if round_ % 2 == 0 else FORMATS[::-1]
            for form in order:
                number += 1
                cpu, wall = _alone(store, number, payload, form)
                number += 1
                progress = _python_progress(store, number, payload, form)
                raw[form].append({
                    "cpu_s": cpu * per_100mb, "wall_s": wall * per_100mb,
                    "python_progress": progress, "load": os.getloadavg()[0],
                })
    print(f"{nbytes / 1e6:.0f} MB a write, {args.rounds} rounds alternated; per 100 MB:")
    print(f"{'format':<12} {'CPU s (median, min)':>20} {'wall s':>8} "
          f"{'Python thread progress':>23} {'load':>10}")
    for form in FORMATS:
        rows = raw[form]
        cpus = [r["cpu_s"] for r in rows]
        loads = [r["load"] for r in rows]
        print(
            f"{form:<12} {statistics.median(cpus):>12.3f}, {min(cpus):.3f} "
            f"{statistics.median(r['wall_s'] for r in rows):>8.3f} "
            f"{statistics.median(r['python_progress'] for r in rows):>23.2f} "
            f"{min(loads):>5.1f}-{max(loads):.1f}"
        )
    alone: dict[str, list[tuple[float, float, float]]] = {form: [] for form in SERIALIZERS}
    for round_ in range(args.rounds):
        for form in SERIALIZERS if round_ % 2 == 0 else SERIALIZERS[::-1]:
            cpu, progress = _serialization_alone(payload, form)
            alone[form].append((cpu * per_100mb, progress, os.getloadavg()[0]))
    print("\nserialization alone, into a sink that neither hashes nor writes; per 100 MB:")
    print(f"{'format':<18} {'CPU s (median)':>15} {'Python thread progress':>23} {'load':>10}")
    for form in SERIALIZERS:
        rows_ = alone[form]
        print(
            f"{form:<18} {statistics.median(r[0] for r in rows_):>15.3f} "
            f"{statistics.median(r[1] for r in rows_):>23.2f} "
            f"{min(r[2] for r in rows_):>5.1f}-{max(r[2] for r in rows_):.1f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"payload_bytes": nbytes, "per_100mb": raw, "serialization_alone": {
                form: [{"cpu_s": c, "python_progress": p, "load": load} for c, p, load in rows]
                for form, rows in alone.items()
            }}, out, indent=1)


if __name__ == "__main__":
    main()
