"""Is a memory series leaking? One value per iteration. Warm-up is found, not fixed: the growth of
a process that warms up slows down (allocator pools, caches, lazily built state), so the series'
last half gives its settled rate, and the warm-up ends at the first point from which the growth
of the rest is no faster than that rate (allowing for its noise). The verdict's figure is the
slope after the warm-up: Theil-Sen (the median of the pairwise slopes, deaf to a few outliers).
A leak grows at the same rate from the start, so it has no warm-up to hide in."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MIN_TAIL = 5  # points after warm-up needed for a verdict
MAX_POINTS = 200  # Theil-Sen over at most this many points, evenly spaced (its cost is quadratic)


@dataclass(frozen=True)
class Trend:
    warmup: int  # iterations of warm-up (the series' points before the settled part)
    slope: float | None  # growth per iteration after warm-up; None with too few points
    points: int


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


def trend(y: list[float]) -> Trend:
    w = warmup_end(y)
    tail = y[w:]
    return Trend(w, theil_sen(tail) if len(tail) >= MIN_TAIL else None, len(y))


def leaks(y: list[float], limit_per_200: float) -> tuple[bool, Trend]:
    """Whether `y` grows by more than `limit_per_200` per 200 iterations after its warm-up."""
    t = trend(y)
    return (t.slope is not None and t.slope * 200 > limit_per_200), t
