"""How many rows the draft's and the verify's forwards can have: bounds for buffers, warm-ups
and memory profiles, and the CUDA-graph buckets they pad to. Pure functions of the engine's
sizes."""

from __future__ import annotations

from collections.abc import Sequence


def capture_bucket(rows: int, capture_sizes: Sequence[int]) -> int:
    """`rows` padded to the next CUDA-graph capture size, as vLLM's dispatcher pads a batch
    (`rows` itself past the largest size, or without any)."""
    return next((c for c in sorted(capture_sizes) if c >= rows), rows)


def draft_row_counts(
    max_num_seqs: int, widths: int | Sequence[int], capture_sizes: Sequence[int] = ()
) -> list[int]:
    """Every row count a draft forward can have: one row per request (bonus and chain passes,
    b = 1..max_num_seqs), k per request (tree levels, each width k a step may use), and each
    of those padded to its capture bucket."""
    widths = (widths,) if isinstance(widths, int) else widths
    batches = range(1, max(max_num_seqs, 1) + 1)
    rows = set(batches) | {b * max(k, 1) for b in batches for k in widths}
    return sorted(rows | {capture_bucket(n, capture_sizes) for n in rows})


def draft_rows_bound(max_num_seqs: int, max_rows: int, widths: Sequence[int]) -> int:
    """The most rows one draft pass has: a bonus or chain pass one per request, a tree level k
    per request in whole levels of at most `max_rows` rows (wider levels are split over
    passes), for every width (a narrower one can fill more rows)."""
    return max(
        [min(max_num_seqs, max_rows)]
        + [k * min(max_num_seqs, max(1, max_rows // k)) for k in widths]
    )


def warm_up_rows(bound: int, capture_sizes: Sequence[int], max_rows: int) -> int:
    """Rows of the draft's warm-up forwards: `bound` padded to a capture size (vLLM sizes a
    graph's static inputs from its first call), never one row (a dynamic dimension of size 1
    is specialized away), within `max_rows`."""
    return min(max(2, capture_bucket(bound, capture_sizes)), max_rows)


def verify_rows_bound(max_num_batched_tokens: int, max_num_seqs: int, num_draft_tokens: int) -> int:
    """The most logits rows one verify has: every node of max_num_seqs trees of the widest,
    deepest shape, within the step's token budget."""
    return min(max_num_batched_tokens, max_num_seqs * (num_draft_tokens + 1))
