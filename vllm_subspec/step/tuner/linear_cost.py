"""Costs over a row count, fitted online from timings: a line (`LinearCost`) and a
piecewise-linear curve through row-count buckets (`RowsCurve`)."""

from __future__ import annotations

import bisect

DECAY = 0.98  # per observation: statistics follow the workload over the last ~50 steps


class LinearCost:
    """seconds = a + b * rows, fitted by exponentially weighted least squares (b >= 0, a >= 0).
    With too little spread in rows to separate a and b, the cost is taken as proportional to
    rows: an upper bound on the marginal cost of a row, never a negative one."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, rows: float, seconds: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds

    @property
    def known(self) -> bool:
        return self.n > 0

    def state(self) -> list[float]:
        """Its decayed sums (`load_state` puts them back: kept across restarts)."""
        return [self.n, self.sx, self.sy, self.sxx, self.sxy]

    def load_state(self, state: list[float]) -> None:
        self.n, self.sx, self.sy, self.sxx, self.sxy = (float(v) for v in state)

    def coefficients(self) -> tuple[float, float]:
        if not self.known:
            return 0.0, 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= 1e-6 * max(mx * mx, 1.0):  # one row count seen: no slope to fit
            return (my, 0.0) if mx < 1e-9 else (0.0, my / mx)
        b = max((self.sxy / self.n - mx * my) / var, 0.0)
        a = my - b * mx
        if a < 0:  # through the origin
            return 0.0, self.sxy / max(self.sxx, 1e-12)
        return a, b

    def __call__(self, rows: float) -> float:
        a, b = self.coefficients()
        return a + b * rows

    def per_row(self) -> float:
        return self.coefficients()[1]


class RowsCurve:
    """seconds(rows) of a forward: piecewise linear through the decayed mean (rows, seconds) of
    each power-of-two bucket of row counts observed, as their lower envelope (each point no
    higher than any point at more rows: a slow outlier does not lift the curve); flat below its
    first point and with one point; past its widest point the last segment's slope, at most
    that point's seconds per row. Where a CPU turns compute-bound (its roofline's knee), a line
    fitted at a few rows predicts a forward over hundreds of rows several times too cheap; this
    curve follows the knee. Each bucket decays with its own observations."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._buckets: dict[int, list[float]] = {}  # bucket -> [weight, rows, seconds] (decayed)
        self._rows: list[float] = []  # the curve's points, rows ascending
        self._seconds: list[float] = []

    def add(self, rows: float, seconds: float) -> None:
        bucket = 1 << max(0, int(rows) - 1).bit_length()
        b = self._buckets.setdefault(bucket, [0.0, 0.0, 0.0])
        d = self.decay
        b[0], b[1], b[2] = d * b[0] + 1.0, d * b[1] + rows, d * b[2] + max(seconds, 0.0)
        self._rebuild()

    def state(self) -> dict[str, list[float]]:
        """Its buckets' decayed sums (`load_state` puts them back: kept across restarts)."""
        return {str(bucket): list(b) for bucket, b in self._buckets.items()}

    def load_state(self, state: dict[str, list[float]]) -> None:
        self._buckets = {int(bucket): [float(v) for v in b] for bucket, b in state.items()}
        if any(len(b) != 3 or b[0] <= 0 for b in self._buckets.values()):
            raise ValueError("a bucket needs a positive weight, rows and seconds")
        self._rebuild()

    def _rebuild(self) -> None:
        """The curve's points from its buckets."""
        points = sorted((r / w, s / w) for w, r, s in self._buckets.values())
        self._rows = [r for r, _ in points]
        self._seconds, low = [0.0] * len(points), float("inf")
        for i in range(len(points) - 1, -1, -1):  # the lower envelope, never decreasing
            low = min(low, points[i][1])
            self._seconds[i] = low

    @property
    def known(self) -> bool:
        return bool(self._rows)

    @property
    def narrowest(self) -> float:
        """The fewest rows of its points (0 with none)."""
        return self._rows[0] if self._rows else 0.0

    @property
    def widest(self) -> float:
        """The most rows of its points (0 with none)."""
        return self._rows[-1] if self._rows else 0.0

    def slope(self, rows: float) -> float:
        """Seconds per row at `rows` (0 below the first point and with one point)."""
        n = len(self._rows)
        if n < 2 or rows < self._rows[0]:
            return 0.0
        i = min(max(bisect.bisect_left(self._rows, rows), 1), n - 1)
        slope = (self._seconds[i] - self._seconds[i - 1]) / max(
            self._rows[i] - self._rows[i - 1], 1e-9
        )
        if rows > self._rows[-1]:  # no steeper than the widest point's seconds per row
            slope = min(slope, self._seconds[-1] / max(self._rows[-1], 1e-9))
        return slope

    def __call__(self, rows: float) -> float:
        if not self._rows:
            return 0.0
        if len(self._rows) == 1 or rows <= self._rows[0]:
            return self._seconds[0]
        if rows >= self._rows[-1]:
            return self._seconds[-1] + self.slope(rows) * (rows - self._rows[-1])
        i = bisect.bisect_left(self._rows, rows)
        return self._seconds[i - 1] + self.slope(rows) * (rows - self._rows[i - 1])
