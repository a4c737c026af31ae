"""The shape tuner's cost model: what a step of a given shape costs and emits. `StepCosts` holds
the fitted costs (injectable: `ShapeTuner.use_costs`); `CostModel` predicts a step's seconds
(`step_seconds`, `verify_cost`) and tokens/s (`predicted_rates`, `plain_rate`) from them and
takes the timings they are fitted from (`observe_*`).

Design: docs/shape_tuner.md, "The step cost model" and "Costs".
"""

from __future__ import annotations

import dataclasses

from vllm_subspec.step.tuner.linear_cost import DECAY, LinearCost, RowsCurve
from vllm_subspec.step.tuner.lm_head_choice import LmHeadChoice


@dataclasses.dataclass
class StepCosts:
    """The cost model a tuner decides with: each cost is called with a row count and returns
    seconds (`LinearCost`'s interface: `add`, `known`, `__call__`, `per_row`)."""

    draft_pass: dict  # width -> cost of a pass over that many rows (0: the root passes, B rows)
    verify: dict  # width -> the target's pass over width-w trees
    other: LinearCost  # rest of a step (scheduling, sampling): a constant

    @classmethod
    def measured(cls, widths: tuple[int, ...]) -> StepCosts:
        """Fitted online from this engine's own timings."""
        return cls(
            {w: LinearCost() for w in (0, *widths)}, {w: LinearCost() for w in widths}, LinearCost()
        )


class CostModel:
    """Predicted seconds and tokens/s of steps over `widths`, from `costs`. measure_rates:
    this engine's measured rates decide too (False: given costs decide alone), and a verify
    past its widest is floored by plain steps' forwards (`verify_cost`). lm_heads: the draft's
    two heads, if it has two (a step drafting with the other adds their cost difference)."""

    def __init__(
        self,
        widths: tuple[int, ...],
        costs: StepCosts,
        measure_rates: bool,
        lm_heads: LmHeadChoice | None = None,
    ):
        self.widths = widths
        self.costs = costs
        self.measure_rates = measure_rates
        self.lm_heads = lm_heads
        # a plain decoding step's forward over B rows (its time less the rest of a step), per
        # batch size: a verify over as many rows costs no less (`verify_cost`). Tree verifies
        # run at few rows on a CPU; this is what a step over many rows costs there
        self.forward = RowsCurve()
        # per width: the most rows its verifies have had (decaying): the line is trusted there
        self.verify_rows = {w: 0.0 for w in widths}
        # a draft pass over r rows, timed once before the first step (`seed_draft_pass`): with
        # `forward`, it prices a step before any of its passes or verifies is timed (`priced`)
        self.draft_prior = LinearCost()

    @property
    def draft_pass(self) -> dict:
        return self.costs.draft_pass

    @property
    def verify(self) -> dict:
        return self.costs.verify

    @property
    def other(self):
        return self.costs.other

    def known_widths(self) -> list[int]:
        """The widths whose verify has been timed."""
        return [w for w in self.widths if self.verify[w].known]

    @property
    def priced(self) -> bool:
        """Whether a step can be priced before any verify is timed (with measured rates): a
        draft pass was timed at start (`seed_draft_pass`) and a plain step's forward measured
        (`forward`); a verify is then priced as a forward over its rows (`prior_verify`)."""
        return self.measure_rates and self.draft_prior.known and self.forward.known

    def prior_verify(self, rows: float) -> float:
        """A verify of `rows` rows before any is timed: plain steps' forward at as many rows
        (`forward`: with offloading, the weight stream, whatever the rows), and past the
        widest plain step each further row at the draft pass's cost per row (the same layers'
        compute; a verify's tree attention on top is what its own timings then add)."""
        widest = self.forward.widest
        extra = max(rows - widest, 0.0) * self.draft_prior.per_row()
        return max(self.forward(rows), self.forward(widest) + extra)

    def pass_cost(self, width: int) -> LinearCost:
        """The cost of a draft pass of width `width`'s trees: its own once timed, else the
        root passes', else the one timed at start."""
        for cost in (self.draft_pass[width], self.draft_pass[0]):
            if cost.known:
                return cost
        return self.draft_prior if self.priced else self.draft_pass[width]

    def seed_draft_pass(self, rows: int, seconds: float) -> None:
        """A draft pass over `rows` rows took `seconds` (timed before the first step)."""
        self.draft_prior.add(rows, seconds)

    # ---- predictions ---------------------------------------------------------------------
    def forward_floor(self, rows: float) -> float:
        """What a verify of `rows` rows costs at least, with measured rates: plain steps'
        forward over as many rows, within or past the rows plain steps have had (0 below
        them, or unmeasured). A width's line fitted at one row count is proportional to rows,
        which with offloading (a forward's cost flat in its rows) prices small verifies far
        too cheap; this floor is the weight stream they pay as well."""
        if not self.measure_rates or not self.forward.known or rows < self.forward.narrowest:
            return 0.0
        return self.forward(rows)

    def verify_cost(self, width: int, rows: float) -> float:
        """Seconds of a verify of `rows` rows of width-k trees: its fitted line, no less than
        a plain step's forward over as many rows (`forward_floor`); past the most rows this
        width's verifies have had (with measured rates), no less than the line there plus
        what plain steps' forwards grow by between the two row counts (`forward`: the knee of
        a CPU's roofline, which a line fitted at few rows misses)."""
        if not self.verify[width].known and self.priced:
            return self.prior_verify(rows)
        seconds = max(self.verify[width](rows), self.forward_floor(rows))
        widest = self.verify_rows[width]
        if not self.measure_rates or rows <= widest or not self.forward.known:
            return seconds
        return max(seconds, self.verify[width](widest) + self.forward(rows) - self.forward(widest))

    def verify_row_cost(self, width: int, rows: float) -> float:
        """Seconds one more verify row costs at `rows` rows (`verify_cost`'s slope, at most;
        where the forward floor binds, its slope)."""
        per_row = self.verify[width].per_row()
        if self.forward_floor(rows) > self.verify[width](rows):
            return self.forward.slope(rows)
        if not self.measure_rates or rows <= self.verify_rows[width]:
            return per_row
        return max(per_row, self.forward.slope(rows))

    def _other_head(self, head: str | None) -> bool:
        """Whether `head` is another lm_head than the one drafting now."""
        return head is not None and self.lm_heads is not None and head != self.lm_heads.current

    def step_seconds(
        self,
        width: int,
        batch_size: int,
        passes: int,
        pass_rows: int,
        nodes: int,
        head: str | None = None,
    ) -> float:
        """Predicted seconds of a step: the root pass over the B bonus tokens, `passes` later
        passes over `pass_rows` rows in all (the cost is linear in rows, so each costs what a
        pass over their mean does), and the verify of B + `nodes` rows. head: drafting with
        this lm_head instead of the current one (the passes were measured with that)."""
        later = passes * self.pass_cost(width)(pass_rows / passes) if passes else 0.0
        if self._other_head(head):
            later += self.lm_heads.extra_seconds(head, batch_size)
            if passes:
                later += passes * self.lm_heads.extra_seconds(head, pass_rows / passes)
        return max(
            self.other(0)
            + self.pass_cost(0)(batch_size)
            + later
            + self.verify_cost(width, batch_size + nodes),
            1e-9,
        )

    def step_seconds_like(
        self, like: int, batch_size: int, passes: int, pass_rows: int, nodes: int
    ) -> float:
        """`step_seconds` with width `like`'s costs (for a width not measured yet; passes
        over more rows than the root's cost, where no later pass was timed, like the root's)."""
        pass_cost = self.pass_cost(like)
        later = passes * pass_cost(pass_rows / passes) if passes else 0.0
        return (
            self.other(0)
            + self.pass_cost(0)(batch_size)
            + later
            + self.verify_cost(like, batch_size + nodes)
        )

    def predicted_rate(
        self, width: int, depth: int, batch_size: int, reach: list[float], head: str | None = None
    ) -> float:
        """Predicted tokens/s of fixed-shape steps (width, depth) over `batch_size` requests;
        reach: the width's `WidthAcceptance.reach()` as a list (computed once per choice);
        head: the lm_head drafting (None: the current one)."""
        tokens = batch_size * (1.0 + sum(reach[:depth]))
        rows = batch_size * width
        return tokens / self.step_seconds(
            width, batch_size, depth - 1, (depth - 1) * rows, depth * rows, head
        )

    def predicted_rates(
        self, width: int, depths, batch_size: int, reach: list[float], head: str | None = None
    ) -> list[float]:
        """`predicted_rate` for each depth of `depths` (ascending), each fitted cost evaluated
        once: a step's passes grow linearly with its depth (one more pass over B*k rows), so a
        choice over 32 depths costs microseconds, not a millisecond."""
        rows = batch_size * width
        fixed = self.other(0) + self.draft_pass[0](batch_size)
        per_pass = self.draft_pass[width](rows)
        if self._other_head(head):
            fixed += self.lm_heads.extra_seconds(head, batch_size)
            per_pass += self.lm_heads.extra_seconds(head, rows)
        # the verify's line (every cost in use is linear in rows) and, past its widest
        # verify, `verify_cost`'s floor
        verify, verify_row = self.verify[width](0), self.verify[width].per_row()
        widest = self.verify_rows[width]
        floor = self.forward if self.measure_rates and self.forward.known else None
        anchor = verify + verify_row * widest - (floor(widest) if floor else 0.0)
        narrowest = floor.narrowest if floor is not None else 0.0
        rates, tokens, reached = [], float(batch_size), 0
        for depth in depths:
            while reached < depth:
                tokens += batch_size * reach[reached]
                reached += 1
            verify_rows = batch_size + depth * rows
            seconds = verify + verify_row * verify_rows
            if floor is not None and verify_rows >= narrowest:  # `forward_floor`
                seconds = max(seconds, floor(verify_rows))
            if floor is not None and verify_rows > widest:
                seconds = max(seconds, anchor + floor(verify_rows))
            rates.append(tokens / max(fixed + (depth - 1) * per_pass + seconds, 1e-9))
        return rates

    def plain_rate(self, batch_size: int) -> float:
        """Predicted tokens/s of plain decoding steps (no draft): one row per request, timed
        as the narrowest width's verify (a chain's is a plain causal pass), or before any
        verify as plain steps' forward (`priced`); 0 if unmeasured."""
        narrowest = min(self.widths)
        if self.verify[narrowest].known:  # (no cheaper than plain steps' own forward)
            return batch_size / max(self.other(0) + self.verify_cost(narrowest, batch_size), 1e-9)
        if self.priced:
            return batch_size / max(self.other(0) + self.forward(batch_size), 1e-9)
        return 0.0

    # ---- measurements --------------------------------------------------------------------
    def observe_draft(
        self,
        width: int,
        batch_size: int,
        pass_rows: list[int],
        seconds: float,
        root_seconds: float | None = None,
    ) -> None:
        """A step's drafting time: the root pass (B rows), then one pass per later depth over
        pass_rows[t] rows (B*k, fewer once requests drop out). The later passes are timed
        together: one observation at their mean row count (exact for a linear cost)."""
        n = len(pass_rows)
        mean_rows = sum(pass_rows) / n if n else 0.0
        if root_seconds is not None:
            self.draft_pass[0].add(batch_size, root_seconds)
            if n:
                self.draft_pass[width].add(mean_rows, (seconds - root_seconds) / n)
        else:  # one timing for all passes: rows-weighted split
            rows = batch_size + sum(pass_rows)
            self.draft_pass[0].add(batch_size, seconds * batch_size / rows)
            if n:
                self.draft_pass[width].add(mean_rows, seconds * mean_rows / rows)

    def observe_verify(self, width: int, rows: int, seconds: float) -> None:
        self.verify[width].add(rows, seconds)
        self.verify_rows[width] = max(rows, DECAY * self.verify_rows[width])

    def observe_other(self, seconds: float) -> None:
        self.other.add(0, max(seconds, 0.0))

    def observe_plain_forward(self, batch_size: int, seconds: float) -> None:
        """A plain step whose requests each ran one token took `seconds` in all: a forward
        over B rows (`forward`), with measured rates."""
        if self.measure_rates:
            self.forward.add(batch_size, max(seconds - self.other(0), 0.0))
