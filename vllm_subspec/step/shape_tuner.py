"""Auto tree shape and adaptive depth: spend draft passes only where they pay. `ShapeTuner`
picks each step's width and deepest depth (or no draft), which requests draft one more depth,
how many depths each sends to verification and which lm_head drafts, from costs fitted online
(`StepCosts`) and calibrated acceptance (`MassCalibration`, `WidthAcceptance`). It only decides
how much to draft: the target verifies whatever was drafted, so no output can change.

Design: docs/shape_tuner.md.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from vllm_subspec.step.linear_cost import DECAY, LinearCost, RowsCurve
from vllm_subspec.step.lm_head_choice import LmHeadChoice
from vllm_subspec.step.rate_guard import RateGuard
from vllm_subspec.step.tree import TreeShape

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

RECHOOSE_EVERY = 16  # steps between shape choices
EXPLORE_STEPS = 4  # verified trees of each candidate width before the first choice
REEXPLORE_EVERY = 8  # every n-th choice period has one step of the least-recently-run width
FULL_DEPTH_EVERY = 16  # every n-th step drafts past D_max: observations past the usual stop
MAX_PROBE_EVERY = 512  # while plain decoding keeps winning, probe steps back off to this
HEAD_SWITCH_GAIN = 1.02  # another head must be predicted this much faster: no flapping on noise
# rows (requests x width x depth) an exploration step (a width's first trees, a look past the
# usual depth) drafts at most while costs are unmeasured, one depth at least: on a CPU a verify
# costs in proportion to its rows, so exploring at full depth with 32 requests (32 x 6 x 48
# rows) would stall a burst
EXPLORE_ROWS = 24
EXPLORE_COST = 3.0  # ... and, once costs are measured, costs at most this many plain steps


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
            dtype=torch.float64).clamp(max=1.0)
        self.hits = torch.zeros(n, dtype=torch.float64)
        self.belief = torch.zeros(n, dtype=torch.float64)

    def bins(self, mass: torch.Tensor) -> torch.Tensor:
        lg = torch.log10(mass.double().clamp(min=10 ** self.LOG_MIN, max=1.0))
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
        return cls({w: LinearCost() for w in (0, *widths)}, {w: LinearCost() for w in widths},
                   LinearCost())


@dataclasses.dataclass
class StepPlan:
    """This step's drafting budget."""

    shape: TreeShape  # width k and the deepest depth allowed (D_max); depth 0: draft nothing
    adaptive: bool  # may stop before D_max
    full_depth: bool  # an exploration step: drafts to D_max whatever the costs say
    lm_head: str | None = None  # the lm_head to draft with (None: the draft's only one)
    compare_lm_heads: bool = False  # score both lm_heads on this step's accepted paths


class ShapeTuner:
    """Chooses each tree step's width and depth from online measurements (docs/shape_tuner.md).
    Driven by the step session (step/session.py) only: `plan_step` before drafting,
    `drafting_next` during it, `verify_depths` at its end; `observe_draft`, `observe_verify`
    (the target's tree pass), `observe_other` (the rest of a step) and `observe_tree` (what was
    accepted) report what happened. `costs`: the cost model (default: measured online)."""

    def __init__(self, widths: tuple[int, ...], max_depth: int, auto_width: bool,
                 auto_depth: bool, costs: StepCosts | None = None,
                 lm_heads: tuple[str, ...] = ()):
        self.widths = widths
        self.max_depth = max_depth
        self.auto_width, self.auto_depth = auto_width, auto_depth
        # the draft's lm_heads: with two, this tuner picks the one that drafts
        self.lm_heads = LmHeadChoice(lm_heads, widths) if len(lm_heads) > 1 else None
        self._only_lm_head = lm_heads[0] if len(lm_heads) == 1 else None
        self.costs = costs or StepCosts.measured(widths)
        self.calibration = MassCalibration()
        self.acceptance = {w: WidthAcceptance(max_depth) for w in widths}
        self.width = max(widths)
        self.depth = max_depth  # 0: plain decoding is predicted faster than any draft
        self.drafting = (self.width, self.depth)  # the best drafting shape of the last choice
        self.steps = 0
        self.last_run = {w: -1 for w in widths}
        # no draft (depth 0): one probe step drafts, at next_probe; the period doubles at each
        # probe after which plain decoding still wins (back to RECHOOSE_EVERY once drafting is
        # chosen), so a workload where drafting never pays pays for ever fewer probes
        self.probe_every = RECHOOSE_EVERY
        self.next_probe = 0
        # the rates drafting and plain steps reach as they run: where both are measured at a
        # batch size, they decide between drafting and plain decoding instead of the model
        self.guard = RateGuard()
        self.measure_rates = costs is None  # given costs decide alone (`use_costs`)
        # a plain decoding step's forward over B rows (its time less the rest of a step), per
        # batch size: a verify over as many rows costs no less (`verify_cost`). Tree verifies
        # run at few rows on a CPU; this is what a step over many rows costs there
        self.forward = RowsCurve()
        # per width: the most rows its verifies have had (decaying): the line is trusted there
        self._verify_rows = {w: 0.0 for w in widths}
        self._exploring = False  # the last planned step explores (`plan_step`)
        self._explored_shape = False  # (width, depth) were set by an exploration step
        self._trees_at_choice = -1  # verified trees when `_choose` last ran

    def use_costs(self, costs: StepCosts) -> None:
        """Decide with `costs` from now on (e.g. a GPU's projected costs in a CPU benchmark),
        and with them alone: this engine's measured rates no longer overrule them."""
        self.costs = costs
        self.measure_rates = False

    @property
    def lm_head(self) -> str | None:
        """The lm_head that drafts (None: the draft's only one)."""
        return self.lm_heads.current if self.lm_heads is not None else self._only_lm_head

    @property
    def draft_pass(self) -> dict:
        return self.costs.draft_pass

    @property
    def verify(self) -> dict:
        return self.costs.verify

    @property
    def other(self):
        return self.costs.other

    # ---- across steps: the shape ---------------------------------------------------------
    def plan_step(self, batch_size: int) -> StepPlan:
        self._exploring = False  # `_plan_shape` sets it for the exploration steps it plans
        plan = self._plan_shape(batch_size)
        plan.lm_head = self.lm_head
        if plan.shape.depth > 0 and self.lm_heads is not None:
            plan.compare_lm_heads = self.lm_heads.compare_this_step()
        return plan

    def _plan_shape(self, batch_size: int) -> StepPlan:
        self.steps += 1
        plain_step = StepPlan(TreeShape(self.width, 0), False, False)
        if self.auto_depth and self.measure_rates:
            if self.guard.rate(False, batch_size) is None:
                # plain first at each batch size: its rate is what drafting must beat
                return plain_step
            if self.depth != 0 and self.guard.verdict(batch_size) is False:
                self._choose(batch_size)  # measured to lose: plain now, not at the next choice
        if self.auto_width or self.auto_depth:
            unexplored = [w for w in self.widths if self.acceptance[w].steps < EXPLORE_STEPS]
            explore_width = self._explore_width(unexplored, batch_size)
            explore_depth = 0 if not (self.auto_width and unexplored) else \
                self._explore_depth(explore_width, self.max_depth, batch_size) \
                if self.auto_depth else self.max_depth  # a fixed depth is never changed
            if explore_depth and not (self.measure_rates
                                      and self.guard.exploration_loses(batch_size)) \
                    and self._affordable(explore_width, explore_depth, batch_size):
                # widest first (`_explore_width`; capped: `_explore_depth`), while exploring
                # has not clearly lost and the allowance covers it
                self.width, self.depth = explore_width, explore_depth
                self._exploring = self.auto_depth  # (kept apart from the chosen shapes' rate)
                self._explored_shape = True
            elif self.steps % RECHOOSE_EVERY == 1 or \
                    (unexplored and (self._explored_shape or not self.auto_width
                                     and self._trees_seen() != self._trees_at_choice)):
                # (after exploring: a chosen shape again, once; a fixed width's first trees:
                # each new one re-chooses; exploration waiting for its allowance, or a fixed
                # width not drafting, does not re-choose every step)
                self._choose(batch_size)
                self._explored_shape = False
            elif (self.auto_width and self.depth != 0
                  and self.steps % (RECHOOSE_EVERY * REEXPLORE_EVERY) == 0
                  and (stale_depth := self._stale_depth(batch_size))):
                # one step of the least recently run width keeps its statistics current
                stale = min(self.widths, key=lambda w: self.last_run[w])
                self.last_run[stale] = self.steps
                self._exploring = self.auto_depth
                return StepPlan(TreeShape(stale, stale_depth), self.auto_depth, True)
        if self.depth == 0:  # plain decoding is faster: draft only in probe steps
            if self.steps < self.next_probe:
                return plain_step
            width, depth = self.drafting
            if self.measure_rates:  # a probe costs at most EXPLORE_COST plain steps
                depth = self._explore_depth(width, depth, batch_size)
                if depth == 0:
                    return plain_step
                if not self._affordable(width, depth, batch_size):
                    return plain_step  # probed once the allowance covers it
            self.next_probe = self.steps + self.probe_every
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            self.last_run[width] = self.steps
            return StepPlan(TreeShape(width, depth), True, False)
        if self.auto_depth and self.measure_rates and \
                self.guard.wants_plain_probe(batch_size, self.steps):
            return plain_step  # plain's rate, measured
        if not self.auto_depth:
            self.last_run[self.width] = self.steps
            return StepPlan(TreeShape(self.width, self.depth), False, True)
        if self.steps % FULL_DEPTH_EVERY == 0:  # a look past the usual depth, not too costly
            deeper = min(self.max_depth, max(2 * self.depth, self.depth + 4))
            deeper = max(self.depth, self._explore_depth(self.width, deeper, batch_size))
            if self._affordable(self.width, deeper, batch_size):
                self.last_run[self.width] = self.steps
                self._exploring = True
                return StepPlan(TreeShape(self.width, deeper), True, True)
        # a width's first tree goes to full depth (the calibration's first look); after that
        # the adaptive stop runs on what has been measured (full-depth trees are costly on CPU)
        full = self.acceptance[self.width].steps < 1
        depth = self._explore_depth(self.width, self.depth, batch_size) if full else self.depth
        if depth == 0:  # not even one depth is affordable as exploration: a regular step
            full, depth = False, self.depth
        if not full and not (self.draft_pass[self.width].known
                             and self.verify[self.width].known):
            # the adaptive stop weighs costs this width has not measured yet: capped rows
            depth = max(1, min(depth, EXPLORE_ROWS // max(1, batch_size * self.width)))
        if self.measure_rates and not self.guard.verdict(batch_size) \
                and not self._affordable(self.width, depth, batch_size):
            return plain_step  # not measured faster yet, and the allowance is spent
        self.last_run[self.width] = self.steps
        self._exploring = full or self._exploring
        return StepPlan(TreeShape(self.width, depth), True, full)

    def _stale_depth(self, batch_size: int) -> int:
        """The depth of the least recently run width's step: the drafting shape's, capped like
        an exploration step (`_explore_depth`: with measured rates); 0 where it is capped away
        or the allowance does not cover it."""
        stale = min(self.widths, key=lambda w: self.last_run[w])
        depth = self.drafting[1]
        if self.measure_rates and self.auto_depth:
            depth = self._explore_depth(stale, depth, batch_size)
        return depth if depth and self._affordable(stale, depth, batch_size) else 0

    def _explore_width(self, unexplored: list[int], batch_size: int) -> int:
        """The width to explore next: the widest unexplored one; for the first look (no verify
        timed yet, measured rates on), the widest whose depth has at most EXPLORE_ROWS rows
        (else the narrowest): what a row costs is not known yet."""
        if not unexplored:
            return self.width
        if not (self.measure_rates and self.auto_depth) or \
                any(self.verify[w].known for w in self.widths):
            return max(unexplored)
        fitting = [w for w in unexplored if batch_size * w <= EXPLORE_ROWS]
        return max(fitting) if fitting else min(unexplored)

    def _affordable(self, width: int, depth: int, batch_size: int) -> bool:
        """Whether a step of (width, depth) fits this batch size's exploration allowance
        (`RateGuard.allowance`): what it is predicted to lose against plain's measured rate
        (its predicted seconds less the time plain needs for its predicted tokens), and is
        not overdrawn (a predicted gain is not yet a measured one). Before any verify is
        timed (the first look): once the allowance covers EXPLORE_COST plain steps, what an
        exploration step may cost (on a CPU, one depth over 8 requests took ~3.4)."""
        if not self.measure_rates:
            return True
        allowance, plain = self.guard.allowance(batch_size), self.guard.rate(False, batch_size)
        known = [w for w in self.widths if self.verify[w].known]
        if plain is None:
            return allowance >= 0.0
        if not known:
            return allowance >= EXPLORE_COST * batch_size / plain
        rows = batch_size * width
        seconds = self._step_seconds_like(width if width in known else max(known), batch_size,
                                          depth - 1, (depth - 1) * rows, depth * rows)
        tokens = batch_size * (1.0 + sum(self.acceptance[width].reach().tolist()[:depth]))
        # a predicted gain does not license losses beyond the allowance: the prediction is
        # what is not yet measured (a model that says drafting wins is what can be wrong)
        return allowance >= max(0.0, seconds - tokens / plain)

    def _explore_depth(self, width: int, depth: int, batch_size: int) -> int:
        """`depth`, capped so that an exploration or probe step is predicted to take at most
        EXPLORE_COST plain steps (where rows are nearly free, as with offloading, it stays
        deep; 0 where one depth already costs more); while costs are unmeasured, so that it
        drafts at most EXPLORE_ROWS rows."""
        plain = self.guard.rate(False, batch_size) or self.plain_rate(batch_size)
        # a width not yet run is costed like the widest one that has (its rows cost as much)
        known = [w for w in self.widths if self.verify[w].known]
        if not plain or not known:
            # the first look: one depth, what a row costs is unknown (with several widths to
            # explore: their looks that follow, costed, differ in rows, so the fit gets a slope)
            return 1 if self.measure_rates and self.auto_width and self.auto_depth and \
                len(self.widths) > 1 else \
                max(1, min(depth, EXPLORE_ROWS // max(1, batch_size * width)))
        if self.measure_rates and self._step_seconds_like(
                width if width in known else max(known), batch_size, 0, 0,
                batch_size * width) > EXPLORE_COST * batch_size / plain:
            return 0  # one depth alone costs more than the budget: do not explore it now
        like = width if width in known else max(known)
        budget = EXPLORE_COST * batch_size / plain
        rows = batch_size * width
        # the deepest depth within the budget, else 1: a step's seconds grow with its depth
        # (one more pass, more verify rows; every cost is non-decreasing in rows), so a
        # bisection finds it in log2(depth) evaluations (this runs at every plain step while
        # exploration waits for its allowance)
        low, high = 1, max(1, depth)
        while low < high:
            mid = (low + high + 1) // 2
            if self._step_seconds_like(like, batch_size, mid - 1, (mid - 1) * rows,
                                       mid * rows) > budget:
                high = mid - 1
            else:
                low = mid
        return low

    def verify_cost(self, width: int, rows: float) -> float:
        """Seconds of a verify of `rows` rows of width-k trees: its fitted line; past the most
        rows this width's verifies have had (with measured rates), no less than the line
        there plus what plain steps' forwards grow by between the two row counts (`forward`:
        the knee of a CPU's roofline, which a line fitted at few rows misses)."""
        seconds = self.verify[width](rows)
        widest = self._verify_rows[width]
        if not self.measure_rates or rows <= widest or not self.forward.known:
            return seconds
        return max(seconds, self.verify[width](widest) + self.forward(rows)
                   - self.forward(widest))

    def verify_row_cost(self, width: int, rows: float) -> float:
        """Seconds one more verify row costs at `rows` rows (`verify_cost`'s slope, at most)."""
        per_row = self.verify[width].per_row()
        if not self.measure_rates or rows <= self._verify_rows[width]:
            return per_row
        return max(per_row, self.forward.slope(rows))

    def _step_seconds_like(self, like: int, batch_size: int, passes: int, pass_rows: int,
                           nodes: int) -> float:
        """`step_seconds` with width `like`'s costs (for a width not measured yet; passes
        over more rows than the root's cost, where no later pass was timed, like the root's)."""
        pass_cost = self.draft_pass[like] if self.draft_pass[like].known else self.draft_pass[0]
        later = passes * pass_cost(pass_rows / passes) if passes else 0.0
        return self.other(0) + self.draft_pass[0](batch_size) + later \
            + self.verify_cost(like, batch_size + nodes)

    def predicted_rate(self, width: int, depth: int, batch_size: int,
                       reach: list[float], head: str | None = None) -> float:
        """Predicted tokens/s of fixed-shape steps (width, depth) over `batch_size` requests;
        reach: the width's `WidthAcceptance.reach()` as a list (computed once per choice);
        head: the lm_head drafting (None: the current one)."""
        tokens = batch_size * (1.0 + sum(reach[:depth]))
        rows = batch_size * width
        return tokens / self.step_seconds(width, batch_size, depth - 1, (depth - 1) * rows,
                                          depth * rows, head)

    def predicted_rates(self, width: int, depths, batch_size: int, reach: list[float],
                        head: str | None = None) -> list[float]:
        """`predicted_rate` for each depth of `depths` (ascending), each fitted cost evaluated
        once: a step's passes grow linearly with its depth (one more pass over B*k rows), so a
        choice over 32 depths costs microseconds, not a millisecond."""
        rows = batch_size * width
        fixed = self.other(0) + self.draft_pass[0](batch_size)
        per_pass = self.draft_pass[width](rows)
        if head is not None and head != self.lm_head:
            fixed += self.lm_heads.extra_seconds(head, batch_size)
            per_pass += self.lm_heads.extra_seconds(head, rows)
        # the verify's line (every cost in use is linear in rows) and, past its widest
        # verify, `verify_cost`'s floor
        verify, verify_row = self.verify[width](0), self.verify[width].per_row()
        widest = self._verify_rows[width]
        floor = self.forward if self.measure_rates and self.forward.known else None
        anchor = verify + verify_row * widest - (floor(widest) if floor else 0.0)
        rates, tokens, reached = [], float(batch_size), 0
        for depth in depths:
            while reached < depth:
                tokens += batch_size * reach[reached]
                reached += 1
            verify_rows = batch_size + depth * rows
            seconds = verify + verify_row * verify_rows
            if floor is not None and verify_rows > widest:
                seconds = max(seconds, anchor + floor(verify_rows))
            rates.append(tokens / max(fixed + (depth - 1) * per_pass + seconds, 1e-9))
        return rates

    def plain_rate(self, batch_size: int) -> float:
        """Predicted tokens/s of plain decoding steps (no draft): one row per request, timed
        as the narrowest width's verify (a chain's is a plain causal pass), 0 if unmeasured."""
        verify = self.verify[min(self.widths)]
        if not verify.known:
            return 0.0
        return batch_size / max(self.other(0) + verify(batch_size), 1e-9)

    def step_seconds(self, width: int, batch_size: int, passes: int, pass_rows: int,
                     nodes: int, head: str | None = None) -> float:
        """Predicted seconds of a step: the root pass over the B bonus tokens, `passes` later
        passes over `pass_rows` rows in all (the cost is linear in rows, so each costs what a
        pass over their mean does), and the verify of B + `nodes` rows. head: drafting with
        this lm_head instead of the current one (the passes were measured with that)."""
        later = passes * self.draft_pass[width](pass_rows / passes) if passes else 0.0
        if head is not None and head != self.lm_head:
            later += self.lm_heads.extra_seconds(head, batch_size)
            if passes:
                later += passes * self.lm_heads.extra_seconds(head, pass_rows / passes)
        return max(self.other(0) + self.draft_pass[0](batch_size) + later
                   + self.verify_cost(width, batch_size + nodes), 1e-9)

    def _trees_seen(self) -> int:
        return sum(a.steps for a in self.acceptance.values())

    def _choose(self, batch_size: int) -> None:
        self._trees_at_choice = self._trees_seen()
        widths = self.widths if self.auto_width else (self.width,)
        depths = range(1, self.max_depth + 1) if self.auto_depth else (self.depth,)
        best, rate = self._best_shape(batch_size, widths, depths, self.lm_head)
        head = self._choose_head(batch_size, widths, depths, rate)
        if head is not None:
            best, rate = self._best_shape(batch_size, widths, depths, head)
            self._switch_head(head)
        # plain decoding's rate: measured where it has run at this batch size (the model's
        # prediction of a plain step from tree verifies is what can be wrong), else predicted
        measured_plain = self.guard.rate(False, batch_size) if self.measure_rates else None
        plain = measured_plain or self.plain_rate(batch_size)
        self.drafting = best
        # measured rates overrule the model where both kinds of step have run at this batch
        # size (the model predicts a step from fitted pass costs; the guard times whole steps)
        measured = self.guard.verdict(batch_size) if self.measure_rates else None
        plain_wins = plain > rate if measured is None else not measured
        if measured is not None:  # the measured rates, for the log
            plain = self.guard.rate(False, batch_size)
            rate = self.guard.rate(True, batch_size) or 0.0
        if self.auto_depth and plain_wins:
            best = (best[0], 0)
            if self.depth != 0:  # newly plain: the first probe one period from now
                self.probe_every = RECHOOSE_EVERY
                self.next_probe = self.steps + RECHOOSE_EVERY - 1
        if best != (self.width, self.depth):
            if best[1] == 0:
                logger.info("vllm-subspec: no draft: plain decoding predicted faster (%.1f vs "
                            "%.1f tok/s at batch %d); probe steps draft one in %d, backing "
                            "off to one in %d", plain, rate, batch_size, RECHOOSE_EVERY,
                            MAX_PROBE_EVERY)
            elif not any(self.verify[w].known for w in self.widths):
                # no verify timed yet: every cost reads 0, the predicted rate infinite
                logger.info("vllm-subspec: tree shape %dx%d (width x max depth) at batch %d, "
                            "its costs not measured yet", best[0], best[1], batch_size)
            else:
                logger.info("vllm-subspec: tree shape %dx%d (width x max depth), predicted "
                            "%.1f tok/s at batch %d", best[0], best[1], rate, batch_size)
        self.width, self.depth = best

    def _best_shape(self, batch_size: int, widths, depths, head: str | None,
                    doubt: float = 0.0) -> tuple[tuple[int, int], float]:
        """The (width, depth) of the highest predicted rate with `head` drafting, and that
        rate (doubt: `LmHeadComparison.scale`'s, for another head)."""
        reach = {w: self.acceptance[w].reach(
            1.0 if self.lm_heads is None else self.lm_heads.acceptance_scale(head, w, doubt)
        ).tolist() for w in widths}  # once per width
        rates = {(w, d): rate for w in widths
                 for d, rate in zip(depths, self.predicted_rates(w, depths, batch_size,
                                                                 reach[w], head))}
        best = max(rates, key=rates.get)  # the first of equal rates, as before
        return best, rates[best]

    def _choose_head(self, batch_size: int, widths, depths, rate: float) -> str | None:
        """Another lm_head, if it is predicted HEAD_SWITCH_GAIN x faster than the current
        one's best rate `rate` even with its acceptance one standard error lower."""
        if self.lm_heads is None or not self.lm_heads.can_switch():
            return None
        others = {h: self._best_shape(batch_size, widths, depths, h, doubt=1.0)[1]
                  for h in self.lm_heads.others()}
        head = max(others, key=others.get)
        return head if others[head] > HEAD_SWITCH_GAIN * rate else None

    def _switch_head(self, head: str) -> None:
        for w, acceptance in self.acceptance.items():
            acceptance.rescale(self.lm_heads.acceptance_scale(head, w))
        self.lm_heads.switch(head)

    # ---- within a step: the depth --------------------------------------------------------
    def _step_so_far(self, p: torch.Tensor, width: int, reached: list[int]) -> tuple[float, float]:
        """Predicted (tokens, seconds) of a step whose request i has drafted reached[i] depths.
        p: [B, >= max(reached)] P(depth j + 1 accepted), from calibration.predict."""
        b, depths = len(reached), sum(reached)
        drafted = torch.arange(p.shape[1])[None, :] < torch.tensor(reached)[:, None]
        tokens = b + float(p[drafted].sum())  # drafted[i, j]: request i drafted depth j + 1
        # after the root pass, each pass drafts one more depth (k rows) of each request in it
        seconds = self.step_seconds(width, b, max(reached) - 1, width * (depths - b),
                                    width * depths)
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
        verify_row = self.verify_row_cost(width, len(reached) + width * sum(reached))
        row_cost = width * (self.draft_pass[width].per_row() + verify_row)
        going = [i for i in candidates if float(p[i, d]) * seconds > tokens * row_cost]
        gain = float(p[going, d].sum())
        rows = width * len(going)
        cost = self.draft_pass[width](rows) + verify_row * rows
        return going if going and gain * seconds > tokens * cost else []

    def verify_depths(self, log_mass: torch.Tensor, width: int,
                      reached: list[int] | None = None) -> list[int]:
        """How many depths of each request's tree to verify: at most its drafted depth, less
        trailing depths whose verify rows cost more than they are expected to yield at the
        step's rate. log_mass: [B, d + 1] as in drafting_next; reached: each request's drafted
        depth (default: all d)."""
        b, d = log_mass.shape[0], log_mass.shape[1] - 1
        reached = [d] * b if reached is None else reached
        row_cost = self.verify_row_cost(width, b + width * sum(reached)) * width
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

    # ---- measurements --------------------------------------------------------------------
    def observe_draft(self, width: int, batch_size: int, pass_rows: list[int], seconds: float,
                      root_seconds: float | None = None) -> None:
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
        self._verify_rows[width] = max(rows, DECAY * self._verify_rows[width])

    def observe_other(self, seconds: float) -> None:
        self.other.add(0, max(seconds, 0.0))

    def observe_step(self, drafted: bool, batch_size: int, tokens: int, seconds: float,
                     decode_only: bool = True) -> None:
        """A whole engine step as it ran (`RateGuard.add`): drafted or plain, its requests,
        the tokens they emitted, its wall time from one proposal to the next. Called before
        the next step is planned; an exploration step's rate is not counted. A plain step
        whose requests each ran one token (`decode_only`: no prompt chunk in it) is also a
        forward over B rows (`forward`)."""
        self.guard.add(drafted, batch_size, tokens, seconds, exploring=drafted and self._exploring)
        if not drafted and decode_only and self.measure_rates:
            self.forward.add(batch_size, max(seconds - self.other(0), 0.0))

    def observe_tree(self, width: int, level_log_mass: list[float], accepted: int,
                     verified_depth: int) -> None:
        """One request's verified tree: level_log_mass[j] = log frontier mass at depth j."""
        if verified_depth < 1:
            return
        self.acceptance[width].add(accepted, verified_depth)
        j = torch.arange(1, verified_depth + 1)
        mass = torch.tensor(level_log_mass[:verified_depth], dtype=torch.float64).exp()
        self.calibration.add(mass, j <= accepted)

    def describe(self) -> str:
        head = f", {self.lm_head} lm_head" if self.lm_head else ""
        return (f"width {self.width}, max depth {self.depth}{head}, draft pass "
                f"{1e3 * self.draft_pass[self.width](self.width):.1f} ms at k rows, verify "
                f"{1e3 * self.verify[self.width](1):.1f} ms + "
                f"{1e3 * self.verify[self.width].per_row():.2f} ms/row")
