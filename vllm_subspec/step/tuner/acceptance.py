"""What the target accepts, learned from verified trees: `MassCalibration` (P(a depth is
accepted) from the draft's own frontier mass, calibrated) and `WidthAcceptance` (per width,
P(accepted length >= j)). The shape tuner predicts a step's tokens with them.

Design: docs/shape_tuner.md, "Acceptance".
"""

from __future__ import annotations

import torch

from vllm_subspec.step.tuner.linear_cost import DECAY


class MassCalibration:
    """P(depth j accepted | frontier mass m at depth j - 1) = m * r(m), the draft's belief times
    a correction r learned per bin of log10(m): r = accepted / summed belief over the
    observations in the bin (one observation: one verified depth of one request).
    Prior: r = 1 (the draft's own belief), worth PRIOR observations."""

    LOG_MIN, BINS_PER_DECADE, PRIOR = -6.0, 4, 2.0

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        n = int(-self.LOG_MIN * self.BINS_PER_DECADE) + 1
        self.centers = torch.tensor(
            [10 ** (self.LOG_MIN + (i + 0.5) / self.BINS_PER_DECADE) for i in range(n)],
            dtype=torch.float64,
        ).clamp(max=1.0)
        self.hits = torch.zeros(n, dtype=torch.float64)
        self.belief = torch.zeros(n, dtype=torch.float64)

    def bins(self, mass: torch.Tensor) -> torch.Tensor:
        lg = torch.log10(mass.double().clamp(min=10**self.LOG_MIN, max=1.0))
        idx = ((lg - self.LOG_MIN) * self.BINS_PER_DECADE).floor().long()
        return idx.clamp(0, len(self.hits) - 1)

    def predict(self, mass: torch.Tensor) -> torch.Tensor:
        """P(next depth accepted) for frontier masses [...] (CPU)."""
        b = self.bins(mass)
        prior = self.PRIOR * self.centers[b]
        r = (self.hits[b] + prior) / (self.belief[b] + prior)
        return (mass.double().clamp(0.0, 1.0) * r).clamp(max=1.0).float()

    def add(self, mass: torch.Tensor, accepted: torch.Tensor) -> None:
        """mass [n] (CPU), accepted [n] bool: one verified depth each."""
        self.hits *= self.decay
        self.belief *= self.decay
        b = self.bins(mass)
        self.belief.index_add_(0, b, mass.double().clamp(0.0, 1.0))
        self.hits.index_add_(0, b, accepted.double())


class WidthAcceptance:
    """Per depth j: P(depth j accepted | depth j - 1 accepted and depth j verified), for one
    width, so a depth cut short by adaptive stopping is not counted as rejected."""

    def __init__(self, max_depth: int, decay: float = DECAY):
        self.decay = decay
        self.hits = torch.zeros(max_depth, dtype=torch.float64)
        self.trials = torch.zeros(max_depth, dtype=torch.float64)
        self.steps = 0

    def add(self, accepted: int, verified_depth: int) -> None:
        self.hits *= self.decay
        self.trials *= self.decay
        self.steps += 1
        reached = min(accepted + 1, verified_depth)  # depths 1..reached had a chance
        self.trials[:reached] += 1
        self.hits[:accepted] += 1

    def reach(self, scale: float = 1.0) -> torch.Tensor:
        """[max_depth] P(accepted length >= j), j = 1..max_depth. Each depth's rate has the
        depth before's rate as its prior, worth one observation (a tree that survived to depth j
        is about as likely to go on as one at j - 1); depth 1's prior is 0.5. scale: each
        depth's rate times this (another lm_head's, `LmHeadComparison.scale`), at most 1."""
        rate, prior = [], 0.5  # Python floats: the same float64 arithmetic, no tensor ops
        for hits, trials in zip(self.hits.tolist(), self.trials.tolist()):
            prior = (hits + prior) / (trials + 1.0)
            rate.append(min(prior * scale, 1.0) if scale != 1.0 else prior)
        return torch.cumprod(torch.tensor(rate, dtype=self.hits.dtype), 0)

    def rescale(self, scale: float) -> None:
        """Carry the statistics over to another lm_head: its predicted rates (`reach(scale)`)
        become the measured ones, which its own trees then correct."""
        self.hits = torch.minimum(self.hits * scale, self.trials)
