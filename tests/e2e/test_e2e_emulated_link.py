"""The emulated link (subspec_testing/emulated_link.py) in a SmolLM2 engine, fp32, eager: with
`cpu_offload_gb` planning 20 of 30 layers, SubSpec substitutes exactly those and the link
charges exactly those; every target forward waits at least the link's time, draft passes do
not; greedy output is plain's under the emulation."""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing import emulated_link as el
from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.harness import assert_identical, model_costs_decide, step_stats, timed_generate
from subspec_testing.plain_reference import PlainRun

pytestmark = pytest.mark.e2e

LAYERS, LINK_S = 20, 0.1
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def test_link_charges_target_forwards_only_and_output_is_plains(
    smollm2, plain_references, monkeypatch
):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    fp32 = dict(
        dtype="float32", cpu_offload_gb=el.offload_gb_for_layers(smollm2, "float32", LAYERS)
    )
    prompts = chat_prompts(smollm2, mt_bench_prompts(4))
    plain = plain_references.get(smollm2, fp32, {"greedy": PlainRun(prompts, GREEDY)})["greedy"]
    llm = make_llm(smollm2, {"method": "subspec"}, **fp32)
    try:
        first = llm.collective_rpc(el.install_link, args=(None,))[0]
        gbps = first["bytes"] / LINK_S / 1e9
        link = llm.collective_rpc(el.install_link, args=(gbps,))[0]
        # the planned offload, exactly: the link's layers are the draft's substitutes
        assert link["installed"] and link["layers"] == list(range(LAYERS))
        assert link["substituted"] == link["layers"] and link["num_layers"] == 30
        assert link["seconds_per_forward"] == pytest.approx(LINK_S)

        # a fresh auto tuner's first steps are plain (two, for plain's rate): one-row forwards
        steps0 = llm.collective_rpc(step_stats)[0]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        stats = llm.collective_rpc(el.link_stats, args=(True,))[0]
        assert llm.collective_rpc(step_stats)[0]["plain_steps"] > steps0["plain_steps"]
        one_row = stats["record"]["by_rows"][1]
        assert one_row[0] >= 1 and one_row[2] >= LINK_S  # (count, compute s, least wall s)

        # drafting (fixed costs decide, so it drafts now): every forward waited, no pass did
        llm.collective_rpc(model_costs_decide, args=(True,))
        before = llm.collective_rpc(step_stats)[0]
        result = timed_generate(llm, prompts, GREEDY)
        after = llm.collective_rpc(step_stats)[0]
        record = llm.collective_rpc(el.link_stats)[0]["record"]
    finally:
        shutdown(llm)
    assert_identical(result.token_ids, plain.token_ids)
    assert result.stats.num_drafts > 0 and result.stats.tau > 1.5
    forwards, passes = record["forwards"], after["draft_passes"] - before["draft_passes"]
    assert passes > forwards > 0
    assert record["waited_s"] >= forwards * LINK_S
    assert all(wall >= LINK_S for _, _, wall in record["by_rows"].values())
    # one target forward a step: the wrapper counts every call of the target's forward, so
    # draft passes through it would add one a pass (not a timing: the machine may be loaded)
    steps = after["draft_steps"] - before["draft_steps"]
    assert forwards <= steps + 2, (forwards, steps)
    assert forwards * LINK_S <= result.seconds
