"""Greedy losslessness on SmolLM2-135M-Instruct: SubSpec's token ids equal the plain engine's.

One plain engine and two SubSpec engines (all layers substituted; a partial layer list), same
settings, 10 MT-Bench first turns x 128 new tokens, fp32: exact identity is the standard there
(in bf16 a chain's multi-row verify and plain's decode rows can round a near-tie apart, e.g.
vLLM's "amx" attention kernel on AMX CPUs; bf16 is held to the near-tie standard in
test_e2e_tree.py and test_losslessness_standard.py).
"""

import pytest
from conftest import make_llm, num_kv_blocks, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.harness import count_identical, first_divergence, timed_generate
from subspec_testing.plain_reference import PlainRun
from subspec_testing.request_features import check_engine

pytestmark = pytest.mark.e2e

NUM_PROMPTS, NEW_TOKENS = 10, 128
# ignore_eos: every prompt really produces NEW_TOKENS tokens to compare.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
FP32 = dict(dtype="float32")


@pytest.fixture(scope="module")
def prompts(smollm2):
    return chat_prompts(smollm2, mt_bench_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def plain(smollm2, prompts, plain_references):
    run = plain_references.get(smollm2, FP32, {"greedy": PlainRun(prompts, GREEDY)})["greedy"]
    return run, run.kv_blocks


@pytest.fixture(scope="module")
def subspec_all(smollm2, plain):
    # Depends on `plain` so that engine is gone first: vLLM's metrics live in one global
    # Prometheus registry, and a newer engine in the process takes it over.
    llm = make_llm(smollm2, {"method": "subspec", "num_speculative_tokens": 6,
                             "substitute_layers": "all"}, **FP32)
    yield llm
    shutdown(llm)


def _assert_identical(spec_ids, plain_ids):
    mismatches = {i: first_divergence(a, b) for i, (a, b) in enumerate(zip(spec_ids, plain_ids))
                  if a != b}
    assert not mismatches, f"prompt -> first divergent token: {mismatches}"
    assert count_identical(spec_ids, plain_ids) == len(plain_ids)


def test_all_layers_greedy_identical(subspec_all, prompts, plain):
    plain_result, _ = plain
    result = timed_generate(subspec_all, prompts, GREEDY)
    assert all(len(t) == NEW_TOKENS for t in plain_result.token_ids)
    _assert_identical(result.token_ids, plain_result.token_ids)
    # The substitute is a 4-bit draft, not the target: acceptance is high but not perfect.
    stats = result.stats
    assert stats.num_drafts > 0
    assert 1.5 < stats.tau < 1 + 6
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    rates = stats.acceptance_rate_per_position
    assert len(rates) == 6 and rates[0] >= rates[-1]


def test_same_kv_blocks_as_plain(subspec_all, plain):
    # The draft writes into the target's KV cache: no second cache, so with the same KV memory
    # the engine gets exactly as many blocks (a separate draft cache would halve them).
    _, plain_blocks = plain
    assert num_kv_blocks(subspec_all) == plain_blocks


def test_sampled_requests_complete_and_accept(subspec_all, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=1234)
    result = timed_generate(subspec_all, prompts[:4], params)
    vocab = subspec_all.llm_engine.vllm_config.model_config.get_vocab_size()
    assert all(0 < len(t) <= 64 for t in result.token_ids)
    assert all(0 <= tok < vocab for t in result.token_ids for tok in t)
    assert result.stats.num_drafts > 0
    assert 0 < result.stats.num_accepted_tokens < result.stats.num_draft_tokens


def test_request_features_in_a_chain(subspec_all, feature_matrix):
    """Every request feature, greedy and seeded, in one mixed batch on a chain (k = 6): the
    chain is verified by sample-then-match too, so seeded output is plain's seeded output."""
    assert len(check_engine(subspec_all, feature_matrix)) == 29


def test_partial_layers_greedy_identical(smollm2, prompts, plain):
    plain_result, _ = plain
    llm = make_llm(smollm2, {"method": "subspec", "num_speculative_tokens": 4,
                             "substitute_layers": list(range(1, 30, 2))}, **FP32)
    try:
        result = timed_generate(llm, prompts, GREEDY)
    finally:
        shutdown(llm)
    _assert_identical(result.token_ids, plain_result.token_ids)
    assert result.stats.tau > 1.5
