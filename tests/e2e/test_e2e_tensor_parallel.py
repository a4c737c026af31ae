"""Tensor parallelism (TP=2 on vLLM's CPU backend, one core a rank): SubSpec's tokens equal a
TP=2 plain engine's, for a chain, a tree and the default auto shape, greedy and seeded, and for
a mixture-of-experts target's tree.

Each rank builds substitutes from its own shard of every linear (row-parallel ones all-reduce
their partial products, as vLLM's do), drafts through the target's collectives, and takes rank
0's tuner decisions, so both ranks draft and verify the same trees. A random 4-layer Llama
(4 heads, 2 KV heads: one KV head a rank), fp32: exact identity.
"""

import os

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.harness import first_divergence, model_costs_decide, timed_generate
from subspec_testing.plain_reference import PlainRun

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP=2 on CPU binds one core per rank")]

TP2 = dict(tensor_parallel_size=2, skip_tokenizer_init=True, dtype="float32")
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 60 + 2 for j in range(10)]} for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=40 + i, max_tokens=32,
                         ignore_eos=True) for i in range(len(PROMPTS))]
DRAFTERS = {
    "chain": {"method": "subspec", "num_speculative_tokens": 3},
    "tree": {"method": "subspec", "tree_width": 2, "tree_depth": 4},
    "auto": {"method": "subspec"},
}


@pytest.fixture(scope="module", autouse=True)
def two_ranks():
    with pytest.MonkeyPatch.context() as mp:  # read when an engine starts
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core a rank (one NUMA node here)
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
        yield


@pytest.fixture(scope="module")
def plain(tiny_llama, plain_references):
    return plain_references.get(tiny_llama, TP2, {"greedy": PlainRun(PROMPTS, GREEDY),
                                                  "seeded": PlainRun(PROMPTS, SEEDED)})


def _rank_view(worker) -> dict:
    """What this rank's draft holds and did (a collective_rpc target)."""
    import dataclasses

    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_subspec.vllm_hooks.runner import subspec_of

    runner = subspec_of(worker)
    layer = runner.drafter.substitutes.layers[0]
    return {"rank": get_tensor_model_parallel_rank(),
            "qkv_out": layer["qkv_proj"].kernel.out_features,
            "all_reduce": {name: sub.all_reduce for name, sub in layer.items()},
            "stats": dataclasses.asdict(runner.session.stats)}


def _costs_disagree(worker) -> None:
    """Rank 0: costs that draft (`model_costs_decide`); rank 1: costs that choose plain
    (`predict_plain_faster`). A collective_rpc target."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from subspec_testing.harness import predict_plain_faster

    if get_tensor_model_parallel_rank() == 0:
        model_costs_decide(worker, True)
    else:
        predict_plain_faster(worker)


def _assert_identical(spec_ids, plain_ids):
    mismatches = {i: first_divergence(a, b) for i, (a, b) in enumerate(zip(spec_ids, plain_ids))
                  if a != b}
    assert not mismatches, f"prompt -> first divergent token: {mismatches}"


@pytest.fixture(scope="module", params=list(DRAFTERS))
def engine(request, tiny_llama, plain):
    llm = make_llm(tiny_llama, DRAFTERS[request.param], **TP2)
    if request.param == "auto":
        # rank 0's tuner is made to draft, rank 1's to predict plain faster: on its own clock
        # rank 1 would decode plainly while rank 0 drafts (a hang, or another tree); with rank
        # 0 deciding for both they draft the same trees
        llm.collective_rpc(_costs_disagree)
    yield llm
    shutdown(llm)


def test_tp2_greedy_and_seeded_identical_on_both_ranks(engine, plain):
    greedy = timed_generate(engine, PROMPTS, GREEDY)
    seeded = timed_generate(engine, PROMPTS, SEEDED)
    _assert_identical(greedy.token_ids, plain["greedy"].token_ids)
    _assert_identical(seeded.token_ids, plain["seeded"].token_ids)
    assert greedy.stats.num_drafts > 0 and seeded.stats.num_drafts > 0
    views = engine.collective_rpc(_rank_view)
    assert sorted(v["rank"] for v in views) == [0, 1]
    # each rank's substitutes are its shard: (4 query + 2 * 2 KV heads) * 32 / 2 rows
    assert all(v["qkv_out"] == 128 for v in views)
    assert all(v["all_reduce"] == {"qkv_proj": False, "o_proj": True, "gate_up_proj": False,
                                   "down_proj": True} for v in views)
    # the ranks drafted the same steps, passes and shapes (rank 0's decisions)
    stats = [v["stats"] for v in views]
    for key in ("draft_steps", "plain_steps", "draft_passes", "verified_trees", "tree_width",
                "tree_depth"):
        assert stats[0][key] == stats[1][key], key


def _expert_view(worker) -> dict:
    """This rank's routed-expert substitutes (a collective_rpc target)."""
    from vllm_subspec.draft_model.experts import _out_features
    from vllm_subspec.vllm_hooks.runner import subspec_of

    experts = subspec_of(worker).drafter.substitutes.experts
    return {i: {"all_reduce": e.all_reduce, "w13_rows": _out_features(e.kernel_name, e.w13),
                "shared_down_all_reduce": None if e.shared_expert is None
                else e.shared_expert.down_proj.all_reduce}
            for i, e in experts.items()}


def test_tp2_moe_tree_identical(plain_references):
    """A tiny Qwen2-MoE (a shared expert; sparse and dense layers mixed) at TP=2: each rank's
    expert substitutes are its shard of every expert (half the intermediate rows), their
    partial output and the shared expert's are all-reduced once, and the tokens equal TP=2
    plain decoding's, greedy and seeded."""
    from subspec_testing.assets import tiny_moe_path

    model = tiny_moe_path("Qwen2MoeForCausalLM")
    plain = plain_references.get(model, TP2, {"greedy": PlainRun(PROMPTS, GREEDY),
                                              "seeded": PlainRun(PROMPTS, SEEDED)})
    llm = make_llm(model, DRAFTERS["tree"], **TP2)
    try:
        greedy = timed_generate(llm, PROMPTS, GREEDY)
        seeded = timed_generate(llm, PROMPTS, SEEDED)
        views = llm.collective_rpc(_expert_view)
    finally:
        shutdown(llm)
    _assert_identical(greedy.token_ids, plain["greedy"].token_ids)
    _assert_identical(seeded.token_ids, plain["seeded"].token_ids)
    assert greedy.stats.num_drafts > 0 and seeded.stats.num_drafts > 0
    # the draft is the target's: 3.74 of at most 5 (a draft whose expert partial sums are not
    # all-reduced accepts 2.29: the tokens stay identical, the acceptance does not)
    assert greedy.stats.tau > 3.0, greedy.stats.tau
    from transformers import AutoConfig

    inter = AutoConfig.from_pretrained(model).moe_intermediate_size
    for view in views:
        assert view, "no sparse layer got expert substitutes"
        for layer in view.values():
            assert layer == {"all_reduce": True, "w13_rows": inter,  # 2 * inter / 2 ranks
                             "shared_down_all_reduce": False}  # summed with the routed part
