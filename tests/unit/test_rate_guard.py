"""The measured rates the shape tuner answers to (step/rate_guard.py), on synthetic steps."""

import pytest

from vllm_subspec.step.rate_guard import (
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
