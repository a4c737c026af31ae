"""The near-tie re-scoring used where bf16 runs are not bit-exact (subspec_testing.losslessness)
finds real differences, measures them with the target, and fails on a non-tie."""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.losslessness import MAX_RANK, assert_lossless, rescore_differences

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fp32_plain(smollm2):
    llm = make_llm(smollm2, dtype="float32")
    prompts = chat_prompts(smollm2, mt_bench_prompts(2))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    yield llm, outs
    shutdown(llm)


def test_rescoring_measures_the_gap_and_flags_non_ties(fp32_plain):
    llm, outs = fp32_plain
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    plain = [list(o.outputs[0].token_ids) for o in outs]
    assert rescore_differences(llm, prompt_ids, plain, plain) == []
    # prompt 0: at position 5 emit the target's second choice instead of its first
    pos = 5
    top = outs[0].outputs[0].logprobs[pos]
    (best, lp1), (second, lp2) = sorted(((t, lp.logprob) for t, lp in top.items()),
                                        key=lambda x: -x[1])[:2]
    assert best == plain[0][pos]
    near = [plain[0][:pos] + [second], plain[1]]
    # prompt 1: emit a token the target ranks far down at position 3
    far_tok = (plain[1][3] + 1000) % 49152
    far = [plain[0], plain[1][:3] + [far_tok]]
    (d,) = rescore_differences(llm, prompt_ids, near, plain)
    assert (d.prompt_index, d.position, d.spec_token, d.plain_token) == (0, pos, second, best)
    assert d.spec_rank == 2 <= MAX_RANK
    assert d.gap_nats == pytest.approx(lp1 - lp2, abs=1e-3)  # the engine's own logprobs
    (d2,) = rescore_differences(llm, prompt_ids, far, plain)
    assert d2.prompt_index == 1 and not d2.is_near_tie
    with pytest.raises(AssertionError, match="not near-ties"):
        assert_lossless(far, plain, "bfloat16", llm, prompt_ids)
    with pytest.raises(AssertionError, match="fp32 outputs differ"):
        assert_lossless(near, plain, "float32")
