"""The measured rates the shape tuner answers to (step/tuner/rate_guard.py), on synthetic steps."""

import pytest

from vllm_subspec.step.tuner.rate_guard import (
    ALLOWANCE_CAP_STEPS,
    EXPLORE_BUDGET,
    FAR_AHEAD,
    MIN_STEPS,
    PLAIN_PROBE_EVERY,
    PLAIN_PROBE_EVERY_FAR,
    RateGuard,
    batch_bucket,
)


def test_batch_sizes_are_compared_by_power_of_two_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == \
        [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_a_rate_counts_only_after_enough_steps_and_follows_the_recent_ones():
    guard = RateGuard()
    for _ in range(MIN_STEPS[True] - 1):
        guard.add(True, 1, 5, 0.5)  # 10 tok/s
    assert guard.rate(True, 1) is None
    guard.add(True, 1, 5, 0.5)
    assert guard.rate(True, 1) == pytest.approx(10.0)
    assert guard.rate(True, 8) is None and guard.rate(False, 1) is None  # kept apart
    for _ in range(60):  # the workload changes: 20 tok/s
        guard.add(True, 1, 10, 0.5)
    assert guard.rate(True, 1) == pytest.approx(20.0, rel=0.01)


def test_the_verdict_needs_both_rates_and_says_which_is_faster():
    guard = RateGuard()
    for _ in range(MIN_STEPS[True]):
        guard.add(True, 4, 12, 1.0)  # drafting: 12 tok/s
    assert guard.verdict(4) is None  # plain not measured
    for _ in range(MIN_STEPS[False]):
        guard.add(False, 4, 4, 0.25)  # plain: 16 tok/s
    assert guard.verdict(4) is False
    assert guard.verdict(3) is False and guard.verdict(1) is None  # 3 shares 4's bucket
    for _ in range(40):
        guard.add(True, 4, 24, 1.0)
    assert guard.verdict(4) is True


def test_plain_probes_are_rarer_where_drafting_is_far_ahead():
    guard = RateGuard()
    steps = range(1, 2049)
    assert sum(guard.wants_plain_probe(1, s) for s in steps) == 2048 // PLAIN_PROBE_EVERY
    for _ in range(MIN_STEPS[True]):
        guard.add(True, 1, 10 * FAR_AHEAD + 1, 1.0)
    for _ in range(MIN_STEPS[False]):
        guard.add(False, 1, 10, 1.0)
    assert sum(guard.wants_plain_probe(1, s) for s in steps) == 2048 // PLAIN_PROBE_EVERY_FAR


def test_steps_without_time_or_requests_are_ignored():
    guard = RateGuard()
    guard.add(True, 1, 5, 0.0)
    guard.add(True, 0, 5, 1.0)
    assert not guard.steps


def test_the_allowance_grows_with_time_and_pays_for_drafting_losses_against_plain():
    guard = RateGuard()
    for _ in range(MIN_STEPS[False]):
        guard.add(False, 8, 8, 0.02)  # plain: 400 tok/s, 40 ms
    assert guard.allowance(8) == pytest.approx(EXPLORE_BUDGET * 0.04)
    assert guard.allowance(1) == 0.0  # per batch bucket
    guard.add(True, 8, 12, 0.1)  # 12 tokens that plain emits in 30 ms took 100 ms: 70 ms lost
    assert guard.allowance(8) == pytest.approx(EXPLORE_BUDGET * 0.14 - 0.07)
    guard.add(True, 8, 40, 0.05)  # 40 tokens in 50 ms, plain would need 100 ms: 50 ms gained
    assert guard.allowance(8) == pytest.approx(EXPLORE_BUDGET * 0.19 - 0.02)
    # before plain's rate is measured, nothing is charged (there is nothing to compare with)
    fresh = RateGuard()
    fresh.add(True, 2, 1, 1.0)
    assert fresh.allowance(2) == pytest.approx(EXPLORE_BUDGET * 1.0)


def test_the_allowance_saves_up_at_most_a_few_plain_steps():
    """A long plain stretch is not spent at once: the allowance stops at ALLOWANCE_CAP_STEPS
    plain steps' time, and what drafting lost is taken from that, not from the whole run's."""
    guard = RateGuard()
    for _ in range(10_000):
        guard.add(False, 4, 4, 0.01)  # plain: 400 tok/s, 10 ms a step for 100 s
    assert guard.allowance(4) == pytest.approx(ALLOWANCE_CAP_STEPS * 0.01)
    assert EXPLORE_BUDGET * guard.elapsed[4] > 10 * ALLOWANCE_CAP_STEPS * 0.01
    guard.add(True, 4, 4, 0.03)  # the tokens of one plain step in three: 20 ms lost
    assert guard.allowance(4) == pytest.approx((ALLOWANCE_CAP_STEPS - 2) * 0.01
                                               + EXPLORE_BUDGET * 0.03)
    assert guard.lost[4] == pytest.approx(0.02)
