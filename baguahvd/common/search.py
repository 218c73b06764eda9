"""A coordinate search over positive parameters, in ask/tell form, for online autotuning.

Pass ``i`` (one per parameter) measures parameter ``i``'s grid with the others at the best
point so far; every later pass measures the best point's neighbours, each parameter
multiplied and divided by a factor that starts at 2 and shrinks to its square root each
pass, until the factor is below 1.05. A point is never measured twice, and the search stops
after ``budget`` measurements.

Why not Bayesian optimisation: with a budget of about 20 noisy samples over two or three
parameters whose effect is smooth in their logarithm, a grid that brackets the optimum
followed by local refinement finds it as reliably, is deterministic (so it can be tested
exactly) and needs no extra dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Point = tuple[float, ...]


class CoordinateSearch:
    """See the module docstring.

    Args:
        start: the initial point (measured first).
        grids: per parameter, the values of its grid pass.
        budget: how many points to measure (at least 1).
        normalize: maps a proposed point to the point actually measured (clamping,
            rounding); it must be idempotent.
    """

    def __init__(
        self,
        start: Point,
        grids: Sequence[Sequence[float]],
        budget: int,
        normalize: Callable[[Point], Point] = lambda point: point,
    ) -> None:
        if budget < 1:
            raise ValueError(f"the autotune budget must be at least 1 sample, got {budget}.")
        if len(grids) != len(start):
            raise ValueError(f"{len(grids)} grids for {len(start)} parameters.")
        self.normalize = normalize
        self.start = normalize(start)
        self.grids = [tuple(grid) for grid in grids]
        self.budget = budget
        self.scores: dict[Point, float] = {}
        self._queue: list[Point] = [self.start]
        self._pass = 0
        self._factor = 2.0

    @property
    def best(self) -> Point:
        """The best-scoring point measured so far (the start before any)."""
        if not self.scores:
            return self.start
        return max(self.scores, key=lambda point: self.scores[point])

    def ask(self) -> Point | None:
        """The next point to measure, or None once the budget is spent."""
        while len(self.scores) < self.budget:
            while self._queue:
                candidate = self._queue.pop(0)
                if candidate not in self.scores:
                    return candidate
            if not self._next_pass():
                return None
        return None

    def tell(self, point: Point, score: float) -> None:
        """Records the score of a measured point (higher is better)."""
        self.scores[point] = score

    def _next_pass(self) -> bool:
        best = self.best
        dims = len(self.grids)
        self._pass += 1
        if self._pass <= dims:
            axis = self._pass - 1
            self._queue = [self._moved(best, axis, value) for value in self.grids[axis]]
            return True
        if self._factor < 1.05:
            return False
        f = self._factor
        self._queue = [
            self._moved(best, axis, best[axis] * scale)
            for axis in range(dims)
            for scale in (f, 1.0 / f)
        ]
        self._factor = f ** 0.5
        return True

    def _moved(self, point: Point, axis: int, value: float) -> Point:
        return self.normalize((*point[:axis], value, *point[axis + 1 :]))
