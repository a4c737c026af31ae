"""The shape tuner's choice between shapes: the (width, depth) and lm_head of the highest
predicted rate (`ShapeChoice.best_drafting`, switching heads when the other one is predicted
faster by a margin), and how it compares with plain decoding (`ShapeChoice.against_plain`).
It holds no state across steps: `ShapePolicy.choose` applies what it finds.

Design: docs/shape_tuner.md, "Choosing the shape, across steps" and "The draft's lm_head".
"""

from __future__ import annotations

from vllm_subspec.step.tuner.acceptance import WidthAcceptance
from vllm_subspec.step.tuner.costs import CostModel
from vllm_subspec.step.tuner.lm_head_choice import LmHeadChoice
from vllm_subspec.step.tuner.rate_guard import RateGuard

HEAD_SWITCH_GAIN = 1.02  # another head must be predicted this much faster: no flapping on noise


class ShapeChoice:
    """Predicted rates of every candidate shape, from the cost model and each width's
    acceptance (scaled for the other lm_head, if the draft has two), and the measured rates
    (`guard`) they answer to."""

    def __init__(
        self,
        model: CostModel,
        guard: RateGuard,
        acceptance: dict[int, WidthAcceptance],
        lm_heads: LmHeadChoice | None,
    ):
        self.model, self.guard, self.acceptance, self.lm_heads = model, guard, acceptance, lm_heads

    def best_drafting(self, batch_size: int, widths, depths) -> tuple[tuple[int, int], float]:
        """The (width, depth) of the highest predicted rate and that rate, with the lm_head
        predicted fastest (switched to here, if it is another one)."""
        current = self.lm_heads.current if self.lm_heads is not None else None
        best, rate = self.best_shape(batch_size, widths, depths, current)
        head = self._choose_head(batch_size, widths, depths, rate)
        if head is not None:
            best, rate = self.best_shape(batch_size, widths, depths, head)
            self._switch_head(head)
        return best, rate

    def best_shape(
        self, batch_size: int, widths, depths, head: str | None, doubt: float = 0.0
    ) -> tuple[tuple[int, int], float]:
        """The (width, depth) of the highest predicted rate with `head` drafting, and that
        rate (doubt: `LmHeadComparison.scale`'s, for another head)."""
        reach = {
            w: self.acceptance[w]
            .reach(1.0 if self.lm_heads is None else self.lm_heads.acceptance_scale(head, w, doubt))
            .tolist()
            for w in widths
        }  # once per width
        rates = {
            (w, d): rate
            for w in widths
            for d, rate in zip(
                depths, self.model.predicted_rates(w, depths, batch_size, reach[w], head)
            )
        }
        best = max(rates, key=rates.get)  # the first of equal rates, as before
        return best, rates[best]

    def _choose_head(self, batch_size: int, widths, depths, rate: float) -> str | None:
        """Another lm_head, if it is predicted HEAD_SWITCH_GAIN x faster than the current
        one's best rate `rate` even with its acceptance one standard error lower."""
        if self.lm_heads is None or not self.lm_heads.can_switch():
            return None
        others = {
            h: self.best_shape(batch_size, widths, depths, h, doubt=1.0)[1]
            for h in self.lm_heads.others()
        }
        head = max(others, key=others.get)
        return head if others[head] > HEAD_SWITCH_GAIN * rate else None

    def _switch_head(self, head: str) -> None:
        for w, acceptance in self.acceptance.items():
            acceptance.rescale(self.lm_heads.acceptance_scale(head, w))
        self.lm_heads.switch(head)

    def against_plain(self, batch_size: int, rate: float) -> tuple[float, float, bool]:
        """(plain decoding's rate, drafting's, whether plain wins) against drafting's
        predicted `rate`. Plain's rate is measured where it has run at this batch size (the
        model's prediction of a plain step from tree verifies is what can be wrong), else
        predicted; where both kinds of step have run at this batch size, the measured rates
        decide, and are the ones returned, for the log (the model predicts a step from
        fitted pass costs; the guard times whole steps)."""
        measure = self.model.measure_rates
        measured_plain = self.guard.rate(False, batch_size) if measure else None
        plain = measured_plain or self.model.plain_rate(batch_size)
        measured = self.guard.verdict(batch_size) if measure else None
        if measured is None:
            return plain, rate, plain > rate
        return (
            self.guard.rate(False, batch_size),
            self.guard.rate(True, batch_size) or 0.0,
            not measured,
        )
