"""A CPU substitute's dense twin: its HQQ weights dequantized once, run from the row count where
a dense matmul overtakes the int4 kernel (`dense_crossover`: a micro-benchmark run once per
weight shape at load).

Design: docs/substitutes.md, "Dense twins".
"""

from __future__ import annotations

import functools
import itertools
import logging
import math

import torch
import torch.nn.functional as F

from vllm_subspec.draft_model.quantize import QuantizedWeight

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


# Row counts timed to find where a dense matmul overtakes the int4 kernel (those up to the most
# rows a draft pass can send).
CROSSOVER_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TIMED_MAX_N = 32768


@functools.lru_cache(maxsize=64)
def dense_crossover(
    kernel_cls: type, n: int, k: int, group_size: int, dtype: torch.dtype, max_rows: int
) -> int | None:
    """The fewest rows from which a dense [n, k] matmul beats the int4 kernel (`kernel_cls`:
    `Int4CpuKernel` or its subclass), up to max_rows (None: not there). Timed once per kernel
    and shape in this process (best of 3 per row count, random weights: the time depends on
    the shape only), on at most TIMED_MAX_N output features (both kernels' time is linear in
    n; a vocabulary-sized lm_head would take ~20 s)."""
    import time

    n = min(n, TIMED_MAX_N)
    qw = QuantizedWeight(
        codes=torch.randint(0, 16, (n, k), dtype=torch.uint8),
        scale=torch.rand(n, k // group_size) / 8,
        zero=torch.rand(n, k // group_size) * 15,
        bits=4,
        group_size=group_size,
    )
    int4 = kernel_cls(qw, dtype)
    dense = qw.dequantize(dtype)

    def best(fn, x) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        return min(times)

    rows = [m for m in CROSSOVER_ROWS if m <= max_rows] or [max_rows]
    int4_s, dense_s = [], []
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            int4_s.append(best(int4, x))
            dense_s.append(best(lambda v: F.linear(v, dense), x))
    crossover = crossover_rows(rows, int4_s, dense_s, max_rows)
    logger.debug("vllm-subspec: int4 vs dense [%d, %d]: dense from %s rows", n, k, crossover)
    return crossover


def crossover_rows(
    rows: list[int], int4_s: list[float], dense_s: list[float], max_rows: int
) -> int | None:
    """Where the dense matmul's time line crosses below the int4 kernel's: each kernel's
    seconds fitted as a + b * rows (Theil-Sen: the median of the pairwise slopes, so a few
    timings slowed by the rest of the machine do not move the fit). The first whole row count
    from which dense is predicted faster, or None if that is past max_rows (or never)."""

    def fit(ys):
        slopes = sorted(
            (y2 - y1) / (x2 - x1)
            for (x1, y1), (x2, y2) in itertools.combinations(zip(rows, ys), 2)
            if x2 != x1
        )
        b = slopes[len(slopes) // 2] if slopes else 0.0
        a = sorted(y - b * x for x, y in zip(rows, ys))[len(ys) // 2]
        return a, b

    (a_i, b_i), (a_d, b_d) = fit(int4_s), fit(dense_s)
    if a_d <= a_i and b_d <= b_i:
        return 1  # dense is never slower
    if b_d >= b_i:
        return None  # int4 is faster from the start and grows no faster
    first = max(1, math.ceil((a_d - a_i) / (b_i - b_d)))
    return first if first <= max_rows else None
