"""benchmarks/tuner_simulation.py: the serving simulation that drives the real step session and
shape tuner at GPU costs. Its trace (closed-loop arrivals, request lengths), its model of
vLLM's scheduler (token budget, chunked prefill, drafts cut to the budget), its GPU cost model,
and that it really drives the real session: a tuner that never drafts gives plain decoding's
tokens/s exactly, and costs where drafting clearly wins give more, with every walk accepting
what the simulated target decided."""

import dataclasses

import numpy as np
import pytest

from benchmarks.tuner_simulation import (
    Acceptance,
    GpuCosts,
    Request,
    Scheduler,
    TraceConfig,
    default_options,
    default_session,
    link_costs,
    rate,
    reach_curves,
    simulate,
    step_summary,
)
from vllm_subspec.config import SubSpecOptions
from vllm_subspec.step.session import StepSession
from vllm_subspec.step.tree import TreeShape
from vllm_subspec.step.tuner.policy import StepPlan
from vllm_subspec.step.tuner.tuner import ShapeTuner


@pytest.fixture(autouse=True)
def cold_tuner(monkeypatch):
    monkeypatch.setenv("VLLM_SUBSPEC_TUNER_MEMORY", "0")  # no tuner state read or written


def test_trace_arrivals_and_lengths_are_seeded_and_in_range():
    burst = TraceConfig(users=8, arrival="burst")
    assert burst.first_arrivals() == [0.0] * 8
    staggered = TraceConfig(users=8, arrival="staggered", stagger_s=2.0, seed=3)
    times = staggered.first_arrivals()
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert (
        times == TraceConfig(users=8, arrival="staggered", stagger_s=2.0, seed=3).first_arrivals()
    )
    assert 2.0 < times[-1] < 40.0  # 7 Poisson gaps of mean 2 s
    lengths = [burst.lengths(u, j) for u in range(8) for j in range(20)]
    assert all(100 <= p <= 2000 and 100 <= r <= 600 for p, r in lengths)
    assert len(set(lengths)) > 100  # requests differ
    assert burst.lengths(3, 5) == TraceConfig(users=1).lengths(3, 5)  # any run, same requests
    assert burst.lengths(3, 5) != TraceConfig(users=1, seed=1).lengths(3, 5)
    with pytest.raises(ValueError):
        TraceConfig(arrival="poisson").first_arrivals()


def test_the_scheduler_chunks_prompts_and_cuts_drafts_to_the_token_budget():
    """vLLM v1's order: running requests first (a decode asks 1 + its drafts), then waiting
    prompts, chunked to the budget left; the input budget also pays one draft slot a request
    (a draft model's); drafts past the budget are cut, a request left out keeps its drafts."""
    alone = Scheduler(budget=2048)
    long = Request("a", 0, 0, 0.0, prompt=5000, reply=10)
    alone.add(long)
    chunks = []
    while long.prefilling:
        (s,) = alone.schedule()
        assert s.prefill and s.spec == []
        chunks.append(s.tokens)
        long.computed += s.tokens
    assert chunks == [2048, 2048, 904]

    sched = Scheduler(budget=2048, draft_slots=1)
    decode = Request("d", 0, 0, 0.0, prompt=10, reply=100, computed=10, generated=3)
    decode.spec = list(range(10))
    sched.running.append(decode)
    sched.add(Request("p", 1, 0, 0.0, prompt=5000, reply=10))
    first, chunk = sched.schedule()
    assert (first.tokens, first.spec, first.prefill) == (11, list(range(10)), False)
    # tokens left 2048 - 11 = 2037; inputs 2048 - 12 = 2036, less the chunk's own draft slot
    assert chunk.prefill and chunk.tokens == 2035
    assert decode.spec == []  # scheduled drafts are consumed

    full = Scheduler(budget=100, draft_slots=1)
    trees = [Request(f"t{i}", i, 0, 0.0, 10, 100, computed=10) for i in range(3)]
    for t in trees:
        t.spec = list(range(60))
        full.running.append(t)
    a, b = full.schedule()
    assert (a.tokens, len(a.spec)) == (61, 60)
    # cut to the budget: tokens left 100 - 61 = 39, inputs 100 - 62 = 38 less its draft slot
    assert (b.tokens, len(b.spec)) == (37, 36)
    assert full.cut_drafts == 1 and full.left_out == 1
    assert trees[2].spec == list(range(60))  # left out: keeps its drafts for a later step


def test_the_cost_model_is_flat_in_rows_where_the_link_dominates():
    costs = link_costs("pcie4")
    assert costs.subspec_offloaded == pytest.approx(26.0, abs=0.05)  # the brief's 26 of 28
    assert costs.plain_offloaded < costs.subspec_offloaded  # plain holds no substitutes
    one = costs.forward_s(costs.subspec_offloaded, [], [(1, 1000)], 1)
    assert one == pytest.approx(26.0 * 0.466 / 25.0, rel=0.02)  # the link, ~484 ms
    tree = costs.forward_s(costs.subspec_offloaded, [(289, 1000)], [], 289)
    assert one < tree < 1.03 * one  # one request's 6 x 48 tree rides the weight stream
    # 32 requests' trees: the tree kernel's measured rate makes attention count
    batch = costs.forward_s(costs.subspec_offloaded, [(289, 1500)] * 32, [], 32 * 289)
    assert batch > 1.3 * one
    assert costs.draft_pass_s(1, 1024) == pytest.approx(5.98e-3, rel=0.01)  # the H200's graph
    assert costs.draft_pass_s(8, 1024) == pytest.approx(8.27e-3, rel=0.01)
    assert costs.draft_pass_s(8, 1024) < costs.draft_pass_s(192, 1024) < 0.1
    pcie5 = link_costs("pcie5")
    assert pcie5.link_gbps == pytest.approx(54.8, rel=0.01)  # the H200's pinned copy
    assert pcie5.link_layer_s < costs.link_layer_s / 2
    fallback = GpuCosts.for_link("no files", 25.0, h200={}, host={})
    assert fallback.forward_s(26, [], [(1, 1000)], 1) == pytest.approx(one, rel=0.01)


def test_acceptance_curves_and_their_sampled_walks():
    reach = reach_curves("qwen")
    assert sorted(reach) == [1, 2, 4, 6]
    for w, r in reach.items():
        assert len(r) == 48 and all(b <= a + 1e-12 for a, b in zip(r, r[1:])), w
    assert sum(reach[1]) < sum(reach[2]) < sum(reach[4]) < sum(reach[6])
    acc = Acceptance(reach, seed=0)
    for w in (1, 6):
        walks = [acc.accepted(acc.draw(w, 48), 48) for _ in range(3000)]
        # the sampled walks keep the measured curve's tokens per tree, roughly (their
        # per-request spread moves the mean a little)
        assert np.mean(walks) == pytest.approx(sum(reach[w]), rel=0.25), w
        assert max(walks) <= 48
    assert acc.accepted(acc.draw(6, 5), 3) <= 3  # never past the verified depth


class NeverDraft(ShapeTuner):
    """A tuner configured to never draft; counts its plans."""

    plans = 0

    def plan_step(self, batch_size, *args, **kwargs):
        self.plans += 1
        return StepPlan(TreeShape(self.width, 0), False, False)


def test_a_tuner_that_never_drafts_gives_plain_decodings_tokens_exactly():
    options = default_options()
    tuners = []

    def factory(options, clock):
        tuners.append(
            NeverDraft(options.widths, options.tree_depth, options.auto_width, options.auto_depth)
        )
        return StepSession(options, tuners[-1], clock=clock)

    costs = link_costs("pcie5")
    trace = TraceConfig(
        users=2, arrival="staggered", stagger_s=5.0, prompt=(100, 300), reply=(20, 60)
    )
    sub = simulate(trace, costs, 60.0, True, session_factory=factory, options=options)
    plain = simulate(trace, costs, 60.0, False, offloaded=costs.subspec_offloaded)
    assert rate(sub, 0, 60) == rate(plain, 0, 60) > 0  # ratio 1.00: the same steps
    assert sub.requests_done == plain.requests_done >= 4
    summary = step_summary(sub, 0, 60)
    assert summary["plain_share"] == 1.0 and summary["verify_steps"] == 0
    assert tuners[0].plans == len(sub.steps)  # the session asked the tuner at every step
    # plain vLLM offloads fewer layers for the same memory: faster than SubSpec's plain steps
    assert rate(simulate(trace, costs, 60.0, False), 0, 60) > rate(plain, 0, 60)


def test_the_default_tuner_drafts_and_wins_where_drafting_clearly_pays():
    """PCIe 4, one user: the real tuner drafts (after whatever plain steps it starts with), the
    real walk accepts exactly what the simulated target decided, and tokens/s beat plain's."""
    options = dataclasses.replace(SubSpecOptions(), tree_width=2, tree_depth=8)  # small: fast
    sessions = []

    def factory(options, clock):
        sessions.append(default_session(options, clock))
        return sessions[-1]

    costs = link_costs("pcie4")
    trace = TraceConfig(users=1, prompt=(100, 300), reply=(300, 600))
    sub = simulate(trace, costs, 180.0, True, session_factory=factory, options=options)
    plain = simulate(trace, costs, 180.0, False, offloaded=costs.subspec_offloaded)
    assert sub.walk_mismatches == 0
    late = step_summary(sub, 120, 180)
    assert late["verify_steps"] > 10 and late["plain_share"] < 0.5
    assert rate(sub, 120, 180) > 2.0 * rate(plain, 120, 180)
    tuner = sessions[0].tuner
    assert sum(a.steps for a in tuner.acceptance.values()) > 10  # the tuner saw the trees
    assert sessions[0].stats.verified_trees == sum(len(s.nodes) for s in sub.steps)
