"""The bounded server soak (benchmarks/soak.py): SubSpec trees behind `vllm serve` under
preemption, 200 requests from 32 concurrent openai clients, checked against a plain server.

Deselected by default (tens of minutes on 2 cores); run it with

    python -m pytest -m soak tests/e2e/test_soak.py        # or: python -m benchmarks.soak

It writes benchmarks/results/soak.{json,md}.
"""


import pytest


pytestmark = [pytest.mark.soak, pytest.mark.e2e]


def test_server_soak_with_preemption():
    import soak

    report = soak.main([])
    assert report["passed"], "\n".join(report["failures"][:40])
    assert report["served"] == report["requests"] >= 200
    assert report["preemptions"] > 0
    assert report["greedy_identical"] == report["greedy_compared"] > 0
    assert report["seeded_reproduced"] == report["seeded_repeats"] > 0
    assert report["seeded_identical"] == report["seeded_compared"] > 0
