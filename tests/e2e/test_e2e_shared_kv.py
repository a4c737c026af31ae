"""With no substitute the draft *is* the target, so every greedy draft must be accepted.

This checks the draft's plumbing on its own (shared KV cache, positions, slots, first pass over
the bonus token only) with several concurrent requests: any slip shows up as a rejection. fp32:
in bf16 the draft's one-row passes and the verify's multi-row pass may round a near-tie apart
(on AMX CPUs vLLM's bf16 attention runs its "amx" kernel), which is not a slip.
"""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.metrics import acceptance_stats

pytestmark = pytest.mark.e2e


def test_full_precision_draft_is_always_accepted(smollm2):
    # an explicit empty layer list: zero substitutes (the CPU default would substitute all)
    llm = make_llm(smollm2, {"method": "subspec", "num_speculative_tokens": 5,
                             "substitute_layers": []}, dtype="float32")
    try:
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
                   "List three colors:", "1, 2, 3, 4,", "The weather today"]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True))
        stats = acceptance_stats(llm)
    finally:
        shutdown(llm)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert stats.num_drafts > len(prompts)
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    assert stats.tau == pytest.approx(6.0)
