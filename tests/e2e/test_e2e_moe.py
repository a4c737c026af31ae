"""Mixture-of-experts targets are lossless: SubSpec's tokens equal the plain engine's.

The MoE asset with real text (`smollm2_moe_path`: SmolLM2-135M's MLPs upcycled into 4 perturbed
experts, top-2, as a Mixtral) with a tree and a chain, greedy and seeded sampling, eager and in
vLLM's default compiled mode; tiny random Qwen2-MoE (shared expert, dense and sparse layers
mixed) and Qwen3-MoE (the runner applies the gate) checkpoints, greedy. fp32: exact identity.
"""

import random

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts, smollm2_moe_path, tiny_moe_path
from subspec_testing.harness import first_divergence, model_costs_decide, timed_generate
from subspec_testing.plain_reference import PlainRun

pytestmark = pytest.mark.e2e

NUM_PROMPTS, NEW_TOKENS = 6, 64
FP32 = dict(dtype="float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=NEW_TOKENS,
                         ignore_eos=True) for i in range(NUM_PROMPTS)]
DRAFTERS = {
    "tree": {"method": "subspec", "tree_width": 4, "tree_depth": 6},
    "chain": {"method": "subspec", "num_speculative_tokens": 6},
}


def _assert_identical(spec_ids, plain_ids):
    mismatches = {i: first_divergence(a, b) for i, (a, b) in enumerate(zip(spec_ids, plain_ids))
                  if a != b}
    assert not mismatches, f"prompt -> first divergent token: {mismatches}"
    assert len(spec_ids) == len(plain_ids)


def _draft_parts(worker) -> dict:
    """What the worker's draft is made of (a collective_rpc target)."""
    from vllm_subspec.draft_model.experts import SubstituteExperts
    from vllm_subspec.vllm_hooks.runner import subspec_of

    drafter = subspec_of(worker).drafter
    layers = drafter.model.layers
    return {"experts": sorted(drafter.substitutes.experts),
            "layers": len(layers),
            "substitute_experts_run": sum(
                isinstance(m, SubstituteExperts) for layer in layers for m in layer.modules()),
            "kernels": sorted({e.kernel_name for e in drafter.substitutes.experts.values()})}


@pytest.fixture(scope="module", autouse=True)
def callable_rpc():
    with pytest.MonkeyPatch.context() as mp:  # read when an engine starts
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
        yield


@pytest.fixture(scope="module")
def asset():
    return smollm2_moe_path()


@pytest.fixture(scope="module")
def prompts(asset):
    return chat_prompts(asset, mt_bench_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def plain(asset, prompts, plain_references):
    return plain_references.get(asset, FP32, {"greedy": PlainRun(prompts, GREEDY),
                                              "seeded": PlainRun(prompts, SEEDED)})


@pytest.fixture(scope="module", params=list(DRAFTERS))
def engine(request, asset, plain):
    llm = make_llm(asset, DRAFTERS[request.param], **FP32)
    yield llm
    shutdown(llm)


def test_moe_asset_greedy_identical_with_every_routed_expert_substituted(engine, prompts, plain):
    parts = engine.collective_rpc(_draft_parts)[0]
    assert parts["experts"] == list(range(30)) and parts["layers"] == 30
    assert parts["substitute_experts_run"] == 30  # each layer's copy runs its 4-bit experts
    result = timed_generate(engine, prompts, GREEDY)
    _assert_identical(result.token_ids, plain["greedy"].token_ids)
    assert all(len(t) == NEW_TOKENS for t in result.token_ids)
    # the draft's routing and 4-bit experts track the target's: most drafts are accepted
    # (6-deep shapes measured tau 5.7-6.7 here; a draft that routed or summed the experts
    # differently would not get past the first tokens)
    assert result.stats.num_drafts > 0 and result.stats.tau > 3


def test_moe_asset_seeded_sampling_identical(engine, prompts, plain):
    result = timed_generate(engine, prompts, SEEDED)
    _assert_identical(result.token_ids, plain["seeded"].token_ids)
    assert result.stats.num_drafts > 0


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_tiny_qwen_moe_greedy_identical(arch, plain_references):
    model = tiny_moe_path(arch)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 64) for _ in range(12)]}
               for _ in range(4)]
    engine = dict(skip_tokenizer_init=True, **FP32)
    reference = plain_references.get(model, engine, {"greedy": PlainRun(prompts, GREEDY)})
    llm = make_llm(model, {"method": "subspec", "tree_width": 2, "tree_depth": 4}, **engine)
    try:
        parts = llm.collective_rpc(_draft_parts)[0]
        # Qwen2-MoE's tiny checkpoint alternates dense and sparse layers (decoder_sparse_step 2)
        expected = [1, 3] if arch == "Qwen2MoeForCausalLM" else [0, 1, 2, 3]
        assert parts["experts"] == expected
        result = timed_generate(llm, prompts, GREEDY)
    finally:
        shutdown(llm)
    _assert_identical(result.token_ids, reference["greedy"].token_ids)
    assert result.stats.num_drafts > 0


def test_moe_asset_compiled_default_config_greedy_identical(asset, prompts, plain_references):
    """vLLM's default compiled mode, the default config (auto shape) made to draft: the draft's
    experts run as one opaque operator inside its graph."""
    compiled = dict(enforce_eager=False, **FP32)
    reference = plain_references.get(asset, compiled, {"greedy": PlainRun(prompts, GREEDY)})
    llm = make_llm(asset, {"method": "subspec"}, **compiled)
    try:
        llm.collective_rpc(model_costs_decide, args=(True,))
        result = timed_generate(llm, prompts, GREEDY)
    finally:
        shutdown(llm)
    _assert_identical(result.token_ids, reference["greedy"].token_ids)
    assert result.stats.num_drafts > 0
