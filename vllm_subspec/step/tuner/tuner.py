"""Auto tree shape and adaptive depth: spend draft passes only where they pay. `ShapeTuner`
picks each step's width and deepest depth (or no draft), which requests draft one more depth,
how many depths each sends to verification and which lm_head drafts. It only decides how much
to draft: the target verifies whatever was drafted, so no output can change.

It composes the package's pieces: the cost model (`costs.CostModel`, fitted online or given),
the acceptance statistics (`acceptance`), the measured rates (`rate_guard.RateGuard`), the plan
across steps (`policy.ShapePolicy`, with `choice` and `exploration`), the depth within a step
(`adaptive_depth`) and the lm_head choice (`lm_head_choice`). Design: docs/shape_tuner.md.
"""

from __future__ import annotations

import torch

from vllm_subspec.step.tree import TreeShape
from vllm_subspec.step.tuner.acceptance import MassCalibration, WidthAcceptance
from vllm_subspec.step.tuner.adaptive_depth import AdaptiveDepth
from vllm_subspec.step.tuner.choice import ShapeChoice
from vllm_subspec.step.tuner.costs import CostModel, StepCosts
from vllm_subspec.step.tuner.exploration import Exploration
from vllm_subspec.step.tuner.lm_head_choice import LmHeadChoice
from vllm_subspec.step.tuner.policy import ShapePolicy, StepPlan
from vllm_subspec.step.tuner.rate_guard import RateGuard
from vllm_subspec.step.tuner.saved_costs import SAVE_EVERY, SavedCosts

# After a step with prompt tokens, drafting may delay the next step (where the requests that
# joined run their prefill) by at most this many plain steps' time.
AFTER_PROMPT_DRAFT_STEPS = 1.0


class ShapeTuner:
    """Chooses each tree step's width and depth from online measurements (docs/shape_tuner.md).
    Driven by the step session (step/session.py) only: `plan_step` before drafting,
    `drafting_next` during it, `verify_depths` at its end; `observe_draft`, `observe_verify`
    (the target's tree pass), `observe_other` (the rest of a step), `observe_step` (a whole
    step) and `observe_tree` (what was accepted) report what happened. `costs`: the cost model
    (default: measured online)."""

    def __init__(
        self,
        widths: tuple[int, ...],
        max_depth: int,
        auto_width: bool,
        auto_depth: bool,
        costs: StepCosts | None = None,
        lm_heads: tuple[str, ...] = (),
    ):
        self.widths = widths
        self.max_depth = max_depth
        self.auto_width, self.auto_depth = auto_width, auto_depth
        # the draft's lm_heads: with two, this tuner picks the one that drafts
        self.lm_heads = LmHeadChoice(lm_heads, widths) if len(lm_heads) > 1 else None
        self._only_lm_head = lm_heads[0] if len(lm_heads) == 1 else None
        # given costs decide alone (`use_costs`)
        self.model = CostModel(
            widths,
            costs or StepCosts.measured(widths),
            measure_rates=costs is None,
            lm_heads=self.lm_heads,
        )
        self.calibration = MassCalibration()
        self.acceptance = {w: WidthAcceptance(max_depth) for w in widths}
        # the rates drafting and plain steps reach as they run: where both are measured at a
        # batch size, they decide between drafting and plain decoding instead of the model
        self.guard = RateGuard()
        self.exploration = Exploration(
            widths, auto_width, auto_depth, self.model, self.guard, self.acceptance
        )
        self.choice = ShapeChoice(self.model, self.guard, self.acceptance, self.lm_heads)
        self.policy = ShapePolicy(
            widths,
            max_depth,
            auto_width,
            auto_depth,
            self.model,
            self.guard,
            self.acceptance,
            self.exploration,
            self.choice,
        )
        self.adaptive_depth = AdaptiveDepth(self.calibration, self.model, auto_depth)
        self.saved: SavedCosts | None = None  # where its costs are kept across restarts

    def keep_costs(self, saved: SavedCosts) -> bool:
        """Keep what this tuner learns in `saved` (every SAVE_EVERY planned steps), starting
        from what it holds; True if it held this engine's costs."""
        self.saved = saved
        return saved.load_into(self)

    def use_costs(self, costs: StepCosts) -> None:
        """Decide with `costs` from now on (e.g. a GPU's projected costs in a CPU benchmark),
        and with them alone: this engine's measured rates no longer overrule them."""
        self.model.costs = costs
        self.model.measure_rates = False

    @property
    def width(self) -> int:
        """The chosen width (a step may draft another: `plan_step`)."""
        return self.policy.width

    @property
    def depth(self) -> int:
        """The chosen deepest depth (0: no draft)."""
        return self.policy.depth

    @property
    def lm_head(self) -> str | None:
        """The lm_head that drafts (None: the draft's only one)."""
        return self.lm_heads.current if self.lm_heads is not None else self._only_lm_head

    @property
    def draft_pass(self) -> dict:
        return self.model.draft_pass

    @property
    def verify(self) -> dict:
        return self.model.verify

    @property
    def other(self):
        return self.model.other

    # ---- the plan, across steps, and the depth within a step -----------------------------
    def plan_step(self, batch_size: int, after_prompt: bool = False) -> StepPlan:
        """This step's plan (`ShapePolicy.plan`). after_prompt: the step just run had prompt
        tokens, so more requests may be about to join: its drafting is capped to what the
        cost model predicts within AFTER_PROMPT_DRAFT_STEPS plain steps (`after_prompt_depth`;
        with offloading, where a pass is a small part of a step, that leaves it deep)."""
        plan = self.policy.plan(batch_size)
        if self.saved is not None and self.policy.steps % SAVE_EVERY == 0:
            self.saved.save(self)
        if after_prompt and plan.shape.depth > 0:
            depth = min(plan.shape.depth, self.after_prompt_depth(plan.shape.width, batch_size))
            plan.shape = TreeShape(plan.shape.width, depth)
        plan.lm_head = self.lm_head
        if plan.shape.depth > 0 and self.lm_heads is not None:
            plan.compare_lm_heads = self.lm_heads.compare_this_step()
        return plan

    def after_prompt_depth(self, width: int, batch_size: int) -> int:
        """The deepest tree whose drafting (the root pass and the passes after it) is predicted
        to take at most AFTER_PROMPT_DRAFT_STEPS plain steps of `batch_size` requests; 0 where
        neither is priced yet (given costs: unbounded)."""
        if not self.model.measure_rates:
            return self.max_depth
        plain = self.guard.rate(False, batch_size) or self.model.plain_rate(batch_size)
        root, later = self.model.pass_cost(0), self.model.pass_cost(width)
        if not plain or not root.known:
            return 0
        budget = AFTER_PROMPT_DRAFT_STEPS * batch_size / plain - root(batch_size)
        per_pass = later(batch_size * width)
        if budget < 0:
            return 0
        if per_pass <= 0:
            return self.max_depth
        return min(self.max_depth, 1 + int(budget / per_pass))

    def drafting_next(self, log_mass: torch.Tensor, width: int, reached: list[int]) -> list[int]:
        """`AdaptiveDepth.drafting_next`: the requests that draft one more depth."""
        return self.adaptive_depth.drafting_next(log_mass, width, reached)

    def verify_depths(
        self, log_mass: torch.Tensor, width: int, reached: list[int] | None = None
    ) -> list[int]:
        """`AdaptiveDepth.verify_depths`: how many depths of each tree to verify."""
        return self.adaptive_depth.verify_depths(log_mass, width, reached)

    # ---- measurements --------------------------------------------------------------------
    def observe_draft(
        self,
        width: int,
        batch_size: int,
        pass_rows: list[int],
        seconds: float,
        root_seconds: float | None = None,
    ) -> None:
        """`CostModel.observe_draft`: a step's drafting time."""
        self.model.observe_draft(width, batch_size, pass_rows, seconds, root_seconds)

    def observe_verify(self, width: int, rows: int, seconds: float) -> None:
        self.model.observe_verify(width, rows, seconds)

    def observe_other(self, seconds: float) -> None:
        self.model.observe_other(seconds)

    def observe_step(
        self, drafted: bool, batch_size: int, tokens: int, seconds: float, decode_only: bool = True
    ) -> None:
        """A whole engine step as it ran (`RateGuard.add`): drafted or plain, its requests,
        the tokens they emitted, its wall time from one proposal to the next. Called before
        the next step is planned; an exploration step's rate is not counted. A plain step
        whose requests each ran one token (`decode_only`: no prompt chunk in it) is also a
        forward over B rows (`CostModel.forward`)."""
        self.guard.add(
            drafted, batch_size, tokens, seconds, exploring=drafted and self.policy.exploring
        )
        if not drafted and decode_only:
            self.model.observe_plain_forward(batch_size, seconds)

    def observe_tree(
        self, width: int, level_log_mass: list[float], accepted: int, verified_depth: int
    ) -> None:
        """One request's verified tree: level_log_mass[j] = log frontier mass at depth j."""
        if verified_depth < 1:
            return
        self.acceptance[width].add(accepted, verified_depth)
        j = torch.arange(1, verified_depth + 1)
        mass = torch.tensor(level_log_mass[:verified_depth], dtype=torch.float64).exp()
        self.calibration.add(mass, j <= accepted)

    def describe(self) -> str:
        head = f", {self.lm_head} lm_head" if self.lm_head else ""
        return (
            f"width {self.width}, max depth {self.depth}{head}, draft pass "
            f"{1e3 * self.draft_pass[self.width](self.width):.1f} ms at k rows, verify "
            f"{1e3 * self.verify[self.width](1):.1f} ms + "
            f"{1e3 * self.verify[self.width].per_row():.2f} ms/row"
        )
