"""Is a memory series leaking? One value per iteration. Warm-up is found, not fixed: the growth of
a process that warms up slows down (allocator pools, caches, lazily built state), so the series'
last half gives its settled rate, and the warm-up ends at the first point from which the growth
of the rest is no faster than that rate (allowing for its noise). The verdict's figure is the
slope after the warm-up: Theil-Sen (the median of the pairwise slopes, deaf to a few outliers).
A leak grows at the same rate from the start, so it has no warm-up to hide in. A run too short for
the warm-up to end (the engine's takes about 200 iterations) has no settled part: what follows the
point found still slows down, its first half growing faster than its second, and its slope, above the
limit or below it, says nothing either way (inconclusive: neither a leak nor a pass). A run of at least
twice that warm-up (the warm-up, then as many iterations to measure) is judged on its slope."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MIN_TAIL = 5  # points after warm-up needed for a verdict
WARMUP_ITERATIONS = 200  # the engine's warm-up in the soaks of docs/benchmarks.md (allocator pools, caches)
MAX_POINTS = 200  # Theil-Sen over at most this many points, evenly spaced (its cost is quadratic)


@dataclass(frozen=True)
class Trend:
    warmup: int  # iterations of warm-up (the series' points before the settled part)
    slope: float | None  # growth per iteration after warm-up; None with too few points
    points: int
    settling: bool = False  # the growth after the warm-up found still slows down: the warm-up is not over


def _ols(y: list[float]) -> tuple[float, float]:
    """Least-squares slope of y against its index, and the slope's standard error."""
    n = len(y)
    mx, my = (n - 1) / 2, sum(y) / n
    sxx = sum((x - mx) ** 2 for x in range(n))
    slope = sum((x - mx) * (v - my) for x, v in enumerate(y)) / sxx
    sse = sum((v - my - slope * (x - mx)) ** 2 for x, v in enumerate(y))
    return slope, math.sqrt(sse / (n - 2) / sxx) if n > 2 else 0.0


def warmup_end(y: list[float]) -> int:
    """Where the growth of `y` has settled (0 when it grows alike throughout)."""
    n = len(y)
    if n < 2 * MIN_TAIL:
        return 0
    settled, noise = _ols(y[n // 2:])
    limit = settled + 2 * noise + 0.25 * abs(settled)
    return next(w for w in range(n // 2 + 1) if _ols(y[w:])[0] <= limit)


def theil_sen(y: list[float]) -> float:
    step = max(1, len(y) // MAX_POINTS)
    xs = list(range(0, len(y), step))
    return statistics.median((y[j] - y[i]) / (j - i) for a, i in enumerate(xs) for j in xs[a + 1:])


def slowing_down(y: list[float]) -> bool:
    """Whether the first half of `y` grows faster than its second half, beyond the two slopes' noise."""
    if len(y) < 2 * 3:  # a slope and its error need 3 points
        return False
    (first, e1), (second, e2) = _ols(y[:len(y) // 2]), _ols(y[len(y) // 2:])
    return first - second > 2 * math.hypot(e1, e2) + 0.25 * abs(second)


def trend(y: list[float]) -> Trend:
    """The slope after the warm-up found; a series shorter than twice the engine's warm-up whose growth
    there still slows down is `settling` (the warm-up found is not one that ended)."""
    w = warmup_end(y)
    tail = y[w:]
    settling = len(y) < 2 * WARMUP_ITERATIONS and slowing_down(tail)
    return Trend(w, theil_sen(tail) if len(tail) >= MIN_TAIL else None, len(y), settling)


def leaks(y: list[float], limit_per_200: float) -> tuple[bool | None, Trend]:
    """Whether `y` grows by more than `limit_per_200` per 200 iterations after its warm-up; None
    (inconclusive) while the warm-up is not over (`settling`), whatever its slope: a series still slowing
    down has no settled slope to judge, above the limit or below it."""
    t = trend(y)
    if t.settling:
        return None, t
    return (t.slope is not None and t.slope * 200 > limit_per_200), t
