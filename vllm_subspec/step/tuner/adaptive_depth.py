"""Adaptive depth within a step: after each draft pass, which requests draft one more depth
(`AdaptiveDepth.drafting_next`), and at the end how many depths each sends to verification
(`AdaptiveDepth.verify_depths`), from the calibrated acceptance of its frontier mass and the
cost model.

Design: docs/shape_tuner.md, "Adaptive depth within a step".
"""

from __future__ import annotations

import torch

from vllm_subspec.step.tuner.acceptance import MassCalibration
from vllm_subspec.step.tuner.costs import CostModel


class AdaptiveDepth:
    """auto_depth: verify rows may be cut (a fixed depth verifies whatever was drafted)."""

    def __init__(self, calibration: MassCalibration, model: CostModel, auto_depth: bool):
        self.calibration, self.model, self.auto_depth = calibration, model, auto_depth

    def _step_so_far(self, p: torch.Tensor, width: int, reached: list[int]) -> tuple[float, float]:
        """Predicted (tokens, seconds) of a step whose request i has drafted reached[i] depths.
        p: [B, >= max(reached)] P(depth j + 1 accepted), from calibration.predict."""
        b, depths = len(reached), sum(reached)
        drafted = torch.arange(p.shape[1])[None, :] < torch.tensor(reached)[:, None]
        tokens = b + float(p[drafted].sum())  # drafted[i, j]: request i drafted depth j + 1
        # after the root pass, each pass drafts one more depth (k rows) of each request in it
        seconds = self.model.step_seconds(
            width, b, max(reached) - 1, width * (depths - b), width * depths
        )
        return tokens, seconds

    def drafting_next(self, log_mass: torch.Tensor, width: int, reached: list[int]) -> list[int]:
        """After drafting up to depth d = max(reached): the indices of the requests that draft
        depth d + 1 ([] ends the step's drafting). log_mass: [B, d + 1] log frontier mass at
        depths 0..d (depth 0: the root, 0.0; -inf past a request's own depth), CPU. reached:
        [B] the depth each request has drafted; those at d are the candidates. The rule:
        docs/shape_tuner.md, "Adaptive depth within a step"."""
        d = log_mass.shape[1] - 1
        p = self.calibration.predict(log_mass.exp())  # [B, d + 1]: P(depth j + 1 accepted)
        tokens, seconds = self._step_so_far(p, width, reached)
        candidates = [i for i, r in enumerate(reached) if r == d]
        verify_row = self.model.verify_row_cost(width, len(reached) + width * sum(reached))
        row_cost = width * (self.model.pass_cost(width).per_row() + verify_row)
        going = [i for i in candidates if float(p[i, d]) * seconds > tokens * row_cost]
        gain = float(p[going, d].sum())
        rows = width * len(going)
        cost = self.model.pass_cost(width)(rows) + verify_row * rows
        return going if going and gain * seconds > tokens * cost else []

    def verify_depths(
        self, log_mass: torch.Tensor, width: int, reached: list[int] | None = None
    ) -> list[int]:
        """How many depths of each request's tree to verify: at most its drafted depth, less
        trailing depths whose verify rows cost more than they are expected to yield at the
        step's rate. log_mass: [B, d + 1] as in drafting_next; reached: each request's drafted
        depth (default: all d)."""
        b, d = log_mass.shape[0], log_mass.shape[1] - 1
        reached = [d] * b if reached is None else reached
        row_cost = self.model.verify_row_cost(width, b + width * sum(reached)) * width
        if row_cost <= 0 or not self.auto_depth:
            return list(reached)
        p = self.calibration.predict(log_mass.exp())
        tokens, seconds = self._step_so_far(p, width, reached)
        pays = p[:, :d] > tokens / seconds * row_cost  # [B, d]: depth j + 1 pays for its rows
        depths = []
        for row, keep in zip(pays.tolist(), reached):
            while keep > 1 and not row[keep - 1]:
                keep -= 1
            depths.append(keep)
        return depths
