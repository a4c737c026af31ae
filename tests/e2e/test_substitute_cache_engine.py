"""The on-disk substitute cache in an engine: a warm start quantizes nothing (a 4-layer Llama:
16 linears and the draft's lm_head)."""

import pytest

pytestmark = pytest.mark.e2e


def _substitute_counts(worker):
    from vllm_subspec.vllm_hooks.runner import subspec_of

    subs = subspec_of(worker).drafter.substitutes
    return subs.built, subs.cache_hits, sum(len(d) for d in subs.layers.values())


def test_engine_warm_start_builds_nothing(tiny_llama, tmp_path, monkeypatch):
    """A 4-layer Llama (4 x 4 linears) with a fresh cache folder: the first engine quantizes 16
    linears and the draft's lm_head and stores them, the second loads all 17 and quantizes
    none; same greedy tokens."""
    from conftest import make_llm, shutdown
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    root = tmp_path / "subs"
    spec = {"method": "subspec", "num_speculative_tokens": 4, "substitute_layers": "all",
            "quantizer": "rtn", "substitute_cache": str(root),
            "draft_lm_head": "quantized"}  # a chain's default head is the target's
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2]}, {"prompt_token_ids": [7, 1, 30]}]
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_llama, spec, skip_tokenizer_init=True)
        try:
            counts = llm.collective_rpc(_substitute_counts)[0]
            ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
        finally:
            shutdown(llm)
        runs.append((counts, ids))
        if len(runs) == 1:
            files = list(root.glob("*/*.safetensors"))
            assert len(files) == 17  # 4 layers x 4 linears, and the draft's lm_head
    (cold_counts, cold_ids), (warm_counts, warm_ids) = runs
    assert cold_counts == (17, 0, 16)
    assert warm_counts == (0, 17, 16)
    assert warm_ids == cold_ids and all(len(t) == 24 for t in warm_ids)
