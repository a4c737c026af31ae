"""A cost that grows linearly with rows, fitted online from timings."""

from __future__ import annotations

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
