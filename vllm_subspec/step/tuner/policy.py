"""The shape tuner's plan for each step (`ShapePolicy.plan`): its width and deepest depth, or no
draft, as the first rule that applies of a short list (plain first, exploring each width,
re-choosing, the stale width's step, probes, plain probes, looks past the usual depth, the
chosen shape), and the choice it re-makes every few steps (`ShapePolicy.choose`).

Design: docs/shape_tuner.md, "Choosing the shape, across steps" and "Measured rates".
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_subspec.step.tree import TreeShape
from vllm_subspec.step.tuner.acceptance import WidthAcceptance
from vllm_subspec.step.tuner.choice import ShapeChoice
from vllm_subspec.step.tuner.costs import CostModel
from vllm_subspec.step.tuner.exploration import EXPLORE_ROWS, Exploration
from vllm_subspec.step.tuner.rate_guard import RateGuard

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

RECHOOSE_EVERY = 16  # steps between shape choices
EXPLORE_STEPS = 4  # verified trees of each candidate width before the first choice
REEXPLORE_EVERY = 8  # every n-th choice period has one step of the least-recently-run width
FULL_DEPTH_EVERY = 16  # every n-th step drafts past D_max: observations past the usual stop
MAX_PROBE_EVERY = 512  # while plain decoding keeps winning, probe steps back off to this


@dataclasses.dataclass
class StepPlan:
    """This step's drafting budget."""

    shape: TreeShape  # width k and the deepest depth allowed (D_max); depth 0: draft nothing
    adaptive: bool  # may stop before D_max
    full_depth: bool  # an exploration step: drafts to D_max whatever the costs say
    lm_head: str | None = None  # the lm_head to draft with (None: the draft's only one)
    compare_lm_heads: bool = False  # score both lm_heads on this step's accepted paths


class ShapePolicy:
    """The shape across steps: the chosen (width, depth) (depth 0: no draft), the best drafting
    shape of the last choice, and the schedules of exploration and probe steps."""

    def __init__(
        self,
        widths: tuple[int, ...],
        max_depth: int,
        auto_width: bool,
        auto_depth: bool,
        model: CostModel,
        guard: RateGuard,
        acceptance: dict[int, WidthAcceptance],
        exploration: Exploration,
        choice: ShapeChoice,
    ):
        self.widths, self.max_depth = widths, max_depth
        self.auto_width, self.auto_depth = auto_width, auto_depth
        self.model, self.guard, self.acceptance = model, guard, acceptance
        self.exploration, self.choice = exploration, choice
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
        self.exploring = False  # the last planned step explores (kept apart in the rates)
        self._explored_shape = False  # (width, depth) were set by an exploration step
        self._trees_at_choice = -1  # verified trees when `choose` last ran

    # ---- the plan: the first rule that applies -------------------------------------------
    def plan(self, batch_size: int) -> StepPlan:
        """This step's shape (its lm_head is the tuner's to set)."""
        self.steps += 1
        self.exploring = False  # set for the exploration steps planned below
        plain = StepPlan(TreeShape(self.width, 0), False, False)  # (the width before a choice)
        if self._plain_unmeasured(batch_size):
            return plain  # plain first at each batch size: its rate is what drafting must beat
        self._rechoose_if_measured_slower(batch_size)
        if self.auto_width or self.auto_depth:
            stale = self._next_shape(batch_size)
            if stale is not None:
                return stale
        if self.depth == 0:  # plain decoding is faster: draft only in probe steps
            return self._probe_step(batch_size) or plain
        if self._plain_probe(batch_size):
            return plain  # plain's rate, measured
        if not self.auto_depth:
            return self._fixed_depth_step()
        return self._deeper_look(batch_size) or self._chosen_shape_step(batch_size) or plain

    def _plain_unmeasured(self, batch_size: int) -> bool:
        """Plain first at a batch size until its plain rate is measured; not where the cost
        model prices steps (`CostModel.priced`) and plain has been measured at another batch
        size: costs are per row, so a new batch size drafts from its first step."""
        return (
            self.auto_depth
            and self.model.measure_rates
            and self.guard.rate(False, batch_size) is None
            and not (self.model.priced and self.guard.plain_measured())
        )

    def _rechoose_if_measured_slower(self, batch_size: int) -> None:
        """Drafting measured to lose: plain now, not at the next choice."""
        if (
            self.auto_depth
            and self.model.measure_rates
            and self.depth != 0
            and self.guard.verdict(batch_size) is False
        ):
            self.choose(batch_size)

    def _next_shape(self, batch_size: int) -> StepPlan | None:
        """Across choices: the next width to explore or a new choice, either of which sets the
        shape this step drafts (None returned), or one step of the least recently run width."""
        unexplored = [w for w in self.widths if self.acceptance[w].steps < EXPLORE_STEPS]
        if self._explore(unexplored, batch_size):
            return None
        if self._choice_due(unexplored):
            self.choose(batch_size)
            self._explored_shape = False
            return None
        return self._stale_width_step(batch_size)

    def _explore(self, unexplored: list[int], batch_size: int) -> bool:
        """Widest first (`Exploration.width`; capped: `Exploration.depth`), while exploring
        has not clearly lost and the allowance covers it: sets the shape."""
        if not (self.auto_width and unexplored):
            return False
        width = self.exploration.width(unexplored, self.width, batch_size)
        depth = (
            self.exploration.depth(width, self.max_depth, batch_size)
            if self.auto_depth
            else self.max_depth
        )  # a fixed depth is never changed
        if not depth or self.model.measure_rates and self.guard.exploration_loses(batch_size):
            return False
        depth = self.exploration.affordable_depth(width, depth, batch_size)
        if not depth:
            return False
        self.width, self.depth = width, depth
        self.exploring = self.auto_depth  # (kept apart from the chosen shapes' rate)
        self._explored_shape = True
        return True

    def _choice_due(self, unexplored: list[int]) -> bool:
        """Every RECHOOSE_EVERY steps; after exploring, a chosen shape again, once; a fixed
        width's first trees: each new one re-chooses (exploration waiting for its allowance,
        or a fixed width not drafting, does not re-choose every step)."""
        return (
            self.steps % RECHOOSE_EVERY == 1
            or bool(unexplored)
            and (
                self._explored_shape
                or not self.auto_width
                and self._trees_seen() != self._trees_at_choice
            )
        )

    def _stale_width_step(self, batch_size: int) -> StepPlan | None:
        """One step of the least recently run width keeps its statistics current."""
        if not (
            self.auto_width
            and self.depth != 0
            and self.steps % (RECHOOSE_EVERY * REEXPLORE_EVERY) == 0
        ):
            return None
        depth = self._stale_depth(batch_size)
        if not depth:
            return None
        stale = min(self.widths, key=lambda w: self.last_run[w])
        self.last_run[stale] = self.steps
        self.exploring = self.auto_depth
        return StepPlan(TreeShape(stale, depth), self.auto_depth, True)

    def _stale_depth(self, batch_size: int) -> int:
        """The depth of the least recently run width's step: the drafting shape's, capped like
        an exploration step (`Exploration.depth`: with measured rates); 0 where it is capped
        away or the allowance does not cover it."""
        stale = min(self.widths, key=lambda w: self.last_run[w])
        depth = self.drafting[1]
        if self.model.measure_rates and self.auto_depth:
            depth = self.exploration.depth(stale, depth, batch_size)
        return depth if depth and self.exploration.affordable(stale, depth, batch_size) else 0

    def _probe_step(self, batch_size: int) -> StepPlan | None:
        """No draft chosen: the last drafting shape, once the probe period is up (with
        measured rates capped, `Exploration.depth`, and once the allowance covers it); None:
        a plain step."""
        if self.steps < self.next_probe:
            return None
        width, depth = self.drafting
        if self.model.measure_rates:  # a probe costs at most EXPLORE_COST plain steps
            depth = self.exploration.depth(width, depth, batch_size)
            if depth == 0 or not self.exploration.affordable(width, depth, batch_size):
                return None  # probed once the allowance covers it
        self.next_probe = self.steps + self.probe_every
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self.last_run[width] = self.steps
        return StepPlan(TreeShape(width, depth), True, False)

    def _plain_probe(self, batch_size: int) -> bool:
        return (
            self.auto_depth
            and self.model.measure_rates
            and self.guard.wants_plain_probe(batch_size, self.steps)
        )

    def _fixed_depth_step(self) -> StepPlan:
        self.last_run[self.width] = self.steps
        return StepPlan(TreeShape(self.width, self.depth), False, True)

    def _deeper_look(self, batch_size: int) -> StepPlan | None:
        """Every FULL_DEPTH_EVERY steps, a look past the usual depth, if not too costly."""
        if self.steps % FULL_DEPTH_EVERY != 0:
            return None
        deeper = min(self.max_depth, max(2 * self.depth, self.depth + 4))
        deeper = max(self.depth, self.exploration.depth(self.width, deeper, batch_size))
        if not self.exploration.affordable(self.width, deeper, batch_size):
            return None
        self.last_run[self.width] = self.steps
        self.exploring = True
        return StepPlan(TreeShape(self.width, deeper), True, True)

    def _chosen_shape_step(self, batch_size: int) -> StepPlan | None:
        """The chosen shape, adaptive; None (a plain step) where it is not measured faster yet
        and the allowance is spent."""
        width = self.width
        # a width's first tree goes to full depth (the calibration's first look); after that
        # the adaptive stop runs on what has been measured (full-depth trees are costly on CPU)
        full = self.acceptance[width].steps < 1
        depth = self.exploration.depth(width, self.depth, batch_size) if full else self.depth
        if depth == 0:  # not even one depth is affordable as exploration: a regular step
            full, depth = False, self.depth
        if not full and not (self.model.draft_pass[width].known and self.model.verify[width].known):
            # the adaptive stop weighs costs this width has not measured yet: capped rows
            depth = max(1, min(depth, EXPLORE_ROWS // max(1, batch_size * width)))
        if self.model.measure_rates and not self.guard.verdict(batch_size):
            # (priced: a shallower tree may be affordable where this one is not)
            depth = self.exploration.affordable_depth(width, depth, batch_size)
            if not depth:
                return None
        self.last_run[width] = self.steps
        self.exploring = full or self.exploring
        return StepPlan(TreeShape(width, depth), True, full)

    # ---- the choice ----------------------------------------------------------------------
    def _trees_seen(self) -> int:
        return sum(a.steps for a in self.acceptance.values())

    def choose(self, batch_size: int) -> None:
        """The shape (and lm_head) of the highest predicted rate, or, with an auto depth, no
        draft where plain decoding is faster (`ShapeChoice`); logged when it changes."""
        self._trees_at_choice = self._trees_seen()
        widths = self.widths if self.auto_width else (self.width,)
        depths = range(1, self.max_depth + 1) if self.auto_depth else (self.depth,)
        best, rate = self.choice.best_drafting(batch_size, widths, depths)
        self.drafting = best
        plain, rate, plain_wins = self.choice.against_plain(batch_size, rate)
        if self.auto_depth and plain_wins:
            best = (best[0], 0)
            if self.depth != 0:  # newly plain: the first probe one period from now
                self.probe_every = RECHOOSE_EVERY
                self.next_probe = self.steps + RECHOOSE_EVERY - 1
        if best != (self.width, self.depth):
            self._log_choice(best, plain, rate, batch_size)
        self.width, self.depth = best

    def _log_choice(
        self, best: tuple[int, int], plain: float, rate: float, batch_size: int
    ) -> None:
        if best[1] == 0:
            logger.info(
                "vllm-subspec: no draft: plain decoding predicted faster (%.1f vs "
                "%.1f tok/s at batch %d); probe steps draft one in %d, backing "
                "off to one in %d",
                plain,
                rate,
                batch_size,
                RECHOOSE_EVERY,
                MAX_PROBE_EVERY,
            )
        elif not self.model.known_widths():
            # no verify timed yet: every cost reads 0, the predicted rate infinite
            logger.info(
                "vllm-subspec: tree shape %dx%d (width x max depth) at batch %d, "
                "its costs not measured yet",
                best[0],
                best[1],
                batch_size,
            )
        else:
            logger.info(
                "vllm-subspec: tree shape %dx%d (width x max depth), predicted "
                "%.1f tok/s at batch %d",
                best[0],
                best[1],
                rate,
                batch_size,
            )
