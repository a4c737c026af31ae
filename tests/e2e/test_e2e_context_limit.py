"""Lossless up to max_model_len: requests that run into the context limit, alone and batched with
requests that do not, for trees and chains (fp32, greedy).

Near the limit vLLM itself stops calling the drafter for the whole batch
(`gpu_model_runner.py` 0.32.0 `_input_fits_in_drafter` :4288, zero drafts :4456-4466): chains
keep that rule (k tokens from the limit); trees draft on and stop each request at its own limit
(patches.py #8, step/draft.py), so a request within k * D of the limit does not turn
speculation off for the others ("near": τ measured). Each emitted
token is re-scored with the plain target (prompt_logprobs over prompt + output, teacher
forcing): every one must be its greedy choice.
"""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.plain_reference import PlainRun

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 288
FP32 = dict(dtype="float32", max_model_len=MAX_MODEL_LEN)
SPECS = {
    "tree": {"method": "subspec", "tree_width": 6, "tree_depth": 8, "substitute_layers": "all"},
    "chain": {"method": "subspec", "num_speculative_tokens": 8, "substitute_layers": "all"},
}


@pytest.fixture(scope="module")
def prompts(smollm2):
    return chat_prompts(smollm2, mt_bench_prompts(4))


@pytest.fixture(scope="module")
def plain(smollm2):
    llm = make_llm(smollm2, **FP32)
    yield llm
    shutdown(llm)


NEAR_PROMPT_TOKENS = MAX_MODEL_LEN - 48 + 8  # within a tree's k * D = 48 of the limit


def submissions(prompts, smollm2) -> dict[str, PlainRun]:
    """Request 0 alone, into the limit (the reported case); then a batch where 1 and 3 run into
    the limit while 2 stops far before it (a second, staggered submission); then "near": a
    prompt already within 48 tokens of the limit, batched with a short request that generates
    100 tokens."""
    from transformers import AutoTokenizer

    to_limit = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ids = AutoTokenizer.from_pretrained(smollm2)("".join(prompts)).input_ids
    assert len(ids) >= NEAR_PROMPT_TOKENS
    near = TokensPrompt(prompt_token_ids=ids[:NEAR_PROMPT_TOKENS])
    return {"alone": PlainRun(prompts[:1], to_limit),
            "batch": PlainRun(prompts[1:], [to_limit, short, to_limit]),
            "near": PlainRun([near, prompts[0]],
                             [to_limit, SamplingParams(temperature=0.0, max_tokens=100,
                                                       ignore_eos=True)])}


def run(llm, prompts, smollm2):
    """(prompt ids, output ids) of every request, and the "near" submission's acceptance."""
    from subspec_testing.metrics import acceptance_stats

    outs, near = [], None
    for name, sub in submissions(prompts, smollm2).items():
        before = acceptance_stats(llm)
        outs += llm.generate(sub.prompts, sub.params, use_tqdm=False)
        if name == "near":
            near = acceptance_stats(llm) - before
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs], near


def not_greedy(plain_llm, prompt_ids, out_ids):
    """Positions of emitted tokens that are not the plain target's argmax given everything
    before them (one teacher-forced pass with prompt_logprobs)."""
    full = prompt_ids + out_ids
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    # the context must leave room for one generated token
    out = plain_llm.generate([TokensPrompt(prompt_token_ids=full[: MAX_MODEL_LEN - 1])], params,
                             use_tqdm=False)[0]
    bad = []
    for pos in range(len(prompt_ids), min(len(full), MAX_MODEL_LEN - 1)):
        lp = out.prompt_logprobs[pos]
        if lp[full[pos]].rank != 1:
            bad.append((pos, full[pos], lp[full[pos]].rank))
    if len(full) == MAX_MODEL_LEN:  # the last token: the argmax after the rest
        last = out.outputs[0].token_ids[0]
        if last != full[-1]:
            bad.append((MAX_MODEL_LEN - 1, full[-1], "last"))
    return bad


@pytest.mark.parametrize("name", sorted(SPECS))
def test_runs_into_max_model_len_losslessly(smollm2, prompts, plain, plain_references, name):
    llm = make_llm(smollm2, SPECS[name], **FP32)
    try:
        results, near = run(llm, prompts, smollm2)
    finally:
        shutdown(llm)
    reference = plain_references.get(smollm2, FP32, submissions(prompts, smollm2))
    for i in (0, 1, 3, 4):  # really ran into the limit
        assert len(results[i][0]) + len(results[i][1]) == MAX_MODEL_LEN
    bad = {i: b for i, (p, o) in enumerate(results) if (b := not_greedy(plain, p, o))}
    assert not bad, f"emitted tokens that are not the target's greedy choice: {bad}"
    assert [o for _, o in results] == reference["alone"].token_ids + \
        reference["batch"].token_ids + reference["near"].token_ids
    if name == "tree":  # within k * D = 48 of the limit from its first step, the first
        # request did not turn drafting off for the batch: vLLM's whole-batch rule would have
        # verified all-zero placeholders until it finished (τ ~ 1 over those steps)
        assert near.num_drafts > 0 and near.tau > 1.8, near
