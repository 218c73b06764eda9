"""Autotune: the search on its own, then on real engines (see ``tests/fakes/world.py``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from baguahvd.common.search import CoordinateSearch
from baguahvd.engine.autotune import MIB, Autotuner, GridSearch, Settings
from baguahvd.engine.engine import GLOBAL_PROCESS_SET_ID, Engine
from baguahvd.engine.messages import OpType
from tests.fakes.world import start_job

START = Settings(128 * MIB, 1.0)


def _score(settings: Settings) -> float:
    """A smooth synthetic score peaking at 8 MiB and 2 ms."""
    return -(
        math.log2(settings.fusion_threshold / (8 * MIB)) ** 2
        + math.log2(settings.cycle_time_ms / 2.0) ** 2
    )


def _run_search(budget: int) -> GridSearch:
    search = GridSearch(START, budget)
    while (candidate := search.ask()) is not None:
        search.tell(candidate, _score(candidate))
    return search


def test_the_search_starts_from_the_initial_settings_and_spends_its_budget() -> None:
    search = GridSearch(START, 7)
    first = search.ask()
    assert first == START
    seen = [first]
    search.tell(first, 0.0)
    while (candidate := search.ask()) is not None:
        assert candidate not in seen
        seen.append(candidate)
        search.tell(candidate, 0.0)
    assert len(seen) == 7


def test_the_search_refines_towards_the_best_settings() -> None:
    best = _run_search(20).best
    assert best.fusion_threshold == 8 * MIB
    assert best.cycle_time_ms == pytest.approx(2.0, rel=0.3)


def test_the_search_rejects_an_empty_budget() -> None:
    with pytest.raises(ValueError, match="at least 1 sample"):
        GridSearch(START, 0)


def test_the_tuner_discards_warmup_samples_then_freezes_the_best(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(START, 2, 3, 3, str(log))
    proposals = []
    now = 0.0
    while not tuner.frozen:
        now += 1.0
        proposal = tuner.record([("a", 100), ("b", 100)], now)
        if proposal is not None:
            proposals.append(proposal)
            tuner.applied(proposal, now)
    # Three candidates measured: two proposals, then the best once more.
    assert len(proposals) == 3
    assert proposals[-1] == tuner.search.best
    rows = list(csv.reader(log.open()))
    assert rows[0] == [
        "hierarchical_allreduce", "hierarchical_allgather", "cache_enabled", "cycle_time_ms",
        "tensor_fusion_threshold", "score",
    ]
    assert len(rows) == 4
    assert rows[1][3:5] == ["1", "128"]
    assert float(rows[1][5]) > 0


def _train(engine: Engine, steps: int) -> list[torch.Tensor]:
    results = []
    for step in range(steps):
        handles = []
        for name in ("w1", "w2", "w3"):
            tensor = torch.full((256,), float(engine.rank + step))
            handles.append(engine.submit(
                OpType.ALLREDUCE, "allreduce", GLOBAL_PROCESS_SET_ID, [tensor],
                [torch.empty_like(tensor)], name=name,
            ))
        for handle in handles:
            outputs = handle.wait()
            assert outputs is not None
            results.append(outputs[0])
    return results


def test_every_rank_switches_settings_at_the_same_cycle_and_freezes_after_the_budget(
    tmp_path: Path,
) -> None:
    log = tmp_path / "autotune.csv"
    job = start_job(
        3, autotune=True, autotune_warmup_samples=1, autotune_steps_per_sample=2,
        autotune_max_samples=4, autotune_log=str(log),
    )
    try:
        results = job.run(lambda rank, engine: _train(engine, 40))
        changes = job.run(lambda rank, engine: list(engine.settings_changes))
        settings = job.run(lambda rank, engine: engine.settings)
        tuner = job.engines[0]._loop.tuner
    finally:
        job.close()
    assert changes[0] == changes[1] == changes[2]
    # Three candidates after the initial settings, then the best frozen.
    assert len(changes[0]) == 4
    assert tuner is not None and tuner.frozen
    assert settings[0] == settings[1] == settings[2] == tuner.search.best
    for step_results in zip(*results):
        for result in step_results:
            assert torch.equal(result, step_results[0])
    assert torch.equal(results[0][-1], torch.full((256,), 3.0 * 39 + 3.0))
    assert len(log.read_text().splitlines()) == 1 + 4


def test_without_autotune_the_settings_never_change() -> None:
    job = start_job(2)
    try:
        job.run(lambda rank, engine: _train(engine, 5))
        changes = job.run(lambda rank, engine: list(engine.settings_changes))
    finally:
        job.close()
    assert changes == [[], []]


def test_the_coordinate_search_measures_the_grid_then_the_best_points_neighbours() -> None:
    search = CoordinateSearch((1.0,), [[2.0, 4.0]], 5)
    asked = []
    while (point := search.ask()) is not None:
        asked.append(point)
        search.tell(point, -abs(point[0] - 4.0))
    # The grid after the start, then 4 * 2 and 4 / 2 (measured already, skipped), then
    # 4 * sqrt(2).
    assert asked == [(1.0,), (2.0,), (4.0,), (8.0,), (4.0 * 2**0.5,)]
    assert search.best == (4.0,)
