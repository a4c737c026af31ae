"""Head starts (`head_start_levels`, step/head_start.py) on the CPU engine, where they run in
their serial schedule (the passes after the verify forward, on its KV): fp32 greedy and
penalized output equals plain decoding, batched and one request at a time; head starts are
confirmed and the next steps start from them; and a head-started engine accepts about as many
tokens per tree as the same engine without them (their KV moves to the next tree's slots: a
wrong move would leave the deeper levels drafting over the wrong KV); and vLLM's profiling pass
holds their widest level on top of a step's other temporaries."""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.harness import assert_identical, step_stats, timed_generate
from subspec_testing.plain_reference import PlainRun

pytestmark = pytest.mark.e2e

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                           repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
FP32 = dict(dtype="float32")
SHAPE = {"method": "subspec", "tree_width": 4, "tree_depth": 4, "substitute_layers": "all"}


@pytest.fixture(scope="module")
def prompts(smollm2):
    return chat_prompts(smollm2, mt_bench_prompts(4))


@pytest.fixture(scope="module")
def plain(smollm2, prompts, plain_references):
    runs = plain_references.get(smollm2, FP32, {
        "greedy": PlainRun(prompts, GREEDY), "penalized": PlainRun(prompts[:2], PENALIZED)})
    return runs["greedy"], runs["penalized"]


def _peak_temporaries(worker) -> dict:
    """`SubSpecProposer.run_peak_temporaries` (what vLLM's profiling pass measures past the
    forwards) with and without head starts: peak live bytes of each."""
    import dataclasses

    import torch

    from subspec_testing.live_bytes import LiveBytes
    from vllm_subspec.vllm_hooks.runner import subspec_of

    drafter = subspec_of(worker).drafter
    options, config = drafter.options, drafter.vllm_config.model_config
    peaks = {}
    try:
        for name, levels in (("without", 0), ("with", options.head_start_levels)):
            drafter.options = dataclasses.replace(options, head_start_levels=levels)
            with torch.inference_mode(), LiveBytes() as live:
                drafter.run_peak_temporaries(config.get_hidden_size(), config.dtype)
            peaks[name] = live.peak
    finally:
        drafter.options = options
    k = max(options.widths)
    peaks["level_rows"] = min(drafter.vllm_config.scheduler_config.max_num_seqs,
                              drafter.max_num_tokens // k) * k
    peaks["vocab"] = config.get_vocab_size()
    return peaks


def _run(llm, prompts, batched: bool = True):
    stats_before = llm.collective_rpc(step_stats)[0]
    batch = timed_generate(llm, prompts, GREEDY) if batched else None
    alone = timed_generate(llm, prompts[:2], GREEDY, one_at_a_time=True)
    stats = llm.collective_rpc(step_stats)[0]
    return batch, alone, {k: stats[k] - stats_before[k] for k in
                          ("head_starts", "head_start_hits", "head_start_steps",
                           "verified_trees")}


def test_head_starts_are_lossless_confirmed_and_keep_acceptance(smollm2, prompts, plain,
                                                                monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    plain_greedy, plain_penalized = plain
    llm = make_llm(smollm2, {**SHAPE, "head_start_levels": 2}, **FP32)
    try:
        # the profiling pass's temporaries: a head start's widest level (its fp32
        # log-probabilities at least) held on top of everything a step without them holds
        peaks = llm.collective_rpc(_peak_temporaries)[0]
        assert peaks["with"] >= peaks["without"] + peaks["level_rows"] * peaks["vocab"] * 4
        batch, alone, counts = _run(llm, prompts)
        assert_identical(batch.token_ids, plain_greedy.token_ids)
        assert_identical(alone.token_ids, plain_greedy.token_ids[:2])
        penalized = timed_generate(llm, prompts[:2], PENALIZED)
        assert_identical(penalized.token_ids, plain_penalized.token_ids)
    finally:
        shutdown(llm)
    assert counts["head_starts"] == counts["verified_trees"]  # every 4 x 4 tree has room
    assert 0 < counts["head_start_hits"] <= counts["head_starts"]
    assert counts["head_start_steps"] > 0
    llm = make_llm(smollm2, SHAPE, **FP32)
    try:
        _, without_alone, none = _run(llm, prompts, batched=False)
    finally:
        shutdown(llm)
    assert none["head_starts"] == 0
    # tokens per verified tree, one request at a time (where most steps start from a hit)
    assert alone.stats.tau >= 0.9 * without_alone.stats.tau, (alone.stats.tau,
                                                              without_alone.stats.tau)
