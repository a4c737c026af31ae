"""Acceptance statistics read from vLLM's own spec-decode metrics.

SubSpec reports through vLLM's counters (`vllm:spec_decode_*`, also on Prometheus `/metrics`),
so this only reads them: τ (mean acceptance length) = 1 + accepted draft tokens / drafts, i.e.
tokens emitted per verify step. `LLM(..., disable_log_stats=False)` is needed for `get_metrics()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean acceptance length: accepted draft tokens per verify step + 1 (the bonus)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        return self._combine(other, 1)

    def __sub__(self, other: AcceptanceStats) -> AcceptanceStats:
        return self._combine(other, -1)

    def _combine(self, other: AcceptanceStats, sign: int) -> AcceptanceStats:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return AcceptanceStats(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            [
                a + sign * b
                for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))
            ],
        )


def acceptance_stats(llm) -> AcceptanceStats:
    """Cumulative counters of an `LLM`; subtract two snapshots to measure one run."""
    stats = AcceptanceStats()
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            stats.num_drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            stats.num_draft_tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            stats.num_accepted_tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            stats.accepted_per_position = [int(v) for v in m.values]
    return stats
