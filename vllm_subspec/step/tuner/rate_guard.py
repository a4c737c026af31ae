"""Never slower than plain: the tokens/s that drafting steps and plain steps actually reach on
this engine, per batch size, measured as they run. The shape tuner's cost model predicts rates
from fitted pass costs; this is the measurement it answers to (`ShapeChoice.against_plain`:
where both are measured, they decide between drafting and plain decoding).

Design: docs/shape_tuner.md, "Measured rates".
"""

from __future__ import annotations

RATE_DECAY = 0.9  # per observation of a (kind of step, batch bucket): the last ~10 steps
# observations before a rate counts (plain, drafting): drafting's must outlast the tuner's
# first calibration, so a rate from shapes chosen on too little evidence does not decide
MIN_STEPS = {False: 2, True: 8}
# ... but drafting measured this far below plain over this many steps already loses
CLEAR_LOSS, CLEAR_LOSS_STEPS = 0.7, 3
PLAIN_PROBE_EVERY = 32  # while drafting, one plain step in this many keeps plain's rate current
# ... one in this many where drafting measures this many times plain's rate (with offloading a
# plain step costs about a whole drafting step: each probe gives up most of a step's tokens)
PLAIN_PROBE_EVERY_FAR, FAR_AHEAD = 512, 1.5
# drafting not yet measured faster than plain (exploration, probes, shapes the model chose)
# may cost at most this share of a batch size's decoding time: what it loses against plain's
# measured rate is spent from an allowance that grows with every step's time (`allowance`)
EXPLORE_BUDGET = 0.02
# ... and the allowance saves up at most this many plain steps' time, so a long plain stretch
# is not spent at once: a run of n steps loses at most about this + EXPLORE_BUDGET * n steps
ALLOWANCE_CAP_STEPS = 4.0  # (above exploration.EXPLORE_COST: a capped step stays affordable)


def batch_bucket(batch_size: int) -> int:
    """Batch sizes compared together: 1, 2, 4, 8, ... (each the power of two at or above)."""
    return 1 << max(0, batch_size - 1).bit_length()


class RateGuard:
    """Decayed tokens / seconds of whole engine steps (drafting, verifying and the rest), kept
    apart for drafting steps and plain steps and per `batch_bucket`."""

    def __init__(self, decay: float = RATE_DECAY):
        self.decay = decay
        # (drafted, or "explore"; batch bucket) -> decayed sums
        self.tokens: dict[tuple[bool | str, int], float] = {}
        self.seconds: dict[tuple[bool | str, int], float] = {}
        self.steps: dict[tuple[bool | str, int], float] = {}
        # per batch bucket: every step's seconds, and the seconds drafting steps took beyond
        # what plain's measured rate needs for their tokens (negative: gained), undecayed (for
        # diagnostics: the allowance is `balance`)
        self.elapsed: dict[int, float] = {}
        self.lost: dict[int, float] = {}
        self.balance: dict[int, float] = {}  # the allowance (`allowance`)

    def add(
        self, drafted: bool, batch_size: int, tokens: int, seconds: float, exploring: bool = False
    ) -> None:
        """One step: `tokens` emitted for `batch_size` requests in `seconds` of wall time
        (exploring: an exploration step, kept apart from the chosen shapes' drafting)."""
        if seconds <= 0 or batch_size <= 0:
            return
        bucket = batch_bucket(batch_size)
        self.elapsed[bucket] = self.elapsed.get(bucket, 0.0) + seconds
        plain = self.rate(False, batch_size)
        lost = seconds - tokens / plain if drafted and plain else 0.0
        self.lost[bucket] = self.lost.get(bucket, 0.0) + lost
        key: tuple[bool | str, int] = ("explore" if exploring else drafted, bucket)
        d = self.decay
        self.tokens[key] = d * self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = d * self.seconds.get(key, 0.0) + seconds
        self.steps[key] = self.steps.get(key, 0.0) + 1.0
        balance = self.balance.get(bucket, 0.0) + EXPLORE_BUDGET * seconds - lost
        plain = self.rate(False, batch_size)  # (with this step: the cap follows plain's rate)
        if plain:
            balance = min(balance, ALLOWANCE_CAP_STEPS * batch_size / plain)
        self.balance[bucket] = balance

    def rate(self, drafted: bool, batch_size: int) -> float | None:
        """Measured tokens/s of that kind of step at this batch size; None until measured."""
        key = (drafted, batch_bucket(batch_size))
        if self.steps.get(key, 0.0) < MIN_STEPS[drafted]:
            return None
        return self.tokens[key] / self.seconds[key]

    def plain_measured(self) -> bool:
        """Whether plain's rate is measured at some batch size."""
        return any(n >= MIN_STEPS[False] for (kind, _), n in self.steps.items() if kind is False)

    def allowance(self, batch_size: int) -> float:
        """Seconds that drafting not yet measured faster may still lose at this batch size:
        EXPLORE_BUDGET of the time its steps have run, less what drafting steps lost against
        plain's measured rate (plus what they gained), saved up to ALLOWANCE_CAP_STEPS plain
        steps' time."""
        return self.balance.get(batch_bucket(batch_size), 0.0)

    def verdict(self, batch_size: int) -> bool | None:
        """True: drafting measured faster than plain at this batch size; False: slower; None:
        one of the two not measured yet."""
        draft, plain = self.rate(True, batch_size), self.rate(False, batch_size)
        if plain is None:
            return None
        if draft is None:  # a clear loss need not wait for MIN_STEPS
            key = (True, batch_bucket(batch_size))
            if (
                self.steps.get(key, 0.0) >= CLEAR_LOSS_STEPS
                and self.tokens[key] / self.seconds[key] < CLEAR_LOSS * plain
            ):
                return False
            return None
        return draft > plain

    def exploration_loses(self, batch_size: int) -> bool:
        """Whether the exploration steps so far at this batch size emitted under CLEAR_LOSS
        x plain's rate (over CLEAR_LOSS_STEPS of them at least): exploring more widths would
        only cost more."""
        plain = self.rate(False, batch_size)
        key: tuple[bool | str, int] = ("explore", batch_bucket(batch_size))
        return (
            plain is not None
            and self.steps.get(key, 0.0) >= CLEAR_LOSS_STEPS
            and self.tokens[key] / self.seconds[key] < CLEAR_LOSS * plain
        )

    def wants_plain_probe(self, batch_size: int, step: int) -> bool:
        """Whether this drafting step should run plain instead, to keep plain's rate current:
        one step in PLAIN_PROBE_EVERY, in PLAIN_PROBE_EVERY_FAR where drafting is measured
        FAR_AHEAD of plain."""
        draft, plain = self.rate(True, batch_size), self.rate(False, batch_size)
        far = draft is not None and plain is not None and draft > FAR_AHEAD * plain
        every = PLAIN_PROBE_EVERY_FAR if far else PLAIN_PROBE_EVERY
        return step % every == every // 2
