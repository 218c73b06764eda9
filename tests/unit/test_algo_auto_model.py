"""algorithm="auto": the cost model and the candidate rules, in one process."""

from __future__ import annotations

import pytest
import torch

from baguahvd.algorithms import AutoAlgorithm, LinkFigures, resolve
from baguahvd.torch.algorithms.auto import StepFigures, predict_step_times
from baguahvd.torch.algorithms.base import AlgorithmContext
from baguahvd.torch.algorithms.q_adam import QAdamOptimizer

ALL = [
    "gradient_allreduce", "bytegrad", "qadam", "decentralized", "low_precision_decentralized",
]
STEP = StepFigures(
    backward_s=0.2, gradient_bytes=32 * 1024 * 1024, buckets=4, compression_s=0.05, size=2
)


def _fastest(link: LinkFigures, candidates: list[str]) -> str:
    predicted = predict_step_times(link, STEP, candidates)
    return min(predicted, key=lambda name: predicted[name])


def test_a_slow_link_picks_bytegrad_and_a_fast_one_gradient_allreduce() -> None:
    synchronous = ["gradient_allreduce", "bytegrad"]
    assert _fastest(LinkFigures(1e-3, 12.5e6), synchronous) == "bytegrad"
    assert _fastest(LinkFigures(2e-5, 10e9), synchronous) == "gradient_allreduce"


def test_backward_hides_gradient_communication_but_not_weight_averaging() -> None:
    predicted = predict_step_times(LinkFigures(0.0, 1e9), STEP, ALL)
    # 32 MiB at 1 GB/s is 34 ms, hidden behind 200 ms of backward but for the last bucket.
    assert predicted["gradient_allreduce"] == pytest.approx(0.2 + STEP.gradient_bytes / 1e9 / 4)
    assert predicted["decentralized"] == pytest.approx(0.2 + STEP.gradient_bytes / 1e9)
    assert set(predicted) == set(ALL)


def test_link_figures_come_from_two_timings() -> None:
    link = LinkFigures.from_timings((1000, 0.0011), (1_001_000, 0.0111))
    assert link.latency_s == pytest.approx(0.00109)
    assert link.bandwidth == pytest.approx(1e8)
    noisy = LinkFigures.from_timings((1000, 0.002), (2000, 0.001))
    assert noisy.bandwidth == pytest.approx(2000 / 0.001)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"probe_steps": 0}, "probe_steps"),
        ({"allow_weight_averaging": 1}, "allow_weight_averaging"),
        ({"link": (1.0, 2.0)}, "LinkFigures"),
    ],
)
def test_the_constructor_names_a_bad_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoAlgorithm(**kwargs)  # type: ignore[arg-type]


def test_link_figures_reject_impossible_values() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        LinkFigures(0.0, 0.0)


_OPTIMIZERS: list[torch.optim.Optimizer] = []
"""The optimizers of the contexts made below: a context holds its optimizer weakly."""


def _context(optimizer_class: type[torch.optim.Optimizer]) -> AlgorithmContext:
    model = torch.nn.Linear(4, 2)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    _OPTIMIZERS.append(optimizer)
    return AlgorithmContext(optimizer, list(model.named_parameters()), None)  # type: ignore[arg-type]


def test_candidates_follow_the_optimizer_and_the_users_permission() -> None:
    assert AutoAlgorithm().candidates(_context(torch.optim.SGD)) == [
        "gradient_allreduce", "bytegrad",
    ]
    assert AutoAlgorithm().candidates(_context(torch.optim.Adam)) == [
        "gradient_allreduce", "bytegrad", "qadam",
    ]
    assert "qadam" in AutoAlgorithm().candidates(_context(QAdamOptimizer))
    assert "qadam" not in AutoAlgorithm().candidates(_context(torch.optim.AdamW))
    assert AutoAlgorithm(allow_weight_averaging=True).candidates(
        _context(torch.optim.SGD)
    ) == ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized"]


def test_auto_is_a_registered_name() -> None:
    assert isinstance(resolve("auto"), AutoAlgorithm)
    assert isinstance(resolve(" AUTO "), AutoAlgorithm)
