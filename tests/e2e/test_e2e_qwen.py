"""Greedy losslessness on Qwen2.5-Coder-1.5B-Instruct (28 layers, Qwen2 architecture), fp32.

Not in the default suite (the model is a 1.1 GB download on first use and fp32 verify passes of a
1.5B model are slow on CPU): the `qwen` marker is deselected by pyproject's addopts. Run with

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider -m qwen tests/e2e/test_e2e_qwen.py

Plain decoding vs a SubSpec chain (D=8) and a k=6 tree (D=8), every layer substituted, the same
batch of MT-Bench first turns: token ids must be equal. The substitutes use round-to-nearest
(`quantizer: rtn`): the output is the target's whatever the draft, and RTN keeps a cold start
short (the HQQ substitutes are exercised by the Qwen benchmarks).
"""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.harness import first_divergence, timed_generate

pytestmark = pytest.mark.qwen

NUM_PROMPTS, NEW_TOKENS = 3, 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def qwen():
    from subspec_testing.assets import qwen_coder_1p5b_path

    return qwen_coder_1p5b_path()


@pytest.fixture(scope="module")
def prompts(qwen):
    return chat_prompts(qwen, mt_bench_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def plain_ids(qwen, prompts):
    llm = make_llm(qwen, **ENGINE)
    try:
        return timed_generate(llm, prompts, GREEDY, spec=False).token_ids
    finally:
        shutdown(llm)


def test_qwen_asset_shape(qwen):
    import json
    from pathlib import Path

    config = json.loads((Path(qwen) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_hidden_layers"] == 28 and config["hidden_size"] == 1536


@pytest.mark.parametrize("shape", [{"num_speculative_tokens": 8},
                                   {"tree_width": 6, "tree_depth": 8}], ids=["chain8", "tree6x8"])
def test_qwen_greedy_identical(qwen, prompts, plain_ids, shape):
    spec = {"method": "subspec", "substitute_layers": "all", "quantizer": "rtn", **shape}
    llm = make_llm(qwen, spec, **ENGINE)
    try:
        result = timed_generate(llm, prompts, GREEDY)
    finally:
        shutdown(llm)
    assert all(len(t) == NEW_TOKENS for t in plain_ids)
    mismatches = {i: first_divergence(a, b)
                  for i, (a, b) in enumerate(zip(result.token_ids, plain_ids)) if a != b}
    assert not mismatches, f"prompt -> first divergent token: {mismatches}"
    assert result.stats.num_drafts > 0 and result.stats.tau > 1.5


SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=NEW_TOKENS,
                         ignore_eos=True) for i in range(NUM_PROMPTS)]


def test_qwen_tensor_parallel_2_identical(qwen, prompts, monkeypatch):
    """TP=2 (one core a rank; Qwen's 2 KV heads: one a rank): SubSpec with a tree and a chain
    against a TP=2 plain engine, greedy and seeded (substitutes from each rank's shard)."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 on CPU binds one core per rank")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2 = dict(ENGINE, tensor_parallel_size=2)
    llm = make_llm(qwen, **tp2)
    try:
        plain = [timed_generate(llm, prompts, p, spec=False).token_ids for p in (GREEDY, SEEDED)]
    finally:
        shutdown(llm)
    for shape in ({"num_speculative_tokens": 6}, {"tree_width": 4, "tree_depth": 6}):
        spec = {"method": "subspec", "substitute_layers": "all", "quantizer": "rtn", **shape}
        llm = make_llm(qwen, spec, **tp2)
        try:
            runs = [timed_generate(llm, prompts, p) for p in (GREEDY, SEEDED)]
        finally:
            shutdown(llm)
        for run, reference in zip(runs, plain):
            mismatches = {i: first_divergence(a, b)
                          for i, (a, b) in enumerate(zip(run.token_ids, reference)) if a != b}
            assert not mismatches, f"{shape}: prompt -> first divergent token: {mismatches}"
            assert run.stats.num_drafts > 0
        assert runs[0].stats.tau > 1.5
