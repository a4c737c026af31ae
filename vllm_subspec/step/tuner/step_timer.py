"""The step session's clock of whole steps (`StepTimer`): each step's wall time from one proposal
to the next (`StepStats.step_seconds`) and, for an auto shape's tuner, the step's measured rate
(`ShapeTuner.observe_step`), the verify's time and the rest of a step (`observe_verify`,
`observe_other`). The session calls it in run order: `proposed` at each proposal's end,
`emitted` and `verified` at the walk, `close_step` at the next plan.

Design: docs/shape_tuner.md, "Measured rates".
"""

from __future__ import annotations

from vllm_subspec.step.tuner.tuner import ShapeTuner

# A gap this long between two proposals is the engine waiting for requests, not a step.
IDLE_GAP_SECONDS = 5.0


class StepTimer:
    """tuner: an auto shape's, fed from here (None: a fixed shape, the step time only)."""

    def __init__(self, tuner: ShapeTuner | None):
        self.tuner = tuner
        # the step in progress, for the tuner's measured rates: (its proposal's start, drafted,
        # its requests) and the tokens its verify emitted (None: no tree verified in it)
        self.step: tuple[float, bool, frozenset] | None = None
        self.step_tokens: int | None = None
        self._verify_seconds: float | None = None  # the last tree verify's, for the tuner
        self._last_draft_end: float | None = None

    def proposed(
        self,
        start: float,
        end: float,
        drafted: bool,
        req_ids: list[str],
        step_start: float | None = None,
    ) -> float:
        """A proposal drafted (or planned plain) from `start` to `end`; step_start: the
        step's own start, for its measured rate (the plan's time: vLLM's draft inputs between
        the two are the step's too; None: `start`). Returns the step's seconds."""
        seconds = self._rest_of_step(start, end)
        self.step = (start if step_start is None else step_start, drafted, frozenset(req_ids))
        return seconds

    def _rest_of_step(self, start: float, end: float) -> float:
        """The tuner's "rest of a step": from the end of the last draft to this one's start,
        less the verify in between (not across an idle engine: the gap must be a step's, not
        a pause's). Returns the step's seconds: from the last draft's end, or after an idle
        gap (or for the first) from this drafting's own start."""
        verify, self._verify_seconds = self._verify_seconds, None
        idle = self._last_draft_end is None or start - self._last_draft_end >= IDLE_GAP_SECONDS
        seconds = end - (start if idle else self._last_draft_end)
        if self.tuner is not None and self._last_draft_end is not None and verify:
            other = start - self._last_draft_end - verify
            if other < 4 * (verify + end - start):
                self.tuner.observe_other(other)
        self._last_draft_end = end
        return seconds

    def emitted(self, tokens: int) -> None:
        """The step's walk emitted `tokens` (every request's accepted path and bonus)."""
        self.step_tokens = tokens

    def verified(self, width: int, rows: int, seconds: float) -> None:
        """The step's tree verify, all of width `width`, over `rows` rows took `seconds`."""
        if self.tuner is not None:
            self._verify_seconds = seconds
            self.tuner.observe_verify(width, rows, seconds)

    def close_step(self, now: float, req_ids: list[str], decode_only: bool) -> None:
        """The last step ran from its proposal to this one (`req_ids`'): its tokens and wall
        time go to the tuner's measured rates. A plain step emitted one token per request; a
        drafting step what its verify emitted. Not counted: a step across an idle engine, and
        one in which requests joined (their prefill ran in it: its time is not the decode's).
        decode_only: each of its requests ran one token (no prompt chunk)."""
        step, tokens, self.step, self.step_tokens = self.step, self.step_tokens, None, None
        if self.tuner is None or step is None or now - step[0] >= IDLE_GAP_SECONDS:
            return
        started, drafted, requests = step
        if not requests.issuperset(req_ids):
            return
        self.tuner.observe_step(
            drafted,
            len(requests),
            tokens if drafted and tokens else len(requests),
            now - started,
            decode_only=decode_only,
        )
