"""What the shape tuner may spend on drafting not yet measured faster than plain (exploration
steps, probes, looks past the usual depth): `Exploration.width` (the width to explore next),
`Exploration.depth` (how deep such a step may go) and `Exploration.affordable` (whether the
measured rates' allowance covers it).

Design: docs/shape_tuner.md, "Measured rates".
"""

from __future__ import annotations

from vllm_subspec.step.tuner.acceptance import WidthAcceptance
from vllm_subspec.step.tuner.costs import CostModel
from vllm_subspec.step.tuner.rate_guard import RateGuard

# rows (requests x width x depth) an exploration step (a width's first trees, a look past the
# usual depth) drafts at most while costs are unmeasured, one depth at least: on a CPU a verify
# costs in proportion to its rows, so exploring at full depth with 32 requests (32 x 6 x 48
# rows) would stall a burst
EXPLORE_ROWS = 24
EXPLORE_COST = 3.0  # ... and, once costs are measured, costs at most this many plain steps


class Exploration:
    """The exploration budget over `widths`, from the cost model, the measured rates (`guard`)
    and each width's acceptance."""

    def __init__(
        self,
        widths: tuple[int, ...],
        auto_width: bool,
        auto_depth: bool,
        model: CostModel,
        guard: RateGuard,
        acceptance: dict[int, WidthAcceptance],
    ):
        self.widths = widths
        self.auto_width, self.auto_depth = auto_width, auto_depth
        self.model, self.guard, self.acceptance = model, guard, acceptance

    def width(self, unexplored: list[int], current: int, batch_size: int) -> int:
        """The width to explore next: the widest unexplored one (none: `current`); for the
        first look (no verify timed yet, measured rates on) of an engine that cannot price
        one (`CostModel.priced`), the widest whose depth has at most EXPLORE_ROWS rows (else
        the narrowest): what a row costs is not known yet."""
        if not unexplored:
            return current
        if (
            not (self.model.measure_rates and self.auto_depth)
            or self.model.known_widths()
            or self.model.priced
        ):
            return max(unexplored)
        fitting = [w for w in unexplored if batch_size * w <= EXPLORE_ROWS]
        return max(fitting) if fitting else min(unexplored)

    def affordable(self, width: int, depth: int, batch_size: int) -> bool:
        """Whether a step of (width, depth) fits this batch size's exploration allowance
        (`RateGuard.allowance`): what it is predicted to lose against plain's measured rate
        (its predicted seconds less the time plain needs for its predicted tokens), and is
        not overdrawn (a predicted gain is not yet a measured one). Before any verify is
        timed, priced from the draft pass timed at start and plain steps' forward
        (`CostModel.priced`, plain's rate predicted where this batch size has not run plain);
        unpriced (the first look): once the allowance covers EXPLORE_COST plain steps, what an
        exploration step may cost (on a CPU, one depth over 8 requests took ~3.4)."""
        if not self.model.measure_rates:
            return True
        allowance, plain = self.guard.allowance(batch_size), self._plain_rate(batch_size)
        known = self.model.known_widths()
        if plain is None:
            return allowance >= 0.0
        if not known and not self.model.priced:
            return allowance >= EXPLORE_COST * batch_size / plain
        rows = batch_size * width
        seconds = self.model.step_seconds_like(
            self._like(width, known),
            batch_size,
            depth - 1,
            (depth - 1) * rows,
            depth * rows,
        )
        tokens = batch_size * (1.0 + sum(self.acceptance[width].reach().tolist()[:depth]))
        # a predicted gain does not license losses beyond the allowance: the prediction is
        # what is not yet measured (a model that says drafting wins is what can be wrong)
        return allowance >= max(0.0, seconds - tokens / plain)

    def affordable_depth(self, width: int, depth: int, batch_size: int) -> int:
        """The deepest depth up to `depth` that is `affordable` (unpriced: `depth` or 0), 0 if
        none: a look whose full
        depth is predicted to lose more than the allowance may still gain at a shallower one
        (before any tree, each depth's acceptance is a prior, so deep looks are predicted to
        lose). Bisection: the predicted loss grows with depth once a depth's tokens are worth
        less than its pass and rows."""
        if self.affordable(width, depth, batch_size):
            return depth
        if not self.model.priced or not self.affordable(width, 1, batch_size):
            return 0  # (unpriced: the look as planned, or none)
        low, high = 1, depth - 1
        while low < high:
            mid = (low + high + 1) // 2
            if self.affordable(width, mid, batch_size):
                low = mid
            else:
                high = mid - 1
        return low

    def depth(self, width: int, depth: int, batch_size: int) -> int:
        """`depth`, capped so that an exploration or probe step is predicted to take at most
        EXPLORE_COST plain steps (where rows are nearly free, as with offloading, it stays
        deep; 0 where one depth already costs more); while costs are unmeasured, so that it
        drafts at most EXPLORE_ROWS rows."""
        plain = self.guard.rate(False, batch_size) or self.model.plain_rate(batch_size)
        # a width not yet run is costed like the widest one that has (its rows cost as much)
        known = self.model.known_widths()
        if not plain or not (known or self.model.priced):
            # the first look: one depth, what a row costs is unknown (with several widths to
            # explore: their looks that follow, costed, differ in rows, so the fit gets a slope)
            return (
                1
                if self.model.measure_rates
                and self.auto_width
                and self.auto_depth
                and len(self.widths) > 1
                else max(1, min(depth, EXPLORE_ROWS // max(1, batch_size * width)))
            )
        like = self._like(width, known)
        budget = EXPLORE_COST * batch_size / plain
        if (
            self.model.measure_rates
            and self.model.step_seconds_like(like, batch_size, 0, 0, batch_size * width) > budget
        ):
            return 0  # one depth alone costs more than the budget: do not explore it now
        return self._deepest_within(budget, like, width, depth, batch_size)

    def _plain_rate(self, batch_size: int) -> float | None:
        """Plain's measured rate at this batch size, else (priced) the model's prediction
        from plain steps' forward at other batch sizes: costs are per row, not per bucket."""
        measured = self.guard.rate(False, batch_size)
        if measured is None and self.model.priced:
            return self.model.plain_rate(batch_size) or None
        return measured

    @staticmethod
    def _like(width: int, known: list[int]) -> int:
        """The width whose costs price `width`'s step: its own, else the widest timed one's
        (its rows cost as much), else its own priors (`CostModel.pass_cost`)."""
        return width if width in known or not known else max(known)

    def _deepest_within(
        self, budget: float, like: int, width: int, depth: int, batch_size: int
    ) -> int:
        """The deepest depth up to `depth` whose step, costed like width `like`, takes at most
        `budget` seconds, else 1: a step's seconds grow with its depth (one more pass, more
        verify rows; every cost is non-decreasing in rows), so a bisection finds it in
        log2(depth) evaluations (this runs at every plain step while exploration waits for
        its allowance)."""
        rows = batch_size * width
        low, high = 1, max(1, depth)
        while low < high:
            mid = (low + high + 1) // 2
            if (
                self.model.step_seconds_like(
                    like, batch_size, mid - 1, (mid - 1) * rows, mid * rows
                )
                > budget
            ):
                high = mid - 1
            else:
                low = mid
        return low
