"""Hundreds of concurrent decodes under a small token budget (the tiny random 4-layer Llama: this
checks shapes and losslessness, not acceptance).

max_num_seqs 512 with max_num_batched_tokens 2048 and an 8-wide tree: the step that prefills
480 short prompts drafts for all of them, and a level of more than 256 requests is
more draft rows than the drafter's buffers hold (vLLM sizes them by max_num_batched_tokens),
so the level runs in groups (step/draft.py `_level_logits`). Decode steps verify ~60 requests
at a time: the scheduler fits each step into the budget (cutting the last scheduled tree to a
breadth-first prefix).
"""

import pytest
import torch
from conftest import make_llm, shutdown

from subspec_testing.harness import assert_identical
from subspec_testing.plain_reference import PlainRun

pytestmark = pytest.mark.e2e

NUM_REQUESTS, NEW_TOKENS = 480, 12
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_num_seqs=512,
              max_num_batched_tokens=2048)
SPEC = {"method": "subspec", "tree_width": 8, "tree_depth": 4, "substitute_layers": "all",
        "quantizer": "rtn"}


def _step_stats(worker) -> dict:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    runner = subspec_of(worker)
    stats = runner.session.stats
    return {"draft_steps": stats.draft_steps, "draft_passes": stats.draft_passes,
            "max_num_tokens": runner.drafter.max_num_tokens}


def test_480_concurrent_requests_with_a_2048_token_budget(tiny_llama, plain_references,
                                                          monkeypatch):
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 61 + 1 for j in range(2 + i % 2)]}
               for i in range(NUM_REQUESTS)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    # the engine core in this process steps only when `generate` runs it, after every request
    # is added: the first step holds all 480 (a background core would start on the first)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # an in-process CPU worker replaces torch.set_num_threads with a no-op and sets this
    # process's thread count (vllm/v1/worker/cpu_worker.py:139-145): both are put back after,
    # for the tests that run next in this pytest worker
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    threads = torch.get_num_threads()
    llm = make_llm(tiny_llama, SPEC, **ENGINE)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.collective_rpc(_step_stats)[0]
    finally:
        shutdown(llm)
        monkeypatch.undo()
        torch.set_num_threads(threads)
    plain = plain_references.get(tiny_llama, ENGINE, {"wide": PlainRun(prompts, params)})
    assert stats["max_num_tokens"] == 2048
    assert_identical([list(o.outputs[0].token_ids) for o in outs], plain["wide"].token_ids)
    # unsplit, a step drafts in 1 + 3 forwards (the bonus pass, levels 1-3). The prefill step
    # of all 480 (their prompts fit the budget) drafts 3,840 rows per level: each of its 3
    # levels takes 2 forwards of at most 256 requests; decode steps hold ~61 requests (33
    # tokens each in 2048) and are not split
    assert stats["draft_passes"] - 4 * stats["draft_steps"] == 3, stats
