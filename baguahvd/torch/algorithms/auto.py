"""``algorithm="auto"``: measure the link and the step, predict each algorithm, keep the fastest.

Steps:

1. When the optimizer is built, every rank times a few allreduces of two sizes on its
   process set; the fastest of each gives the line ``t(n) = latency + n / bandwidth`` of one
   allreduce of ``n`` bytes (figures passed as ``link=`` replace the measurement).
2. The first ``probe_steps`` optimizer steps run gradient_allreduce. During backward the
   time from the first to the last gradient hook is the step's compute that communication
   can hide behind; rank 0 also times bytegrad's MinMaxUInt8 arithmetic over the gradients.
3. After the probe, rank 0 predicts the step time of every candidate with
   :func:`predict_step_times`, picks the fastest, logs the figures and the choice, and
   broadcasts the choice; every rank switches to it for the next step. The switch happens
   between two optimizer steps on every rank, because the broadcast is a collective that
   every rank issues after the same step.

The chosen algorithm runs flat (``hierarchical=False``), the form the prediction describes.
Candidates keep synchronous semantics: gradient_allreduce, bytegrad (floating-point
gradients only), and qadam when the optimizer is Adam. Decentralized and low-precision
decentralized, which average weights rather than gradients, are candidates only with
``allow_weight_averaging=True``. The asynchronous algorithm never is.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from baguahvd.kernels import (
    compress_minmax_uint8,
    decompress_minmax_uint8,
    decompress_reduce_minmax_uint8,
)
from baguahvd.torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    check_bool,
    check_int,
)
from baguahvd.torch.algorithms.buckets import split_into_buckets
from baguahvd.torch.algorithms.bytegrad import ByteGradAlgorithm
from baguahvd.torch.algorithms.decentralized import DecentralizedAlgorithm
from baguahvd.torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from baguahvd.torch.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralizedAlgorithm,
)
from baguahvd.torch.algorithms.primitives import check_compressible
from baguahvd.torch.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from baguahvd.torch.functions import broadcast_object
from baguahvd.torch.mpi_ops import Sum, allreduce

logger = logging.getLogger("baguahvd.algorithms")

SMALL_PROBE_BYTES = 4 * 1024
LARGE_PROBE_BYTES = (256 * 1024, 16 * 1024 * 1024)
"""The large probe is the gradients' size, within these bounds."""
PROBE_REPEATS = 5
"""Timed allreduces per size; the fastest counts (other load only ever slows a call)."""


@dataclasses.dataclass(frozen=True)
class LinkFigures:
    """One allreduce of ``n`` bytes takes ``latency_s + n / bandwidth`` seconds.

    ``bandwidth`` is payload bytes per second of the allreduce; a ring moves
    ``2 (p - 1) / p`` times the payload over each link.
    """

    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}.")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be a finite number > 0, got {self.bandwidth!r}.")

    def allreduce_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    @classmethod
    def from_timings(cls, small: tuple[int, float], large: tuple[int, float]) -> LinkFigures:
        """The line through two (bytes, seconds) timings; a slope that noise made negative
        counts as the large timing alone."""
        (n_small, t_small), (n_large, t_large) = small, large
        slope = (t_large - t_small) / max(n_large - n_small, 1)
        if slope <= 0:
            return cls(max(t_small, 0.0), n_large / max(t_large, 1e-9))
        return cls(max(t_small - slope * n_small, 0.0), 1.0 / slope)


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What the prediction needs besides the link."""

    backward_s: float
    """Time from the first to the last gradient hook of a step."""
    gradient_bytes: int
    buckets: int
    compression_s: float
    """The MinMaxUInt8 arithmetic of one bytegrad step over the gradients (compress,
    decompress-reduce, compress, decompress), without its collectives."""
    size: int
    """Ranks in the process set."""


def predict_step_times(
    link: LinkFigures, step: StepFigures, candidates: Sequence[str]
) -> dict[str, float]:
    """Predicted seconds per step of each candidate, backward included (forward and the
    optimizer cost every candidate the same and are left out).

    Gradient algorithms overlap every bucket's transfer but the last one's with backward;
    compression competes with backward for the same cores and is added whole;
    weight-averaging algorithms communicate after the step, one bucket, nothing overlapped.
    """
    k = max(step.buckets, 1)
    m = step.gradient_bytes
    ring = 2 * (step.size - 1) / step.size if step.size > 1 else 1.0

    def overlapped(comm: float) -> float:
        return max(step.backward_s, comm * (k - 1) / k) + comm / k

    costs = {
        GradientAllReduceAlgorithm.name: overlapped(k * link.latency_s + m / link.bandwidth),
        # An alltoall and an allgather of a quarter of the bytes: a ring allreduce's traffic.
        ByteGradAlgorithm.name: overlapped(2 * k * link.latency_s + m / 4 / link.bandwidth)
        + step.compression_s,
        # After its warmup, QAdam moves compressed moments exactly as bytegrad moves gradients.
        QAdamAlgorithm.name: overlapped(2 * k * link.latency_s + m / 4 / link.bandwidth)
        + step.compression_s,
        DecentralizedAlgorithm.name: step.backward_s + link.allreduce_s(m),
        # Compressed weights sent to and received from both ring neighbours.
        LowPrecisionDecentralizedAlgorithm.name: step.backward_s + 2 * link.latency_s
        + 2 * (m / 4) / (link.bandwidth * ring) + step.compression_s,
    }
    return {name: costs[name] for name in candidates}


class AutoAlgorithm(Algorithm):
    """Chooses the algorithm by measurement (see the module docstring).

    Args:
        allow_weight_averaging: also consider decentralized and low_precision_decentralized,
            which average weights instead of gradients.
        probe_steps: optimizer steps run with gradient_allreduce before choosing.
        link: the link's figures, instead of measuring them (for tests and known clusters).
    """

    name = "auto"

    def __init__(
        self,
        allow_weight_averaging: bool = False,
        probe_steps: int = 2,
        link: LinkFigures | None = None,
    ) -> None:
        check_bool("allow_weight_averaging", allow_weight_averaging)
        check_int("probe_steps", probe_steps, 1)
        if link is not None and not isinstance(link, LinkFigures):
            raise ValueError(f"link must be a LinkFigures or None, got {link!r}.")
        self.allow_weight_averaging = allow_weight_averaging
        self.probe_steps = probe_steps
        self.link = link

    def candidates(self, context: AlgorithmContext) -> list[str]:
        """The algorithms that may be chosen for this optimizer and these parameters."""
        names = [GradientAllReduceAlgorithm.name]
        try:
            check_compressible(ByteGradAlgorithm.name, context.parameters, "gradients")
            compressible = True
        except ValueError:
            compressible = False
        if compressible:
            names.append(ByteGradAlgorithm.name)
            if isinstance(context.optimizer, (torch.optim.Adam, QAdamOptimizer)) and not (
                isinstance(context.optimizer, torch.optim.AdamW)
            ):
                names.append(QAdamAlgorithm.name)
        if self.allow_weight_averaging:
            names.append(DecentralizedAlgorithm.name)
            if compressible:
                names.append(LowPrecisionDecentralizedAlgorithm.name)
        return names

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        return AutoImpl(self, context)


# Flat variants: the cost model counts every rank in the compressed exchange, which is what
# hierarchical=False does (hierarchical bytegrad on one host compresses nothing).
_FACTORIES: dict[str, Callable[[], Algorithm]] = {
    GradientAllReduceAlgorithm.name: GradientAllReduceAlgorithm,
    ByteGradAlgorithm.name: lambda: ByteGradAlgorithm(hierarchical=False),
    QAdamAlgorithm.name: lambda: QAdamAlgorithm(hierarchical=False),
    DecentralizedAlgorithm.name: lambda: DecentralizedAlgorithm(hierarchical=False),
    LowPrecisionDecentralizedAlgorithm.name: lambda: LowPrecisionDecentralizedAlgorithm(
        hierarchical=False
    ),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """Rank 0's decision, as every rank receives it."""

    name: str
    link: LinkFigures
    step: StepFigures
    predicted: dict[str, float]


class AutoImpl(AlgorithmImpl):
    """Runs gradient_allreduce while probing, then the chosen algorithm's implementation."""

    algorithm: AutoAlgorithm

    def __init__(self, algorithm: AutoAlgorithm, context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.link = algorithm.link if algorithm.link is not None else measure_link(context)
        self.delegate: AlgorithmImpl = GradientAllReduceAlgorithm().reify(context)
        self.choice: Choice | None = None
        self._first_hook: float | None = None
        self._last_hook = 0.0
        self._backward: list[float] = []

    def on_backward(self, p: torch.Tensor) -> None:
        if self.choice is None:
            now = time.perf_counter()
            if self._first_hook is None:
                self._first_hook = now
            self._last_hook = now
        self.delegate.on_backward(p)

    def synchronize(self) -> None:
        if self.choice is None and self._first_hook is not None:
            self._backward.append(self._last_hook - self._first_hook)
            self._first_hook = None
        self.delegate.synchronize()

    def step(self, closure: Any, optimizer_step: Callable[[Any], Any]) -> Any:
        return self.delegate.step(closure, optimizer_step)

    def post_step(self) -> None:
        self.delegate.post_step()
        super().post_step()
        if self.choice is None and self.step_id >= self.algorithm.probe_steps:
            self._choose()

    def close(self) -> None:
        self.delegate.close()

    def _choose(self) -> None:
        context = self.context
        ranks = context.process_set.ranks or [0]
        proposal: Choice | None = None
        if context.process_set.rank() == 0:
            proposal = self._decide()
        choice: Choice = broadcast_object(
            proposal, root_rank=ranks[0], name="bagua.auto.choice",
            process_set=context.process_set,
        )
        self.choice = choice
        if choice.name != GradientAllReduceAlgorithm.name:
            self.delegate.close()
            self.delegate = _FACTORIES[choice.name]().reify(context)

    def _decide(self) -> Choice:
        context = self.context
        params = [p for _, p in context.parameters]
        gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        candidates = self.algorithm.candidates(context)
        compression_s = (
            time_compression(params, context.size)
            if ByteGradAlgorithm.name in candidates else 0.0
        )
        step = StepFigures(
            backward_s=statistics.median(self._backward) if self._backward else 0.0,
            gradient_bytes=gradient_bytes,
            buckets=len(split_into_buckets(context.parameters, context.bucket_bytes)),
            compression_s=compression_s,
            size=context.size,
        )
        predicted = predict_step_times(self.link, step, candidates)
        name = min(predicted, key=lambda n: predicted[n])
        logger.info(
            "algorithm=auto: link latency %.3g ms, bandwidth %.4g MB/s; backward %.3g ms, "
            "%d gradient bytes in %d buckets, compression round trip %.3g ms; predicted step "
            "(ms): %s; chose %s",
            self.link.latency_s * 1e3, self.link.bandwidth / 1e6, step.backward_s * 1e3,
            gradient_bytes, step.buckets, compression_s * 1e3,
            ", ".join(f"{n} {t * 1e3:.3g}" for n, t in predicted.items()), name,
        )
        return Choice(name, self.link, step, predicted)


def measure_link(context: AlgorithmContext) -> LinkFigures:
    """Times allreduces of a small and a large buffer on the process set (every rank)."""
    gradient_bytes = sum(p.numel() * p.element_size() for _, p in context.parameters)
    low, high = LARGE_PROBE_BYTES
    large_bytes = min(max(gradient_bytes, low), high)
    timings = []
    for label, nbytes in (("small", SMALL_PROBE_BYTES), ("large", large_bytes)):
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        seconds = []
        for repeat in range(PROBE_REPEATS + 1):
            start = time.perf_counter()
            allreduce(
                tensor, op=Sum, name=f"bagua.auto.probe.{label}.{repeat}",
                process_set=context.process_set,
            )
            if repeat:
                seconds.append(time.perf_counter() - start)
        timings.append((nbytes, min(seconds)))
    return LinkFigures.from_timings(timings[0], timings[1])


def time_compression(params: Sequence[torch.Tensor], size: int) -> float:
    """Seconds of bytegrad's MinMaxUInt8 arithmetic over the gradients' size on this rank,
    the collectives replaced by their local shapes (best of two)."""
    chunks = max(size, 1)
    numel = -(-max(sum(p.numel() for p in params), 1) // chunks) * chunks
    flat = torch.randn(numel, dtype=torch.float32)
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        received = compress_minmax_uint8(flat, chunks)
        reduced = decompress_reduce_minmax_uint8(received, chunks, numel, flat.dtype)
        mine = compress_minmax_uint8(reduced, 1)
        gathered = mine.repeat(chunks)
        decompress_minmax_uint8(gathered, chunks, numel, flat.dtype, out=flat)
        best = min(best, time.perf_counter() - start)
    return best
